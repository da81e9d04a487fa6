// FSDPState: the non-template core of FullyShardedDataParallel (sharding/fsdp.h): the units,
// their groups, and the schedule that gathers, reshards and reduces them.
//
// Schedule (per iteration; every rank runs the same forward, so every rank issues the same
// collectives in the same order):
//   forward   root: gather (kept until the end of backward, as FSDP2's root). Each unit in
//             turn: gather (or wait for its prefetch), run, then reshard under FULL_SHARD
//             and HYBRID_SHARD; forward_prefetch starts the next unit's gather (in the
//             previous iteration's order). The order units ran in is recorded.
//   backward  a hook on each unit's outputs re-gathers it before its backward runs and, with
//             backward_prefetch, starts gathering the unit that runs next (BACKWARD_PRE).
//             Gradient-ready hooks (sharding/grad_hooks.h) count each unit down; at zero
//             its gradients are in the reduce buffer and its parameters are resharded.
//             Reductions launch strictly in reverse forward order, as soon as each is ready;
//             before one launches, the one before it is finished (its result written to the
//             gradient shard, its unsharded buffer released), as FSDP2 waits for the
//             previous reduce-scatter: the gradient buffers alive at once do not grow with
//             the number of units when communication is slower than backward.
//   end       an autograd callback queued by the first hook launches what never became
//             ready (unused parameters contribute zeros), waits for every reduction, writes
//             the gradient shards and reshards what is left.
// At most limit_all_gathers units (the root not counted) are gathered or gathering at once;
// a prefetch that would exceed it is skipped and the unit is gathered when it runs.
//
// Threads: hooks run on the thread that runs backward; a mutex orders them against the
// forward path.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "amp/policy.h"
#include "comm/communicator.h"
#include "sharding/deferred_init.h"
#include "sharding/fsdp_unit.h"
#include "sharding/grad_hooks.h"
#include "sharding/no_sync.h"
#include "sharding/reducer.h"
#include "sharding/sharding_strategy.h"

namespace dtrain::sharding {

// The strategy's name in the table (sharding_strategy.h); ConfigError for another name.
ShardingStrategy parse_sharding_strategy(const std::string& name);
const char* to_string(ShardingStrategy s);

// Which wrap points (modules declared as Unit<...>) become FSDP units. A wrap point is
// chosen when its class matches one of module_types (empty: any) and it holds at least
// min_params parameters. Wrap points not chosen run as plain modules; their parameters
// belong to the enclosing unit, or to the root.
struct AutoWrapPolicy {
  // Class names, with or without namespace and the LibTorch "Impl" suffix: "Block" matches
  // dtrain::framework::BlockImpl.
  TORCH_ARG(std::vector<std::string>, module_types) = {};
  TORCH_ARG(int64_t, min_params) = 0;
};

struct FSDPOptions {
  TORCH_ARG(ShardingStrategy, sharding_strategy) = ShardingStrategy::kFullShard;
  TORCH_ARG(amp::MixedPrecisionPolicy, mixed_precision) = {};
  TORCH_ARG(AutoWrapPolicy, auto_wrap) = {};
  TORCH_ARG(bool, forward_prefetch) = false;
  TORCH_ARG(bool, backward_prefetch) = true;
  TORCH_ARG(int64_t, limit_all_gathers) = 2;
  // Which ranks hold which elements (sharding/sharding_strategy.h): fully_shard's dim-0
  // chunks by default, or FSDP1's flat buffer.
  TORCH_ARG(ShardLayout, shard_layout) = ShardLayout::kPerParameter;
  // Reduce-scatters on a communicator of their own (see UnitGroups::reduce), as FSDP2 uses a
  // separate CUDA stream for them.
  TORCH_ARG(bool, separate_reduce_group) = true;
  // HYBRID_SHARD: ranks per shard group; 0 takes LOCAL_WORLD_SIZE (one node per group).
  TORCH_ARG(int64_t, hybrid_group_size) = 0;
  // Every rank starts from rank 0's parameters and buffers (as DDP does).
  TORCH_ARG(bool, sync_module_states) = true;
  // Deferred initialization (sharding/deferred_init.h): when set, every parameter of the
  // module is initialized by it, unit by unit, straight into the unit's buffer; the module's
  // parameters may then be placeholders, and no rank ever holds the whole model.
  TORCH_ARG(ParamInit, param_init) = nullptr;
  // When set and enabled: each unit's outputs ("fsdp.<unit>.out") and gradient shards.
  TORCH_ARG(MonitorPtr, monitor) = nullptr;
};

class FSDPState : public GradientSync {
 public:
  struct UnitSpec {
    std::string name;  // module path ("blocks.3"); "" for the root
    std::vector<std::pair<std::string, at::Tensor>> params;
  };

  // `units` in module order; the root's parameters (what no unit claims) come last and may be
  // empty. `param_order` lists every parameter name in the module's own order.
  FSDPState(std::vector<UnitSpec> units, UnitSpec root,
            std::vector<std::pair<std::string, at::Tensor>> buffers,
            std::vector<std::string> param_order, std::shared_ptr<comm::Communicator> world,
            FSDPOptions options);
  ~FSDPState() override;
  FSDPState(const FSDPState&) = delete;
  FSDPState& operator=(const FSDPState&) = delete;

  // --- called by the wrappers ---------------------------------------------------------------
  void root_pre_forward();
  void root_post_forward(const std::vector<at::Tensor>& outputs);
  void unit_pre_forward(int64_t unit);
  void unit_post_forward(int64_t unit, const std::vector<at::Tensor>& outputs);
  // Registered on forward outputs (root: unit -1); runs when their gradient arrives.
  void pre_backward(int64_t unit);
  // Inputs: floating tensors cast to param_dtype (the root always when it is low precision,
  // as FSDP's cast_root_forward_inputs; units when cast_forward_inputs).
  at::Tensor cast_input(const at::Tensor& t, bool root) const;
  // A unit's tensor input: cast_input, then passed through an identity autograd node whose
  // backward runs post_backward(unit) once the unit's input gradient is computed (FSDP2's
  // RegisterPostBackwardFunction): the moment its backward no longer reads the gathered
  // parameters, and the last moment a gradient of its parameters can arrive through its
  // outputs. A trainable parameter that has not reported then is unused in this backward:
  // the unit is reduced and resharded there, not at the end of backward, so frozen and
  // unused parameters hold back neither the unit nor the reductions after it.
  at::Tensor unit_input(int64_t unit, const at::Tensor& t);
  void post_backward(int64_t unit);
  // The model's outputs: floating tensors cast to output_dtype when set.
  at::Tensor cast_output(const at::Tensor& t) const;
  // Whether outputs get backward hooks (grad mode was on in this forward).
  bool hooking() const { return grad_forward_; }

  // --- for the user ---------------------------------------------------------------------------
  // The fp32 master shards of the trainable parameters, in the module's order: give these
  // to the optimizer. Each is the 1-D part of one parameter this rank owns (maybe empty).
  std::vector<at::Tensor> parameters() const;
  std::vector<std::pair<std::string, at::Tensor>> named_parameters() const;
  // Every parameter's full fp32 value, by name, in the module's order, on every rank
  // (collective: gathers unit by unit).
  std::vector<std::pair<std::string, at::Tensor>> full_parameters() const;
  // The same values one unit at a time, never the whole model: visit(k, name, full) for the
  // k-th parameter in the module's order, `full` valid during the call (collective).
  void visit_full_parameters(const std::function<void(size_t k, const std::string& name,
                                                      const at::Tensor& full)>& visit) const;

  // --- state dicts --------------------------------------------------------------------------
  // A per-parameter quantity held like the masters: one tensor per parameter in
  // all_parameters() order (frozen ones too), each this rank's 1-D part; undefined = zeros.
  // all_parameters: the masters themselves, by name, in the module's order.
  std::vector<std::pair<std::string, at::Tensor>> all_parameters() const;
  // Module-shaped full tensors of such a quantity (collective over the shard group, one unit
  // gathered at a time beyond what the result holds).
  std::vector<at::Tensor> gather_full(const std::vector<at::Tensor>& parts) const;
  // This rank's parts of module-shaped full tensors (every rank holds them).
  std::vector<at::Tensor> local_parts(const std::vector<at::Tensor>& full) const;
  // Sharded checkpoints: each unit's layout, this rank's flat [S] of a quantity per unit, and
  // the reverse from a reader of any range of a parameter's elements (resharding to another
  // world size or layout reads what the old ranks' files hold of this rank's new parts).
  struct UnitLayout {
    std::string name;
    ShardLayout layout = ShardLayout::kPerParameter;
    int64_t numel = 0, shard_size = 0, shard_group_size = 1, shard_rank = 0;
    struct Entry {
      std::string name;
      std::vector<int64_t> shape;
      ParamPlace place;
    };
    std::vector<Entry> params;
  };
  std::vector<UnitLayout> layouts() const;
  // `into[u]`, when given, is unit u's buffer to write in place (FlatUnit::flat_of).
  std::vector<at::Tensor> flat_shards(const std::vector<at::Tensor>& parts,
                                      const std::vector<at::Tensor>& into = {}) const;
  // Elements [begin, begin + count) of parameter `param` (in its unit's order) of unit `unit`.
  using PartReader =
      std::function<at::Tensor(int64_t unit, int64_t param, int64_t begin, int64_t count)>;
  std::vector<at::Tensor> parts_from(const PartReader& read) const;
  // Replaces the masters' values (every rank's part; optimizers keep their state).
  void set_parameters(const std::vector<at::Tensor>& parts);
  bool require_sync() const override { return require_sync_; }
  void set_require_sync(bool on) override { require_sync_ = on; }
  // The optimizer in backward (PyTorch's _apply_optimizer_in_backward): in a backward that
  // reduces (not under no_sync), `step` gets each unit's trainable masters as soon as their
  // gradients are final (its reduce-scatter done, and under HYBRID_SHARD the replicas'
  // all-reduce, waited for once the next unit's reduce-scatter is done, so that one replica
  // all-reduce runs behind the backward), in backward order; then the unit's
  // gradients are unset and their shard released. A rank then never holds more than a unit or
  // two of gradient shards, where a step after backward holds them all: 4 bytes per
  // parameter and rank of FULL_SHARD's 16. Nothing may need the whole gradient after backward
  // (clipping, a GradScaler's verdict); `step` runs inside backward, on autograd's thread, and
  // must not call into this FSDP (a forward, this setter): it holds the state's lock. `step`
  // must step every parameter it gets (one optimizer over all the masters): the gradients are
  // dropped after it either way. Every reducing backward steps once, so accumulate over
  // micro-batches under no_sync. A `step` that throws ends the backward (on every rank alike,
  // or the ranks' collectives part ways); the next forward drops the gradients the units not
  // stepped had received, so none is added to the next step's.
  using StepInBackward = std::function<void(const std::vector<at::Tensor>& params)>;
  void set_step_in_backward(StepInBackward step);
  // The group whose shards together make the gradients (for norms): null when every rank
  // holds them all.
  comm::Communicator* shard_group() const { return groups_.shard.get(); }
  const comm::Communicator& world() const { return *groups_.world; }
  const FSDPOptions& options() const { return options_; }
  // Waits for the last iteration's collectives to report their times.
  const ReducerStats& last_stats() const;
  const std::vector<std::unique_ptr<FlatUnit>>& units() const { return units_; }
  int64_t root_unit() const { return root_; }
  // Most units (the root not counted) gathered or gathering at once, since construction.
  int64_t peak_gathered_units() const { return peak_gathered_; }
  // Gradient reductions (reduce-scatters, or all-reduces without sharding) issued since
  // construction.
  int64_t reductions_launched() const { return reductions_launched_; }
  // Bytes of freed gathered and gradient buffers kept for the next step (BufferPool): allocated,
  // and counted as tracked memory, between steps.
  int64_t pooled_bytes() const;

 private:
  void ensure_backward_started();
  // Reshards `unit` in backward once nothing more of its backward reads the gathered
  // parameters: every trainable gradient arrived and, when it holds frozen parameters, the
  // gradients of its inputs too (frozen parameters have no gradient to say so).
  void maybe_reshard_in_backward(int64_t unit);
  void launch_reduce(FlatUnit& u);  // counts it
  void reset_input_counts();
  void on_grad_ready(int64_t unit, int64_t param);
  void launch_ready();
  void finish_previous_reduce();  // every launched reduction, before the next launches
  // set_step_in_backward: finishes `unit`'s reduction, steps its masters and drops their
  // gradients, once per backward.
  void step_unit(int64_t unit);
  void record_grads(const FlatUnit& u) const;  // the numerics monitor's gradient shards
  void finalize_backward();
  void abandon_backward();
  void prefetch(int64_t unit);
  void gather(int64_t unit);  // unshard and wait (the unit runs next)
  void note_gathered();
  int64_t gathered_units() const;
  bool reshards_after_forward(int64_t unit) const;
  bool reshards_after_backward(int64_t unit) const;

  FSDPOptions options_;
  UnitGroups groups_;
  std::unique_ptr<BufferPool> pool_;              // before units_: it outlives them
  std::vector<std::unique_ptr<FlatUnit>> units_;  // wrapped units, then the root (if any)
  int64_t root_ = -1;
  std::vector<std::unique_ptr<GradReadyHooks>> hooks_;
  std::vector<std::pair<int64_t, int64_t>> order_;  // (unit, param) in the module's order

  std::mutex mu_;
  StepInBackward step_in_backward_;
  std::vector<char> stepped_;  // per unit, in this backward (set_step_in_backward)
  bool require_sync_ = true;
  bool grad_forward_ = false;  // the forward running now records autograd
  // Training state between a forward with grad and the end of its backward. A forward
  // without grad (evaluation, a frozen teacher) in between leaves all of it alone; a second
  // forward with grad before the backward joins the same backward.
  bool pending_backward_ = false;
  bool in_backward_ = false;
  // Units as they first ran in this iteration's forwards with grad: a unit called again
  // (weight sharing, a block applied in a loop) is listed once, and reduced once, after its
  // last gradient.
  std::vector<int64_t> forward_order_, previous_order_;
  std::vector<bool> in_forward_order_;
  // Ran in a forward with grad since the last synchronizing backward: a unit that holds
  // gradients accumulated under no_sync is reduced by the synchronizing backward even when
  // that backward's forward did not run it.
  std::vector<bool> ran_since_sync_;
  // Per unit, this iteration: inputs passed through the post-backward node, and how many of
  // them are still waiting for their gradient.
  std::vector<int64_t> inputs_marked_, inputs_pending_;
  // Per unit, this backward: its inputs' gradients are all computed, so it is complete; a
  // parameter gradient after that reached the loss around the unit's outputs (refused).
  std::vector<bool> inputs_done_;
  std::vector<int64_t> backward_order_;  // reduction order, root last
  std::vector<bool> ready_;
  size_t next_launch_ = 0, next_finish_ = 0, next_step_ = 0;  // into backward_order_
  double exposed_s_ = 0;
  int64_t peak_gathered_ = 0;
  int64_t reductions_launched_ = 0;
  // Step timeline (core/trace.h), while it records: when each unit's forward and backward
  // began (-1: not this step), when the backward began, and the end of the last unit's.
  std::vector<int64_t> trace_forward_start_, trace_backward_start_;
  int64_t trace_backward_begin_ = 0, trace_last_backward_end_ = 0;
  void trace_forward_end(int64_t unit);
  mutable ReducerStats stats_;
  mutable std::vector<comm::Work> stats_works_;
};

}  // namespace dtrain::sharding
