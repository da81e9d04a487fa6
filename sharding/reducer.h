// Reducer: the gradient machinery of DistributedDataParallel (sharding/ddp.h), after
// PyTorch's c10d Reducer.
//
// Parameters are grouped into buckets in reverse registration order (the order gradients
// usually become ready in backward): the first bucket closes at first_bucket_mb (1 MB), the
// others at bucket_cap_mb (25 MB), and a bucket never mixes dtypes or devices. Unlike
// PyTorch, the last bucket is also kept near first_bucket_mb: its all-reduce cannot overlap
// any compute, so a small one shortens the wait at the end of backward. Each bucket
// owns one flat buffer; with gradient_as_bucket_view every parameter's .grad is a view into
// it, so gradients are accumulated, reduced and stepped without a copy.
//
// A post-hook on each parameter's gradient accumulator marks it ready. When a bucket's last
// gradient arrives the bucket is launched at once, asynchronously, in bucket order (ranks
// must issue collectives in the same order) — so communication overlaps the rest of
// backward. An end-of-backward callback waits for the buckets and writes averaged gradients
// back before backward() returns.
//
// Averaging (divide_factors in sharding/flat.h, shared with FSDP): fp32/fp64 buckets are
// divided by the world size before the all-reduce, as PyTorch's DDP does. Buckets reduced in
// a 16-bit reduce_dtype use FSDP's split instead: divide by f before (f starts at 1 and
// doubles while world % f == 0 and world / f > f) and by world / f after, so fp16 sums
// neither overflow nor underflow. The division happens in
// the gradient's own dtype before the cast to reduce_dtype. At a power-of-two world size this
// gives bit for bit what PyTorch's fp16_compress_hook / bf16_compress_hook give (cast, divide
// by the world size in the 16-bit dtype, sum), because dividing by a power of two is exact.
// At any other world size (3, 5, 6, ...) a bucket cast to a 16-bit reduce_dtype follows the
// hooks' order itself: cast, divide by the world size in the 16-bit dtype, sum. So DDP is
// bitwise with PyTorch's DDP at every world size over Gloo, whose all-reduce both call.
// inf/NaN survive the reduction, so every rank's GradScaler reaches the same verdict.
//
// Ownership and threads: the Reducer owns the bucket buffers; parameters are owned by the
// module. Hooks run on the thread that runs backward (CPU) and mark_ready takes a mutex; the
// collectives run on the communicator's own thread.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "sharding/flat.h"
#include "sharding/grad_hooks.h"
#include "sharding/no_sync.h"

namespace dtrain::amp {
class GradScaler;
class NumericsMonitor;
}  // namespace dtrain::amp

namespace dtrain::sharding {

// Named pointer types: TORCH_ARG pastes its type after `const`.
using MonitorPtr = amp::NumericsMonitor*;
using GradScalerPtr = amp::GradScaler*;

struct DDPOptions {
  // PyTorch's bucket_cap_mb, in MB. Unset: 25, with a first bucket of 1. Set: every bucket's
  // limit, the first's too (as PyTorch with bucket_cap_mb passed), unless first_bucket_mb is.
  // (Plain fields, not std::optional: GCC's maybe-uninitialized misfires on copies of those.)
  DDPOptions& bucket_cap_mb(double mb) {
    bucket_cap_mb_ = mb;
    bucket_cap_set_ = true;
    return *this;
  }
  double bucket_cap_mb() const { return bucket_cap_mb_; }
  DDPOptions& first_bucket_mb(double mb) {
    first_bucket_mb_ = mb;
    first_bucket_set_ = true;
    return *this;
  }
  double first_bucket_mb() const {
    return first_bucket_set_ ? first_bucket_mb_ : bucket_cap_set_ ? bucket_cap_mb_ : 1.0;
  }

 private:
  double bucket_cap_mb_ = 25.0, first_bucket_mb_ = 1.0;
  bool bucket_cap_set_ = false, first_bucket_set_ = false;

 public:
  TORCH_ARG(bool, broadcast_buffers) = true;
  TORCH_ARG(bool, find_unused_parameters) = false;
  TORCH_ARG(bool, gradient_as_bucket_view) = true;
  // Rebuild buckets once, after the first iteration, in the order gradients arrived there
  // (rank 0's order, broadcast). Not with find_unused_parameters, as in PyTorch.
  TORCH_ARG(bool, rebuild_buckets) = true;
  // Rebuilt buckets keep the last one (the gradients that arrive last, whose all-reduce
  // nothing overlaps) first_bucket_mb small instead of the first: PyTorch's opt-in
  // DDP_SET_LAST_BUCKET_CAP=1. Off by default, as there, so the buckets (and with them the
  // order of every sum) are PyTorch's.
  TORCH_ARG(bool, small_last_bucket) = false;
  // Dtype gradients travel in; unset: the gradient's own dtype.
  TORCH_ARG(std::optional<c10::ScalarType>, reduce_dtype) = std::nullopt;
  // When set and enabled, records each bucket's reduced gradients ("ddp.bucket<i>.grad").
  TORCH_ARG(MonitorPtr, monitor) = nullptr;
  // Whether any reduced gradient is inf/NaN, found while the end of backward writes each
  // bucket back (a 16-bit bucket is checked chunk by chunk as it is widened, in cache, so the
  // check costs almost nothing; an fp32 bucket takes a pass of its own): found_inf(), for
  // GradScaler::step(optimizer, found_inf), which then skips its pass over the gradients.
  TORCH_ARG(bool, check_finite) = false;
  // The GradScaler that scales this model's loss (fp16): the end of backward then also
  // unscales the gradients while it writes each reduced bucket back, and judges them, in
  // the same pass, so scaler.step(optimizer) or scaler.unscale_(optimizer) makes no pass of
  // its own and the fused AdamW/SGD gets no scale. Bitwise what the scaler alone gives
  // (amp/grad_scaler.h: when the scale is a power of two on the CPU; otherwise the
  // gradients stay scaled and the scaler does it). Two backwards before one step work: each
  // forward first scales back what the last backward unscaled and no step took. Not owned.
  TORCH_ARG(GradScalerPtr, grad_scaler) = nullptr;
};

// Per-iteration timing of the gradient reduction (the last completed backward).
struct ReducerStats {
  int64_t buckets = 0;
  double comm_seconds = 0;  // sum of the collectives' execution times (device time on NCCL)
  // Time backward waited for them at its end, on the host. NCCL's wait does not block the
  // host (the stream waits), so there this is ~0 and the hidden share an upper bound.
  double exposed_seconds = 0;
  // Time the end of backward spent writing reduced buckets back into the gradients (with
  // check_finite or a grad_scaler: and checking and unscaling them), on the host.
  double write_back_seconds = 0;
  // Of which inf/NaN checks that run as loops of their own (CPU buckets check and unscale
  // inside the widening loop instead, sharding/widen.h: 0 there).
  double finite_check_seconds = 0;
  // Share of communication hidden behind backward compute, in [0, 1].
  double hidden_fraction() const {
    return comm_seconds > 0 ? std::max(0.0, 1.0 - exposed_seconds / comm_seconds) : 1.0;
  }
};

class Reducer : public GradientSync {
 public:
  using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

  // Checks that every rank holds the same parameters (throws UsageError naming the first
  // mismatch), broadcasts parameters and buffers from rank 0, builds buckets and hooks.
  Reducer(NamedTensors params, NamedTensors buffers, std::shared_ptr<comm::Communicator> comm,
          DDPOptions options);
  ~Reducer() override;
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // Before the module's forward: reports a previous iteration that left gradients
  // unreduced, broadcasts buffers if the previous forward synchronized (or this is the
  // first), and, in a forward with gradients enabled (under no_sync too, as PyTorch), rebuilds
  // buckets once if due. `will_sync`: this forward's backward synchronizes gradients.
  void prepare_for_forward(bool will_sync);
  // After the module's forward, when gradients are to be synchronized: arms the hooks and,
  // with find_unused_parameters, finds the parameters `outputs` do not depend on.
  void prepare_for_backward(const std::vector<at::Tensor>& outputs);

  bool require_sync() const override { return require_sync_; }
  void set_require_sync(bool on) override { require_sync_ = on; }

  // Reads the collectives' execution times, so it waits for the last backward's collectives
  // to finish (NCCL: on the device); call it when reporting, not in the step.
  const ReducerStats& last_stats() const;
  // With check_finite: a 1-element fp32 tensor on the CPU, 1 when a gradient reduced by the
  // last synchronizing backward is inf/NaN, else 0; undefined before one, or without it.
  const at::Tensor& found_inf() const { return found_inf_; }
  // DDPOptions::grad_scaler, set after construction (the trainer builds the model first).
  void set_grad_scaler(amp::GradScaler* scaler) { options_.grad_scaler(scaler); }
  // Parameter indices of each bucket, in launch order.
  std::vector<std::vector<int64_t>> bucket_indices() const;
  // The order the buckets were rebuilt from (rank 0's arrival order), empty before the
  // rebuild: a checkpoint keeps it, and restore_rebuilt_order() builds those buckets at once,
  // so that a resumed run adds in the uninterrupted run's order from its first step (its
  // first backward would otherwise run on the initial layout). An order that does not fit
  // this model, or a reducer that does not rebuild, leaves the buckets as they are.
  const std::vector<int64_t>& rebuilt_order() const { return rebuilt_order_; }
  void restore_rebuilt_order(const std::vector<int64_t>& order);
  const comm::Communicator& communicator() const { return *comm_; }

 private:
  struct Bucket {
    std::vector<int64_t> params;  // indices into params_
    std::vector<int64_t> offsets;
    at::Tensor contents;            // flat, the parameters' dtype and device
    at::Tensor comm_buffer;         // contents, or a reduce_dtype copy
    std::vector<at::Tensor> views;  // per parameter, shaped like it
    DivideFactors divide;           // before (into contents) and after the reduction
    double cast_divide = 1;         // in comm_buffer's dtype, after the cast (see Averaging)
    int64_t pending = 0;
    bool launched = false;
    bool finished = false;
    comm::Work work;
  };
  struct Location {
    int64_t bucket = -1;
    int64_t slot = -1;
  };

  void verify_same_parameters();
  void sync_module_states();
  void broadcast_flat(const std::vector<at::Tensor>& tensors);
  // Parameter indices per bucket, as PyTorch's compute_bucket_assignment_by_size groups them.
  std::vector<std::vector<int64_t>> assign_buckets(const std::vector<int64_t>& order,
                                                   const std::vector<double>& limits,
                                                   bool sort_by_first_index) const;
  // Before the first iteration (`order`: registration order) or rebuilt in arrival order.
  void build_buckets(const std::vector<int64_t>& order, bool rebuilt);
  void autograd_hook(int64_t index);
  void mark_ready(int64_t index, bool from_hook);
  void launch_ready_buckets();
  void finalize_backward();
  // Writes a bucket's reduced comm_buffer back into its contents, divided by the post factor
  // and multiplied by `multiply` (the scaler's unscale; 1: none). With check_finite or
  // found_per_slot, returns whether any element is inf/NaN, and fills found_per_slot (one
  // verdict per parameter of the bucket) when given.
  bool write_back(Bucket& b, float multiply, std::vector<bool>* found_per_slot,
                  double* check_seconds);
  void reset_iteration();
  // Waits for collectives launched by a backward that threw before its end-of-backward
  // callback, so their results never land in buffers a new iteration is using.
  void drain_in_flight() noexcept;
  std::vector<int64_t> find_unused(const std::vector<at::Tensor>& outputs) const;
  void rebuild_buckets();

  NamedTensors params_;
  NamedTensors buffers_;
  std::shared_ptr<comm::Communicator> comm_;
  DDPOptions options_;

  std::vector<Bucket> buckets_;
  std::vector<Location> where_;
  std::unique_ptr<GradReadyHooks> hooks_;

  std::mutex mu_;
  bool require_sync_ = true;
  // Whether the next forward broadcasts buffers: the last forward synchronized gradients.
  bool buffers_due_ = true;
  bool expect_hooks_ = false;  // between a syncing forward and the end of its backward
  bool callback_queued_ = false;
  bool marked_unused_ = false;
  int64_t next_bucket_ = 0;
  std::vector<bool> ready_;             // marked this iteration
  std::vector<int64_t> unused_;         // found by prepare_for_backward
  at::Tensor local_used_;               // int32 per parameter: a hook fired since the last sync
  bool unfinished_ = false;             // the last backward left buckets unreduced
  std::vector<int64_t> ready_order_;    // first syncing iteration, for the rebuild
  std::vector<int64_t> rebuilt_order_;  // what the rebuilt buckets were built from
  bool rebuild_due_ = false;
  bool rebuilt_ = false;
  at::Tensor found_inf_;
  // The verdicts on unscaled gradients this reducer handed its grad_scaler since the last
  // forward, withdrawn at the next one if no optimizer took them.
  std::vector<uint64_t> unscaled_tickets_;  // amp::GradScaler::Ticket
  mutable ReducerStats stats_;
  mutable std::vector<comm::Work> stats_works_;  // the last backward's, summed on demand
};

}  // namespace dtrain::sharding
