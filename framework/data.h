// Data for the trainer: where batches come from and how ranks split them.
//
// DistributedSampler: each epoch, a permutation of [0, n) drawn from (seed, epoch), padded by
// wrapping to a multiple of the world size; rank r takes positions r, r + world, ... So
// ranks never share a sample within an epoch, and the order is the same for a given seed
// and epoch on any machine (PyTorch's DistributedSampler semantics, drop_last=false).
//
// ByteCorpus: a text file as bytes (vocabulary 256); sample i is the window of seq_len + 1
// bytes starting at i * seq_len (inputs = first seq_len, targets = shifted by one).
//
// BatchSource: what the trainer pulls per micro-batch. Every batch is a function of (step,
// micro), so a resumed run continues exactly where the checkpoint left it: the corpus
// source's index in its sampler is (step x micro_batches + micro) x batch_size, and the
// synthetic sources draw from a generator seeded by (seed, rank, step, micro). A run resumed
// at another world size also needs where the global order stood (position(), kept in the
// checkpoint; resume_at() continues from it), since each rank's index strides by the world. For the
// TransformerLM, synthetic sequences follow a per-sequence arithmetic progression mod vocab
// (learnable, so the loss falls); for the MLP, labels come from a fixed random teacher.
//
// Validation: a fixed set of `eval_samples` samples, the same at any world size (the corpus'
// last windows, never trained on; synthetic ones from a seed of their own); rank r takes
// samples r, r + world, ..., so the mean loss over all ranks' shares is the same set's at
// any world size.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "framework/checkpoint/progress.h"

namespace dtrain::framework {

class DistributedSampler {
 public:
  DistributedSampler(int64_t num_samples, int world_size, int rank, uint64_t seed,
                     bool shuffle = true);
  void set_epoch(int64_t epoch);
  int64_t epoch() const { return epoch_; }
  // This rank's sample indices for the current epoch (without an origin).
  const std::vector<int64_t>& indices() const { return indices_; }
  int64_t num_samples() const { return num_samples_; }
  int rank() const { return rank_; }

  // This rank's k-th sample (k counted over steps, micro-batches and rows, across epochs).
  // Without an origin: position k x world + rank of epoch k / ceil(n / world), as indices().
  // From an origin (k0, p) on: the rest of p's epoch, positions p.position + (k - k0) x world +
  // rank (wrapping to its start to pad, as an epoch's tail is padded), then whole epochs.
  int64_t sample(int64_t k);
  // Where the stream stands before this rank's k-th sample (the same on every rank).
  DataPosition position(int64_t k) const;
  // Continue from `at` with this rank's k-th sample: a run resumed at another world size.
  void set_origin(int64_t k, DataPosition at);

 private:
  int64_t per_epoch() const { return (num_samples_ + world_size_ - 1) / world_size_; }
  // This rank's index k, relative to the origin, as (epoch, global position) of its sample.
  DataPosition locate(int64_t k) const;

  int64_t num_samples_;
  int world_size_;
  int rank_;
  uint64_t seed_;
  bool shuffle_;
  int64_t epoch_ = -1;
  std::vector<int64_t> order_;    // epoch_'s permutation of [0, n)
  std::vector<int64_t> indices_;  // this rank's positions of it, padded
  int64_t origin_k_ = 0;
  DataPosition origin_ = {};
};

struct Batch {
  at::Tensor inputs;
  at::Tensor targets;
};

class BatchSource {
 public:
  virtual ~BatchSource() = default;
  // Micro-batch `micro` of optimizer step `step`: `batch_size` samples for this rank.
  virtual Batch next(int64_t step, int64_t micro) = 0;
  // This rank's share of the validation set (see above).
  virtual Batch validation(int rank, int world) = 0;
  // Tokens (LM) or samples (MLP) per micro-batch, for throughput.
  virtual int64_t items_per_sample() const = 0;
  // What the data is, for the run's first log line ("corpus GPL-3 (35 KB)").
  virtual std::string describe() const { return "custom data"; }
  // Where the data stands before data step `step` (the same on every rank), for a checkpoint:
  // empty for a source whose batches follow from the step alone (the synthetic ones).
  virtual std::optional<DataPosition> position(int64_t step) const {
    (void)step;
    return std::nullopt;
  }
  // From data step `step` on, continue from `at` (a checkpoint's position, written at any
  // world size): every sample of the epoch is drawn once across the change.
  virtual void resume_at(int64_t step, DataPosition at) {
    (void)step;
    (void)at;
  }
  // What tells this data from other data, for a checkpoint to record and a resume to compare:
  // the content's size and a hash (of the whole corpus; of each token file's size and its first
  // and last 64 KiB), and the order's seed. Equal for the same data under another path. Empty:
  // not known (a user's source), so never compared.
  virtual std::string fingerprint() const { return ""; }
};

// The tokenizer dtrain-prepare's meta.json (at `token_meta`) names: its kind, vocabulary and
// a hash of its model file when that file is found (beside meta.json, or where it says).
// Empty when `token_meta` is empty or names no tokenizer.
std::string tokenizer_fingerprint(const std::string& token_meta);

class ByteCorpusSource : public BatchSource {
 public:
  ByteCorpusSource(const std::string& path, int64_t seq_len, int64_t batch_size,
                   int64_t micro_batches, int world_size, int rank, uint64_t seed,
                   int64_t eval_samples = 12);
  Batch next(int64_t step, int64_t micro) override;
  Batch validation(int rank, int world) override;
  int64_t items_per_sample() const override { return seq_len_; }
  std::string describe() const override { return description_; }
  std::optional<DataPosition> position(int64_t step) const override;
  void resume_at(int64_t step, DataPosition at) override;
  std::string fingerprint() const override { return fingerprint_; }
  int64_t num_samples() const { return sampler_.num_samples(); }

 private:
  Batch windows(const std::vector<int64_t>& starts) const;

  std::string description_, fingerprint_;
  at::Tensor tokens_;  // int64 bytes
  int64_t seq_len_, batch_size_, micro_batches_, eval_samples_;
  DistributedSampler sampler_;
};

// TokenFileSource: token files as nanoGPT and Megatron's preprocessing leave them, memory-
// mapped, never read whole: flat .bin files of uint16 or uint32 tokens (nanoGPT's train.bin)
// and 1-D .npy arrays (uint16, uint32, int32 or int64), one file or a glob of many. Sample i
// is the window of seq_len + 1 tokens at i x seq_len within one file (windows never span
// two files; each file's trailing partial window is unused), sampled like the corpus' windows
// (DistributedSampler over all files' windows, resumed from the step alone). Validation split:
// val_path's files when given, else the training files' last windows, held out of training:
// ceil(val_fraction x windows) of them, and at least eval_samples. The validation set is
// eval_samples windows spread evenly over the split (all of it when it holds no more). A file that
// is truncated (not a whole number of tokens, or shorter than its .npy header says), of an unknown
// dtype, shorter than one window, or holding a token id outside [0, vocab) is an error naming the
// file (the id check is made on each window as it is read, so a 100 GB dataset opens at once).
class TokenFileSource : public BatchSource {
 public:
  TokenFileSource(const std::string& pattern, const std::string& bin_dtype,
                  const std::string& val_pattern, int64_t vocab, int64_t seq_len,
                  int64_t batch_size, int64_t micro_batches, int world_size, int rank,
                  uint64_t seed, int64_t eval_samples = 12, double val_fraction = 0);
  ~TokenFileSource() override;
  TokenFileSource(const TokenFileSource&) = delete;
  TokenFileSource& operator=(const TokenFileSource&) = delete;
  Batch next(int64_t step, int64_t micro) override;
  Batch validation(int rank, int world) override;
  int64_t items_per_sample() const override { return seq_len_; }
  std::string describe() const override { return description_; }
  std::optional<DataPosition> position(int64_t step) const override;
  void resume_at(int64_t step, DataPosition at) override;
  std::string fingerprint() const override { return fingerprint_; }
  int64_t num_samples() const { return sampler_.num_samples(); }

  struct File {
    std::string path;
    const unsigned char* tokens = nullptr;  // into the mapping
    void* map = nullptr;
    size_t map_bytes = 0;
    int64_t count = 0;  // tokens
    int item = 2;       // bytes per token
    bool is_signed = false;
    int64_t first_window = 0, windows = 0;
  };

 private:
  // Windows by their index over `files`' windows in order.
  Batch windows(const std::vector<File>& files, const std::vector<int64_t>& ids) const;
  std::string description_, fingerprint_;
  std::vector<File> train_, val_;
  int64_t vocab_, seq_len_, batch_size_, micro_batches_, eval_samples_;
  int64_t val_first_ = 0;    // the first validation window (in val_, or held out of train_)
  int64_t val_windows_ = 0;  // the validation split's windows
  DistributedSampler sampler_;
};

class SyntheticLMSource : public BatchSource {
 public:
  SyntheticLMSource(int64_t vocab, int64_t seq_len, int64_t batch_size, int rank, uint64_t seed,
                    int64_t eval_samples = 12);
  Batch next(int64_t step, int64_t micro) override;
  Batch validation(int rank, int world) override;
  int64_t items_per_sample() const override { return seq_len_; }
  std::string describe() const override { return "synthetic tokens"; }
  std::string fingerprint() const override;

 private:
  int64_t vocab_, seq_len_, batch_size_, eval_samples_;
  int rank_;
  uint64_t seed_;
};

class SyntheticClassificationSource : public BatchSource {
 public:
  SyntheticClassificationSource(int64_t in_features, int64_t classes, int64_t batch_size, int rank,
                                uint64_t seed, int64_t eval_samples = 12);
  Batch next(int64_t step, int64_t micro) override;
  Batch validation(int rank, int world) override;
  int64_t items_per_sample() const override { return 1; }
  std::string describe() const override { return "synthetic classification"; }
  std::string fingerprint() const override;

 private:
  int64_t in_features_, classes_, batch_size_, eval_samples_;
  int rank_;
  uint64_t seed_;
  at::Tensor teacher_;
};

}  // namespace dtrain::framework
