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
// micro) alone, so a resumed run continues exactly where the checkpoint left it with nothing
// but the step: the corpus source's position in its sampler is (step x micro_batches +
// micro) x batch_size, and the synthetic sources draw from a generator seeded by (seed,
// rank, step, micro). For the TransformerLM, synthetic sequences follow a per-sequence
// arithmetic progression mod vocab (learnable, so the loss falls); for the MLP, labels come
// from a fixed random teacher.
//
// Validation: a fixed set of `eval_samples` samples, the same at any world size (the corpus'
// last windows, never trained on; synthetic ones from a seed of their own); rank r takes
// samples r, r + world, ..., so the mean loss over all ranks' shares is the same set's at
// any world size.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace dtrain::framework {

class DistributedSampler {
 public:
  DistributedSampler(int64_t num_samples, int world_size, int rank, uint64_t seed,
                     bool shuffle = true);
  void set_epoch(int64_t epoch);
  int64_t epoch() const { return epoch_; }
  // This rank's sample indices for the current epoch.
  const std::vector<int64_t>& indices() const { return indices_; }
  int64_t num_samples() const { return num_samples_; }

 private:
  int64_t num_samples_;
  int world_size_;
  int rank_;
  uint64_t seed_;
  bool shuffle_;
  int64_t epoch_ = -1;
  std::vector<int64_t> indices_;
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
};

class ByteCorpusSource : public BatchSource {
 public:
  ByteCorpusSource(const std::string& path, int64_t seq_len, int64_t batch_size,
                   int64_t micro_batches, int world_size, int rank, uint64_t seed,
                   int64_t eval_samples = 12);
  Batch next(int64_t step, int64_t micro) override;
  Batch validation(int rank, int world) override;
  int64_t items_per_sample() const override { return seq_len_; }
  std::string describe() const override { return description_; }
  int64_t num_samples() const { return sampler_.num_samples(); }

 private:
  Batch windows(const std::vector<int64_t>& starts) const;

  std::string description_;
  at::Tensor tokens_;  // int64 bytes
  int64_t seq_len_, batch_size_, micro_batches_, eval_samples_;
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

 private:
  int64_t in_features_, classes_, batch_size_, eval_samples_;
  int rank_;
  uint64_t seed_;
  at::Tensor teacher_;
};

}  // namespace dtrain::framework
