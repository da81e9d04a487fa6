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
                                   int64_t micro_batches, int world_size, int rank, uint64_t seed,
                                   int64_t eval_samples)
    : seq_len_(seq_len),
      batch_size_(batch_size),
      micro_batches_(micro_batches),
      eval_samples_(eval_samples),
      sampler_([&] {
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
        description_ = "corpus " + path + " (" + std::to_string(bytes.size() / 1024) + " KiB)";
        // The last eval_samples windows are held out for validation.
        const int64_t windows = (tokens_.numel() - 1) / seq_len;
        DTRAIN_CHECK_AS(ConfigError, windows > eval_samples, "data.path: corpus '", path,
                        "' holds ", windows,
                        " windows of model.seq_len + 1 bytes, too few to "
                        "hold out ",
                        eval_samples, " for validation and train on the rest");
        return DistributedSampler(windows - eval_samples, world_size, rank, seed);
      }()) {}

Batch ByteCorpusSource::windows(const std::vector<int64_t>& starts) const {
  std::vector<at::Tensor> rows;
  for (int64_t start : starts) rows.push_back(tokens_.narrow(0, start, seq_len_ + 1));
  at::Tensor w = at::stack(rows);
  return {w.narrow(1, 0, seq_len_).contiguous(), w.narrow(1, 1, seq_len_).contiguous()};
}

Batch ByteCorpusSource::next(int64_t step, int64_t micro) {
  const int64_t per_epoch = static_cast<int64_t>(sampler_.indices().size());
  std::vector<int64_t> starts;
  for (int64_t b = 0; b < batch_size_; ++b) {
    const int64_t k = (step * micro_batches_ + micro) * batch_size_ + b;  // this rank's k-th
    sampler_.set_epoch(k / per_epoch);
    starts.push_back(sampler_.indices()[k % per_epoch] * seq_len_);
  }
  return windows(starts);
}

Batch ByteCorpusSource::validation(int rank, int world) {
  const int64_t first = sampler_.num_samples();  // the held-out windows follow the trained ones
  std::vector<int64_t> starts;
  for (int64_t i = rank; i < eval_samples_; i += world) starts.push_back((first + i) * seq_len_);
  return windows(starts);
}

SyntheticLMSource::SyntheticLMSource(int64_t vocab, int64_t seq_len, int64_t batch_size, int rank,
                                     uint64_t seed, int64_t eval_samples)
    : vocab_(vocab),
      seq_len_(seq_len),
      batch_size_(batch_size),
      eval_samples_(eval_samples),
      rank_(rank),
      seed_(seed) {}

namespace {

// Arithmetic progressions mod vocab, one per row, from `gen`.
Batch progressions(int64_t rows, int64_t vocab, int64_t seq_len, at::Generator gen) {
  at::Tensor start = at::randint(0, vocab, {rows, 1}, gen);
  at::Tensor stride = at::randint(1, 4, {rows, 1}, gen);
  at::Tensor pos = at::arange(seq_len + 1, at::kLong).unsqueeze(0);
  at::Tensor seq = (start + stride * pos).remainder(vocab);
  return {seq.narrow(1, 0, seq_len).contiguous(), seq.narrow(1, 1, seq_len).contiguous()};
}

// Rows rank, rank + world, ... of a fixed batch.
Batch share(const Batch& all, int rank, int world) {
  at::Tensor idx = at::arange(rank, all.inputs.size(0), world, at::kLong);
  return {all.inputs.index_select(0, idx), all.targets.index_select(0, idx)};
}

constexpr uint64_t kValidationStream = 0xE7A1;

}  // namespace

Batch SyntheticLMSource::next(int64_t step, int64_t micro) {
  return progressions(batch_size_, vocab_, seq_len_,
                      generator(seed_, static_cast<uint64_t>(rank_), static_cast<uint64_t>(step),
                                static_cast<uint64_t>(micro)));
}

Batch SyntheticLMSource::validation(int rank, int world) {
  return share(progressions(eval_samples_, vocab_, seq_len_, generator(seed_, kValidationStream)),
               rank, world);
}

SyntheticClassificationSource::SyntheticClassificationSource(int64_t in_features, int64_t classes,
                                                             int64_t batch_size, int rank,
                                                             uint64_t seed, int64_t eval_samples)
    : in_features_(in_features),
      classes_(classes),
      batch_size_(batch_size),
      eval_samples_(eval_samples),
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

Batch SyntheticClassificationSource::validation(int rank, int world) {
  at::Tensor x = at::randn({eval_samples_, in_features_}, generator(seed_, kValidationStream));
  return share({x, at::matmul(x, teacher_).argmax(1)}, rank, world);
}

}  // namespace dtrain::framework
