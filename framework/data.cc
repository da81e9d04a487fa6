#include "framework/data.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <fstream>
#include <iterator>

#include "core/error.h"

namespace dtrain::framework {
namespace {

at::Generator generator(uint64_t seed, uint64_t a, uint64_t b = 0, uint64_t c = 0) {
  // A simple mix keeps streams for different (rank, step, micro) apart.
  uint64_t s = seed * 0x9E3779B97F4A7C15ULL ^ (a + 0x632BE59BD9B4E019ULL) * 0xBF58476D1CE4E5B9ULL ^
               (b + 1) * 0x94D049BB133111EBULL ^ (c + 7) * 0xD6E8FEB86659FD93ULL;
  return at::make_generator<at::CPUGeneratorImpl>(s);
}

}  // namespace

DistributedSampler::DistributedSampler(int64_t num_samples, int world_size, int rank, uint64_t seed,
                                       bool shuffle)
    : num_samples_(num_samples),
      world_size_(world_size),
      rank_(rank),
      seed_(seed),
      shuffle_(shuffle) {
  DTRAIN_CHECK_AS(ConfigError, num_samples > 0, "the data source holds no sample");
  set_epoch(0);
}

void DistributedSampler::set_epoch(int64_t epoch) {
  if (epoch == epoch_) return;
  epoch_ = epoch;
  std::vector<int64_t> order(num_samples_);
  if (shuffle_) {
    at::Tensor perm = at::randperm(num_samples_, generator(seed_, static_cast<uint64_t>(epoch)));
    std::copy(perm.data_ptr<int64_t>(), perm.data_ptr<int64_t>() + num_samples_, order.begin());
  } else {
    for (int64_t i = 0; i < num_samples_; ++i) order[i] = i;
  }
  const int64_t per_rank = (num_samples_ + world_size_ - 1) / world_size_;
  indices_.clear();
  for (int64_t k = 0; k < per_rank; ++k) {
    int64_t pos = (k * world_size_ + rank_) % num_samples_;  // wrap to pad
    indices_.push_back(order[pos]);
  }
}

ByteCorpusSource::ByteCorpusSource(const std::string& path, int64_t seq_len, int64_t batch_size,
                                   int world_size, int rank, uint64_t seed)
    : seq_len_(seq_len), batch_size_(batch_size), sampler_([&] {
        std::ifstream f(path, std::ios::binary);
        DTRAIN_CHECK_AS(ConfigError, static_cast<bool>(f), "data.path: cannot read corpus '", path,
                        "'");
        std::vector<char> bytes((std::istreambuf_iterator<char>(f)),
                                std::istreambuf_iterator<char>());
        DTRAIN_CHECK_AS(ConfigError, static_cast<int64_t>(bytes.size()) > seq_len + 1,
                        "data.path: corpus '", path, "' has ", bytes.size(),
                        " bytes, fewer than one sequence of model.seq_len + 1 = ", seq_len + 1);
        tokens_ = at::from_blob(bytes.data(), {static_cast<int64_t>(bytes.size())}, at::kByte)
                      .to(at::kLong);
        return DistributedSampler((tokens_.numel() - 1) / seq_len, world_size, rank, seed);
      }()) {}

Batch ByteCorpusSource::next(int64_t /*step*/, int64_t /*micro*/) {
  std::vector<at::Tensor> rows;
  for (int64_t b = 0; b < batch_size_; ++b) {
    if (position_ >= sampler_.indices().size()) {
      sampler_.set_epoch(sampler_.epoch() + 1);
      position_ = 0;
    }
    int64_t start = sampler_.indices()[position_++] * seq_len_;
    rows.push_back(tokens_.narrow(0, start, seq_len_ + 1));
  }
  at::Tensor w = at::stack(rows);
  return {w.narrow(1, 0, seq_len_).contiguous(), w.narrow(1, 1, seq_len_).contiguous()};
}

SyntheticLMSource::SyntheticLMSource(int64_t vocab, int64_t seq_len, int64_t batch_size, int rank,
                                     uint64_t seed)
    : vocab_(vocab), seq_len_(seq_len), batch_size_(batch_size), rank_(rank), seed_(seed) {}

Batch SyntheticLMSource::next(int64_t step, int64_t micro) {
  auto gen = generator(seed_, static_cast<uint64_t>(rank_), static_cast<uint64_t>(step),
                       static_cast<uint64_t>(micro));
  at::Tensor start = at::randint(0, vocab_, {batch_size_, 1}, gen);
  at::Tensor stride = at::randint(1, 4, {batch_size_, 1}, gen);
  at::Tensor pos = at::arange(seq_len_ + 1, at::kLong).unsqueeze(0);
  at::Tensor seq = (start + stride * pos).remainder(vocab_);
  return {seq.narrow(1, 0, seq_len_).contiguous(), seq.narrow(1, 1, seq_len_).contiguous()};
}

SyntheticClassificationSource::SyntheticClassificationSource(int64_t in_features, int64_t classes,
                                                             int64_t batch_size, int rank,
                                                             uint64_t seed)
    : in_features_(in_features),
      classes_(classes),
      batch_size_(batch_size),
      rank_(rank),
      seed_(seed) {
  teacher_ = at::randn({in_features, classes}, generator(seed, 0xFFFF));
}

Batch SyntheticClassificationSource::next(int64_t step, int64_t micro) {
  auto gen = generator(seed_, static_cast<uint64_t>(rank_), static_cast<uint64_t>(step),
                       static_cast<uint64_t>(micro));
  at::Tensor x = at::randn({batch_size_, in_features_}, gen);
  return {x, at::matmul(x, teacher_).argmax(1)};
}

}  // namespace dtrain::framework
