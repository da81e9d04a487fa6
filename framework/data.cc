#include "framework/data.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "core/error.h"
#include "core/faults.h"
#include "core/glob.h"

namespace dtrain::framework {
namespace {

at::Generator generator(uint64_t seed, uint64_t a, uint64_t b = 0, uint64_t c = 0) {
  // A simple mix keeps streams for different (rank, step, micro) apart.
  uint64_t s = seed * 0x9E3779B97F4A7C15ULL ^ (a + 0x632BE59BD9B4E019ULL) * 0xBF58476D1CE4E5B9ULL ^
               (b + 1) * 0x94D049BB133111EBULL ^ (c + 7) * 0xD6E8FEB86659FD93ULL;
  return at::make_generator<at::CPUGeneratorImpl>(s);
}

// FNV-1a, 64 bits: a stable hash of the data's content for its fingerprint (not a checksum
// against damage: the checkpoints' own files have xxh64).
constexpr uint64_t kFnvOffset = 0xcbf29ce484222325ULL;
uint64_t fnv1a(const void* data, size_t n, uint64_t h = kFnvOffset) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ULL;
  return h;
}

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
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
  order_.resize(static_cast<size_t>(num_samples_));
  if (shuffle_) {
    at::Tensor perm = at::randperm(num_samples_, generator(seed_, static_cast<uint64_t>(epoch)));
    std::copy(perm.data_ptr<int64_t>(), perm.data_ptr<int64_t>() + num_samples_, order_.begin());
  } else {
    for (int64_t i = 0; i < num_samples_; ++i) order_[i] = i;
  }
  indices_.clear();
  for (int64_t k = 0; k < per_epoch(); ++k) {
    int64_t pos = (k * world_size_ + rank_) % num_samples_;  // wrap to pad
    indices_.push_back(order_[pos]);
  }
}

DataPosition DistributedSampler::locate(int64_t k) const {
  const int64_t w = world_size_, per = per_epoch();
  // Without an origin (0 at position 0 of epoch 0) the formula below is this one.
  if (k < origin_k_) return {k / per, (k % per) * w};
  const int64_t rel = k - origin_k_;
  const int64_t first = (num_samples_ - origin_.position + w - 1) / w;  // the origin epoch's rest
  if (rel < first) return {origin_.epoch, origin_.position + rel * w};
  const int64_t later = rel - first;
  return {origin_.epoch + 1 + later / per, (later % per) * w};
}

int64_t DistributedSampler::sample(int64_t k) {
  const DataPosition at = locate(k);
  set_epoch(at.epoch);
  return order_[static_cast<size_t>((at.position + rank_) % num_samples_)];
}

DataPosition DistributedSampler::position(int64_t k) const { return locate(k); }

void DistributedSampler::set_origin(int64_t k, DataPosition at) {
  DTRAIN_CHECK_AS(ConfigError, k >= 0 && at.epoch >= 0 && at.position >= 0,
                  "a data position of epoch ", at.epoch, ", position ", at.position,
                  " cannot be resumed from");
  if (at.position >= num_samples_) at = {at.epoch + 1, 0};  // the epoch was over
  origin_k_ = k;
  origin_ = at;
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
        fingerprint_ = "corpus of " + std::to_string(bytes.size()) + " bytes, fnv64 " +
                       hex64(fnv1a(bytes.data(), bytes.size())) + ", data.seed " +
                       std::to_string(seed);
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

namespace {

// The samples of micro-batch `micro` of `step` for this rank: its k-th samples onward, k
// counted over steps, micro-batches and batch rows, across epochs.
std::vector<int64_t> drawn(DistributedSampler& sampler, int64_t step, int64_t micro,
                           int64_t batch_size, int64_t micro_batches) {
  std::vector<int64_t> ids;
  for (int64_t b = 0; b < batch_size; ++b) {
    ids.push_back(sampler.sample((step * micro_batches + micro) * batch_size + b));
  }
  return ids;
}

// The record of every sample drawn, for a test (DTRAIN_TEST_RECORD_SAMPLES=<file>): one line
// "<step> <micro> <sample ids...>" per micro-batch, appended to <file>.<attempt>.<rank> (the
// launcher's restart count, TORCHELASTIC_RESTART_COUNT).
void record_samples(const DistributedSampler& sampler, int64_t step, int64_t micro,
                    const std::vector<int64_t>& ids) {
  const std::optional<std::string> path = faults::text("RECORD_SAMPLES");
  if (!path) return;
  const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT");
  std::ofstream f(*path + "." + (attempt != nullptr && *attempt ? attempt : "0") + "." +
                      std::to_string(sampler.rank()),
                  std::ios::app);
  f << step << " " << micro;
  for (int64_t id : ids) f << " " << id;
  f << "\n";
}

}  // namespace

Batch ByteCorpusSource::next(int64_t step, int64_t micro) {
  std::vector<int64_t> starts = drawn(sampler_, step, micro, batch_size_, micro_batches_);
  record_samples(sampler_, step, micro, starts);
  for (auto& s : starts) s *= seq_len_;
  return windows(starts);
}

std::optional<DataPosition> ByteCorpusSource::position(int64_t step) const {
  return sampler_.position(step * micro_batches_ * batch_size_);
}

void ByteCorpusSource::resume_at(int64_t step, DataPosition at) {
  sampler_.set_origin(step * micro_batches_ * batch_size_, at);
}

Batch ByteCorpusSource::validation(int rank, int world) {
  const int64_t first = sampler_.num_samples();  // the held-out windows follow the trained ones
  std::vector<int64_t> starts;
  for (int64_t i = rank; i < eval_samples_; i += world) starts.push_back((first + i) * seq_len_);
  return windows(starts);
}

namespace {

using File = TokenFileSource::File;

// An .npy file's header: the token type and count, and where the data starts.
void read_npy_header(File& f, const unsigned char* bytes, size_t size, const std::string& key) {
  auto fail = [&](const std::string& why) {
    DTRAIN_FAIL(ConfigError, key, ": '", f.path, "' ", why);
  };
  if (size < 10 || std::memcmp(bytes, "\x93NUMPY", 6) != 0) fail("is not an .npy file");
  const int major = bytes[6];
  size_t header_len = 0, start = 0;
  if (major == 1) {
    header_len = bytes[8] | (static_cast<size_t>(bytes[9]) << 8);
    start = 10;
  } else if (major == 2 || major == 3) {
    if (size < 12) fail("is truncated in its header");
    header_len = bytes[8] | (static_cast<size_t>(bytes[9]) << 8) |
                 (static_cast<size_t>(bytes[10]) << 16) | (static_cast<size_t>(bytes[11]) << 24);
    start = 12;
  } else {
    fail("has .npy format version " + std::to_string(major) + ", which dtrain does not read");
  }
  if (start + header_len > size) fail("is truncated in its header");
  const std::string header(reinterpret_cast<const char*>(bytes + start), header_len);
  auto value = [&](const std::string& name) {
    const size_t at = header.find("'" + name + "'");
    if (at == std::string::npos) fail("has no '" + name + "' in its .npy header");
    size_t v = header.find(':', at) + 1;
    while (v < header.size() && header[v] == ' ') ++v;
    return v;
  };
  size_t d = value("descr");
  const std::string descr = header.substr(d + 1, header.find('\'', d + 1) - d - 1);
  if (descr == "<u2" || descr == "|u2") {
    f.item = 2;
  } else if (descr == "<u4") {
    f.item = 4;
  } else if (descr == "<i4") {
    f.item = 4;
    f.is_signed = true;
  } else if (descr == "<i8") {
    f.item = 8;
    f.is_signed = true;
  } else {
    fail("holds dtype '" + descr +
         "'; token files hold uint16, uint32, int32 or int64 (little-endian)");
  }
  if (header.compare(value("fortran_order"), 4, "True") == 0) fail("is in Fortran order");
  size_t s = value("shape");
  const std::string shape = header.substr(s, header.find(')', s) - s + 1);
  std::string compact;  // "(N,)" for a flat array
  for (char ch : shape) {
    if (ch != ' ') compact += ch;
  }
  int64_t n = -1;
  int used = 0;
  if (std::sscanf(compact.c_str(), "(%ld,)%n", &n, &used) != 1 || n < 0 ||
      used != static_cast<int>(compact.size())) {
    fail("has shape " + shape + "; a token file is one flat array, shape (N,)");
  }
  f.tokens = bytes + start + header_len;
  const size_t data = size - start - header_len;
  if (data < static_cast<size_t>(n) * f.item) {
    fail("is truncated: its header says " + std::to_string(n) + " tokens, it holds " +
         std::to_string(data / f.item));
  }
  f.count = n;
}

// Maps every file `pattern` matches.
std::vector<File> map_files(const std::string& pattern, const std::string& bin_dtype,
                            int64_t seq_len, const std::string& key) {
  std::vector<File> files;
  for (const auto& path : glob_files(pattern)) {
    File f;
    f.path = path;
    files.push_back(f);
    File& m = files.back();
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    DTRAIN_CHECK_AS(ConfigError, fd >= 0, key, ": cannot open '", path,
                    "': ", std::strerror(errno));
    struct stat st {};
    ::fstat(fd, &st);
    const size_t size = static_cast<size_t>(st.st_size);
    if (size > 0) {
      m.map = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
      if (m.map == MAP_FAILED) m.map = nullptr;
    }
    ::close(fd);
    DTRAIN_CHECK_AS(ConfigError, size == 0 || m.map != nullptr, key, ": cannot map '", path,
                    "': ", std::strerror(errno));
    m.map_bytes = size;
    if (m.map != nullptr) ::madvise(m.map, size, MADV_RANDOM);
    const auto* bytes = static_cast<const unsigned char*>(m.map);
    if (path.size() > 4 && path.compare(path.size() - 4, 4, ".npy") == 0) {
      read_npy_header(m, bytes, size, key);
    } else {
      m.item = bin_dtype == "uint32" ? 4 : 2;
      DTRAIN_CHECK_AS(ConfigError, size % m.item == 0, key, ": '", path, "' has ", size,
                      " bytes, not a whole number of ", bin_dtype,
                      " tokens: truncated, or not data.dtype ", bin_dtype);
      m.tokens = bytes;
      m.count = static_cast<int64_t>(size / m.item);
    }
    m.windows = m.count > seq_len ? (m.count - 1) / seq_len : 0;
  }
  DTRAIN_CHECK_AS(ConfigError, !files.empty(), key, ": '", pattern, "' matches no file");
  int64_t first = 0;
  for (auto& f : files) {
    f.first_window = first;
    first += f.windows;
  }
  return files;
}

int64_t total_windows(const std::vector<File>& files) {
  return files.empty() ? 0 : files.back().first_window + files.back().windows;
}

int64_t total_tokens(const std::vector<File>& files) {
  int64_t n = 0;
  for (const auto& f : files) n += f.count;
  return n;
}

void unmap(std::vector<File>& files) {
  for (auto& f : files) {
    if (f.map != nullptr) ::munmap(f.map, f.map_bytes);
    f.map = nullptr;
  }
}

}  // namespace

TokenFileSource::TokenFileSource(const std::string& pattern, const std::string& bin_dtype,
                                 const std::string& val_pattern, int64_t vocab, int64_t seq_len,
                                 int64_t batch_size, int64_t micro_batches, int world_size,
                                 int rank, uint64_t seed, int64_t eval_samples, double val_fraction)
    : train_(map_files(pattern, bin_dtype, seq_len, "data.path")),
      val_(val_pattern.empty() ? std::vector<File>()
                               : map_files(val_pattern, bin_dtype, seq_len, "data.val_path")),
      vocab_(vocab),
      seq_len_(seq_len),
      batch_size_(batch_size),
      micro_batches_(micro_batches),
      eval_samples_(eval_samples),
      sampler_([&] {
        const int64_t windows = total_windows(train_);
        const int64_t held_out =
            val_.empty()
                ? std::max(
                      eval_samples,
                      // ceil, forgiving the product's rounding (0.07 x 100 = 7.000000000000001)
                      static_cast<int64_t>(
                          std::ceil(val_fraction * static_cast<double>(windows) - 1e-9)))
                : 0;
        if (windows <= held_out) {
          unmap(train_);
          unmap(val_);
          DTRAIN_FAIL(ConfigError, "data.path: '", pattern, "' holds ", total_tokens(train_),
                      " tokens in ", windows, " window(s) of model.seq_len + 1 = ", seq_len + 1,
                      " tokens, too few to ",
                      held_out > 0 ? "hold out " + std::to_string(held_out) +
                                         " for validation (train.eval_samples, data.val_fraction; "
                                         "or give data.val_path) and "
                                   : std::string(),
                      "train on the rest");
        }
        if (!val_.empty() && total_windows(val_) < eval_samples) {
          unmap(train_);
          unmap(val_);
          DTRAIN_FAIL(ConfigError, "data.val_path: '", val_pattern, "' holds ", total_windows(val_),
                      " window(s) of model.seq_len + 1 = ", seq_len + 1,
                      " tokens, fewer than train.eval_samples ", eval_samples);
        }
        val_first_ = val_.empty() ? windows - held_out : 0;
        val_windows_ = val_.empty() ? held_out : total_windows(val_);
        return DistributedSampler(windows - held_out, world_size, rank, seed);
      }()) {
  // Each file's size and its first and last 64 KiB: a 100 GB dataset is fingerprinted at once.
  auto files_hash = [](const std::vector<File>& files, uint64_t h) {
    constexpr size_t kSample = 64 << 10;
    for (const File& f : files) {
      const size_t bytes = static_cast<size_t>(f.count) * static_cast<size_t>(f.item);
      h = fnv1a(&bytes, sizeof(bytes), h);
      h = fnv1a(f.tokens, std::min(bytes, kSample), h);
      if (bytes > kSample) h = fnv1a(f.tokens + bytes - kSample, kSample, h);
    }
    return h;
  };
  fingerprint_ = "tokens: " + std::to_string(train_.size()) + " training file(s) of " +
                 std::to_string(total_tokens(train_)) + " tokens, " + std::to_string(val_.size()) +
                 " validation file(s), fnv64 " +
                 hex64(files_hash(val_, files_hash(train_, kFnvOffset))) + ", data.seed " +
                 std::to_string(seed);
  const int64_t tokens = total_tokens(train_);
  description_ =
      "tokens " + pattern + " (" + std::to_string(train_.size()) + " file(s), " +
      (tokens >= 1000000 ? std::to_string(tokens / 1000000) + "M" : std::to_string(tokens)) +
      " tokens)";
}

TokenFileSource::~TokenFileSource() {
  unmap(train_);
  unmap(val_);
}

Batch TokenFileSource::windows(const std::vector<File>& files,
                               const std::vector<int64_t>& ids) const {
  at::Tensor w = at::empty({static_cast<int64_t>(ids.size()), seq_len_ + 1}, at::kLong);
  int64_t* out = w.data_ptr<int64_t>();
  for (int64_t id : ids) {
    auto it = std::upper_bound(files.begin(), files.end(), id,
                               [](int64_t v, const File& f) { return v < f.first_window; });
    const File& f = *(it - 1);
    const int64_t start = (id - f.first_window) * seq_len_;
    for (int64_t t = 0; t <= seq_len_; ++t, ++out) {
      const unsigned char* p = f.tokens + (start + t) * f.item;
      int64_t v = 0;
      if (f.item == 2) {
        uint16_t x;
        std::memcpy(&x, p, 2);
        v = x;
      } else if (f.item == 4) {
        if (f.is_signed) {
          int32_t x;
          std::memcpy(&x, p, 4);
          v = x;
        } else {
          uint32_t x;
          std::memcpy(&x, p, 4);
          v = x;
        }
      } else {
        std::memcpy(&v, p, 8);
      }
      DTRAIN_CHECK_AS(ConfigError, v >= 0 && v < vocab_, "data: '", f.path, "' holds token id ", v,
                      " at token ", start + t, ", outside model.vocab_size ", vocab_,
                      " (is the tokenizer's vocabulary larger, or the file another dtype than "
                      "data.dtype?)");
      *out = v;
    }
  }
  return {w.narrow(1, 0, seq_len_).contiguous(), w.narrow(1, 1, seq_len_).contiguous()};
}

Batch TokenFileSource::next(int64_t step, int64_t micro) {
  std::vector<int64_t> ids = drawn(sampler_, step, micro, batch_size_, micro_batches_);
  record_samples(sampler_, step, micro, ids);
  return windows(train_, ids);
}

std::optional<DataPosition> TokenFileSource::position(int64_t step) const {
  return sampler_.position(step * micro_batches_ * batch_size_);
}

void TokenFileSource::resume_at(int64_t step, DataPosition at) {
  sampler_.set_origin(step * micro_batches_ * batch_size_, at);
}

Batch TokenFileSource::validation(int rank, int world) {
  std::vector<int64_t> ids;
  // eval_samples windows spread evenly over the split (the first ones when it holds no more).
  for (int64_t i = rank; i < eval_samples_; i += world) {
    ids.push_back(val_first_ + i * val_windows_ / eval_samples_);
  }
  return windows(val_.empty() ? train_ : val_, ids);
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

std::string SyntheticLMSource::fingerprint() const {
  return "synthetic tokens: vocabulary " + std::to_string(vocab_) + ", data.seed " +
         std::to_string(seed_);
}

std::string SyntheticClassificationSource::fingerprint() const {
  return "synthetic classification: " + std::to_string(in_features_) + " features, " +
         std::to_string(classes_) + " classes, data.seed " + std::to_string(seed_);
}

std::string tokenizer_fingerprint(const std::string& token_meta) {
  if (token_meta.empty()) return "";
  std::ifstream f(token_meta);
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  // dtrain-prepare writes one "key": value per line; its tokenizer, its model file, its vocabulary.
  auto value_of = [&](const std::string& key) {
    const size_t at = text.find("\"" + key + "\":");
    if (at == std::string::npos) return std::string();
    size_t begin = text.find_first_not_of(" ", at + key.size() + 3);
    size_t end = text.find_first_of(",\n", begin);
    std::string v = text.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
    if (v.size() >= 2 && v.front() == '"' && v.back() == '"') v = v.substr(1, v.size() - 2);
    return v;
  };
  const std::string name = value_of("tokenizer"), file = value_of("tokenizer_file"),
                    vocab = value_of("vocab_size");
  if (name.empty()) return "";
  std::string out = name + " tokenizer, vocabulary " + vocab;
  if (!file.empty()) {
    const std::filesystem::path beside =
        std::filesystem::path(token_meta).parent_path() / std::filesystem::path(file).filename();
    for (const std::filesystem::path& p : {beside, std::filesystem::path(file)}) {
      std::ifstream m(p, std::ios::binary);
      if (!m) continue;
      const std::string bytes((std::istreambuf_iterator<char>(m)),
                              std::istreambuf_iterator<char>());
      out += ", model file of " + std::to_string(bytes.size()) + " bytes, fnv64 " +
             hex64(fnv1a(bytes.data(), bytes.size()));
      break;
    }
  }
  return out;
}

}  // namespace dtrain::framework
