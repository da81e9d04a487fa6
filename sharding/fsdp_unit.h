// FlatUnit: one FSDP unit's parameters, sharded over a group of ranks.
//
// Layout (ShardLayout, sharding/sharding_strategy.h): per_parameter by default, FSDP2's
// dim-0 chunks, so each gradient element is owned, and so summed by the reduce-scatter, as
// fully_shard's is; or flat, FSDP1's FlatParameter, where the gathered buffer is the
// parameters themselves. Either way rank r's shard is one buffer of S elements, and the
// collectives run on rank-major buffers of N*S elements (rank r's shard at r*S).
//
// Buffers and who owns them (all on the parameters' device):
//   shard_        fp32 [S]     the master shard. The optimizer steps `masters`: per
//                              parameter, the 1-D part of it this rank owns (maybe empty),
//                              leaf tensors over shard_'s storage.
//   grad_shard_   fp32 [S]     the masters' .grad (reduce dtype with keep_low_precision_grads)
//   (a cast)      param [S]    the all-gather input when param_dtype is not fp32, alive
//                              only while the gather runs
//   gathered_     param [N*S]  per_parameter: the all-gather output, alive until its chunks
//                              are copied out into full_
//   full_         param        the gathered parameters, flattened and concatenated (flat:
//                              the all-gather output itself, [N*S]). Its Storage object lives
//                              as long as the unit; resharding frees its memory and
//                              unsharding refills it, so tensors autograd saved from the
//                              parameters in forward (weight.t() views) read the re-gathered
//                              data in backward.
//   reduce_full_  reduce [N*S] gradients, pre-divided, rank-major, for the reduce-scatter
//   reduce_shard_ reduce [S]   its result
// The module's own parameter tensors keep their identity (names, autograd accumulators) and
// always have param_dtype: they view full_ while unsharded and hold 0-element tensors while
// sharded (a use outside forward/backward fails on the shape instead of reading freed
// memory). Their dtype and device never change after construction, so their gradient
// accumulators, and the hooks on them, survive.
//
// Group sizes: the shard group (N ranks) all-gathers and reduce-scatters; the replicate
// group (HYBRID_SHARD, NO_SHARD) all-reduces the reduced shard. N = 1 (NO_SHARD) skips the
// gather: full_ is shard_ itself in fp32, or its cast (both layouts are the same there).
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "amp/policy.h"
#include "comm/communicator.h"
#include "sharding/deferred_init.h"
#include "sharding/flat.h"
#include "sharding/grad_hooks.h"

namespace dtrain::sharding {

struct UnitGroups {
  std::shared_ptr<comm::Communicator> world;      // construction-time broadcast
  std::shared_ptr<comm::Communicator> shard;      // null: this rank holds the whole unit
  std::shared_ptr<comm::Communicator> replicate;  // null: no replicas of a shard
  // The shard group's ranks again, for reduce-scatters: a second queue (Gloo: worker; NCCL:
  // stream), so a gather the next unit's compute waits for never queues behind a reduction.
  // Null: reduce over `shard`.
  std::shared_ptr<comm::Communicator> reduce;
};

class FlatUnit {
 public:
  struct Param {
    std::string name;         // as in the unwrapped module (state-dict key)
    at::Tensor module_param;  // the module's own tensor, re-pointed (param_dtype)
    std::vector<int64_t> shape;
    int64_t offset = 0;  // first element in the unit's parameters flattened and concatenated
    int64_t numel = 0;
    int64_t chunk = 0;     // per_parameter: elements per rank, padding included
    int64_t shard_at = 0;  // per_parameter: where its chunk starts in every rank's shard
    bool trainable = true;
    at::Tensor master;         // this rank's part: 1-D fp32 slot of shard_, possibly empty
    int64_t master_begin = 0;  // index of master[0] within the flattened parameter
    int64_t master_at = 0;     // index of master[0] within shard_
    ParamPlace place() const { return {offset, numel, chunk, shard_at}; }
  };
  enum class State { kSharded, kGathering, kUnsharded };

  // Takes the module's parameters (all on one device), makes every rank hold rank 0's values
  // (broadcast over groups.world when sync_module_states), keeps this rank's shard and
  // leaves the module's tensors sharded.
  // `pool` (may be null; must outlive the unit) recycles the gathered and gradient buffers.
  // `init` (may be null): the values are not read from the module's tensors (which may be
  // placeholders) but written by init, straight into the unit's fp32 buffer
  // (sharding/deferred_init.h).
  FlatUnit(std::string name, std::vector<std::pair<std::string, at::Tensor>> params,
           UnitGroups groups, const amp::MixedPrecisionPolicy& policy, bool sync_module_states,
           BufferPool* pool = nullptr, ShardLayout layout = ShardLayout::kPerParameter,
           const ParamInit* init = nullptr);
  FlatUnit(const FlatUnit&) = delete;
  FlatUnit& operator=(const FlatUnit&) = delete;

  const std::string& name() const { return name_; }
  std::vector<Param>& params() { return params_; }
  const std::vector<Param>& params() const { return params_; }
  int64_t numel() const { return total_; }
  int64_t shard_numel() const { return shard_size_; }
  int64_t shard_group_size() const { return n_; }
  int64_t shard_rank() const { return rank_; }
  // The layout in use (flat when N = 1, where both are the same).
  ShardLayout layout() const { return layout_; }
  bool has_frozen_params() const { return frozen_; }
  // Parameters that take gradients (0: an all-frozen unit, which is never reduced).
  int64_t trainable_count() const { return trainable_; }
  // Every trainable parameter has reported its gradient this backward.
  bool grads_done() const { return pending_ == 0; }
  State state() const { return state_; }
  const UnitGroups& groups() const { return groups_; }

  // --- parameters -------------------------------------------------------------------------
  // Starts gathering (no-op when unsharded or in flight). Every rank of the shard group must
  // call it in the same order.
  void unshard();
  // Finishes the gather and points the module's tensors at full_. Adds host time spent
  // waiting to *waited_s.
  void wait_unsharded(double* waited_s);
  // Frees full_'s memory; the module's tensors become 0-element. No-op for N = 1, which
  // keeps its memory and refreshes it from the masters at the next unshard().
  void reshard();

  // --- gradients (between a syncing forward and the end of its backward) -----------------
  // Hooks the module tensors' gradient accumulators (on_ready(i) for params()[i]). Autograd
  // records a tensor's shape in its accumulator when creating it and checks every gradient
  // against it; the tensors get their full shapes (no data) while the accumulators are made.
  std::unique_ptr<GradReadyHooks> hook_gradients(GradReadyHooks::Callback on_ready);
  // The module tensor of params()[i] has its gradient: copies it (pre-divided, in the reduce
  // dtype) into the reduce buffer and releases it. Returns true when every trainable
  // parameter has reported this backward.
  bool grad_ready(int64_t i);
  // The same count without copying (no_sync: gradients stay on the module's tensors).
  bool count_ready(int64_t i);
  bool reduce_launched() const { return reduce_launched_; }
  // Takes what did not report from the module tensors' .grad (gradients accumulated under
  // no_sync by earlier backwards) or zero-fills it, then issues the reduce-scatter (N > 1)
  // or the all-reduce (N = 1 with replicas). Every rank of the groups must call it in the
  // same order.
  void launch_reduce();
  // Waits for the reduce-scatter; under HYBRID_SHARD then issues the replicas' all-reduce of
  // the shard without waiting for it, and returns true (finish_reduce is then still due;
  // false: it may run at once).
  bool finish_scatter(double* waited_s);
  // Finishes the reduction (finish_scatter, and the replicas' all-reduce), post-divides and
  // writes the masters' gradients: assigned fresh when they were unset, else accumulated.
  void finish_reduce(double* waited_s);
  // A backward starts: when the optimizer dropped the masters' gradients (zero_grad with
  // set_to_none), the gradient shard is released too, not held until it is rewritten.
  void begin_backward();
  // Forgets this backward's counts (the next backward starts over).
  void reset_backward();
  // Unsets the masters' gradients and releases the shard behind them (an optimizer stepped
  // them in backward).
  void drop_grads();

  // State dicts handle per-parameter quantities held like the masters (the masters
  // themselves, an optimizer's state): one 1-D tensor per param, this rank's part.
  // flat_of: those parts as this rank's flat [S] (padding and undefined parts are zeros).
  // `into`, when it is a [S] tensor of the shard's dtype on the shard's device that an earlier
  // flat_of returned (a checkpoint's staging buffer), is written in place: only the parts'
  // elements, the rest being zeros already.
  at::Tensor flat_of(const std::vector<at::Tensor>& parts, at::Tensor into = {}) const;
  // gather: every rank's flat [S] of a quantity, as the unit's parameters flattened and
  // concatenated (collective over the shard group; numel() elements).
  at::Tensor gather(const at::Tensor& flat) const;
  // This rank's fp32 master shard [S] (padding included).
  const at::Tensor& master_shard() const { return shard_; }

  // Collectives issued since the last take_works() (for the comm statistics).
  std::vector<comm::Work> take_works();

 private:
  void point_module_params_at_full();
  // A parameter's elements as pairs of same-shaped views: of `param` (its values flattened)
  // and of `ranked`, a rank-major [N*S] buffer; at most two blocks.
  std::vector<std::pair<at::Tensor, at::Tensor>> blocks(const Param& p, const at::Tensor& param,
                                                        const at::Tensor& ranked) const;
  // The views of a rank-major buffer that no parameter element occupies (zero in every
  // reduce-scatter input).
  std::vector<at::Tensor> padding(const at::Tensor& ranked) const;
  // The parameters flattened and concatenated (numel() elements) from a rank-major buffer.
  void copy_out(const at::Tensor& ranked, const at::Tensor& out) const;
  at::Tensor buffer(int64_t numel, const at::TensorOptions& options) const;
  // Moves params()[i]'s module .grad, pre-divided, into reduce_full_ (false: it has none).
  bool take_module_grad(int64_t i);
  void alloc_reduce_full();

  std::string name_;
  BufferPool* pool_ = nullptr;
  std::vector<Param> params_;
  UnitGroups groups_;
  amp::MixedPrecisionPolicy policy_;
  c10::ScalarType param_dtype_;
  c10::ScalarType reduce_dtype_;
  int64_t n_ = 1;     // shard group size
  int64_t rank_ = 0;  // in the shard group
  int64_t world_ = 1;
  int64_t replicas_ = 1;
  // Averaging: sum, then divide by n_ and by replicas_ (fp32, bf16); or divide by pre_
  // before and post_ after the sum (fp16, as DDP).
  bool average_after_ = false;
  double pre_ = 1, post_ = 1;
  ShardLayout layout_ = ShardLayout::kPerParameter;
  int64_t total_ = 0, padded_ = 0, shard_size_ = 0;
  bool frozen_ = false;
  int64_t trainable_ = 0;

  at::Tensor shard_, grad_shard_, full_, gathered_, empty_;
  at::Tensor reduce_full_, reduce_shard_;
  State state_ = State::kSharded;
  bool stale_ = true;  // N = 1: full_ must be refreshed from the masters
  comm::Work gather_;
  comm::Work reduce_;
  comm::Work replica_;            // HYBRID_SHARD: the replicas' all-reduce
  bool replica_pending_ = false;  // ... issued and not yet waited for
  bool scattered_ = false;        // this reduction's reduce-scatter is done
  std::vector<bool> reported_;    // this backward: the gradient hook fired
  std::vector<bool> filled_;      // ... and its gradient is in reduce_full_
  int64_t pending_ = 0;
  bool reduce_launched_ = false;
  std::vector<comm::Work> works_;
};

}  // namespace dtrain::sharding
