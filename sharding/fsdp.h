// FullyShardedDataParallel: PyTorch's FSDP for LibTorch modules. Each of N ranks holds 1/N
// of the parameters, gradients and optimizer state, and trains the same model.
//
// LibTorch modules have no forward hooks, so a unit is declared where the model is written:
// a block type becomes a *wrap point* by one change of declaration, and the model keeps
// calling forward(...):
//
//   class TransformerLMImpl : public torch::nn::Module {
//     std::vector<dtrain::sharding::Unit<BlockImpl>> blocks;   // was: std::vector<Block>
//     ...  x = blocks[i]->forward(x);                            // unchanged
//   };
//
//   auto comm = dtrain::comm::create_world();
//   dtrain::sharding::FullyShardedDataParallel<TransformerLM> model(
//       TransformerLM(options), comm,
//       FSDPOptions().mixed_precision(amp::MixedPrecisionPolicy::bf16())
//                    .auto_wrap(AutoWrapPolicy().module_types({"Block"})));
//   torch::optim::AdamW opt(model.parameters(), ...);   // the fp32 master shards
//   loss_fn(model(tokens), targets).backward();         // gradients reduce-scattered
//   model.clip_grad_norm_(1.0);                         // norm over all shards
//   opt.step();
//
// A wrap point that is not wrapped (no FSDP, or the policy did not choose it) is the plain
// module: one pointer test per forward. The auto-wrap policy (AutoWrapPolicy in
// fsdp_state.h) chooses among wrap points by class name and parameter count; whatever no
// chosen unit claims belongs to the root, which is FSDP2's layout: tied weights (a token
// embedding reused by the head), embeddings, the final norm.
//
// What differs from a plain module once wrapped:
//   - give the optimizer model.parameters(): fp32 master shards, one 1-D tensor per original
//     parameter (the part this rank owns; possibly empty), in the module's order and with its
//     names (model.named_parameters(): weight-decay groups keep working by name);
//   - the module's own parameters hold data only inside forward and backward (sharded
//     between, as 0-element tensors), in the policy's param_dtype;
//   - every rank must run the same forwards and backwards (the collectives are issued in
//     the order the units run).
// Mixed precision (amp::MixedPrecisionPolicy, FSDP's MixedPrecision): parameters gathered in
// param_dtype, gradients reduced in reduce_dtype and averaged by FSDP2's rule (fp32 and bf16
// summed then divided, fp16 with DDP's pre/post divide factors), buffers kept in buffer_dtype, the
// model's outputs cast to output_dtype (FSDP2 casts every fully_shard module's; dtrain only the
// wrapped model's, so blocks do not round-trip through fp32), unit inputs cast when
// cast_forward_inputs (the root's always, as FSDP1's cast_root_forward_inputs), gradient
// shards left in the reduce dtype with keep_low_precision_grads. No autocast is needed: the
// parameters themselves are low precision.
#pragma once

#include <c10/core/GradMode.h>
#include <c10/util/Type.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "sharding/fsdp_state.h"
#include "sharding/no_sync.h"
#include "sharding/outputs.h"

namespace dtrain::sharding {

// The non-template face of a wrap point (Unit<Impl>).
class UnitBase {
 public:
  virtual ~UnitBase() = default;
  // The wrapped class, demangled ("dtrain::framework::BlockImpl").
  virtual std::string unit_type() const = 0;
  // FullyShardedDataParallel attaches the wrap points its policy chose; others stay plain.
  void attach(FSDPState* state, int64_t unit) {
    state_ = state;
    unit_ = unit;
  }
  bool attached() const { return state_ != nullptr; }

 protected:
  FSDPState* state_ = nullptr;
  int64_t unit_ = -1;
};

namespace detail {

// A forward argument: tensors are cast (FSDPState::cast_input); a unit's are also marked for
// its post-backward (FSDPState::unit_input). `unit` < 0: the root.
template <typename T>
decltype(auto) cast_arg(FSDPState& s, int64_t unit, T&& x) {
  if constexpr (std::is_same_v<std::decay_t<T>, at::Tensor>) {
    return unit < 0 ? s.cast_input(x, true) : s.unit_input(unit, x);
  } else {
    return std::forward<T>(x);
  }
}

template <typename Out>
Out finish_forward(FSDPState& s, int64_t unit, bool root, Out out) {
  if (root) out = transform(std::move(out), [&](const at::Tensor& t) { return s.cast_output(t); });
  std::vector<at::Tensor> tensors;
  collect(out, tensors);
  if (s.hooking()) {
    // Runs when the gradient of an output arrives, i.e. before this unit's backward.
    FSDPState* state = &s;
    for (const auto& t : tensors) {
      if (t.defined() && t.requires_grad()) {
        t.register_hook(
            [state, unit](const at::TensorBase& /*grad*/) { state->pre_backward(unit); });
      }
    }
  }
  if (root) {
    s.root_post_forward(tensors);
  } else {
    s.unit_post_forward(unit, tensors);
  }
  return out;
}

// Builds the state for `module`: finds the wrap points, applies the policy, assigns every
// parameter to its innermost chosen unit (or the root), and attaches the chosen units.
std::unique_ptr<FSDPState> build_fsdp(torch::nn::Module& module,
                                      std::shared_ptr<comm::Communicator> comm,
                                      FSDPOptions options);
// Detaches every wrap point of `module` (they run as plain modules again).
void detach_units(torch::nn::Module& module);

}  // namespace detail

// A wrap point: Impl itself (same parameters, same names), whose forward runs FSDP's
// pre- and post-forward work when a FullyShardedDataParallel chose it as a unit.
template <typename Impl>
class UnitImpl : public Impl, public UnitBase {
 public:
  using Impl::Impl;

  template <typename... Args>
  auto forward(Args&&... args) {
    if (state_ == nullptr) return Impl::forward(std::forward<Args>(args)...);
    state_->unit_pre_forward(unit_);
    auto out = Impl::forward(detail::cast_arg(*state_, unit_, std::forward<Args>(args))...);
    return detail::finish_forward(*state_, unit_, false, std::move(out));
  }

  std::string unit_type() const override { return c10::demangle(typeid(Impl).name()); }
};

// The module holder of a wrap point, as TORCH_MODULE would define it.
template <typename Impl>
class Unit : public torch::nn::ModuleHolder<UnitImpl<Impl>> {
 public:
  using torch::nn::ModuleHolder<UnitImpl<Impl>>::ModuleHolder;
};

template <typename ModuleHolder>
class FullyShardedDataParallel {
 public:
  // Collective: every rank of `comm` constructs it with the same module structure.
  FullyShardedDataParallel(ModuleHolder module, std::shared_ptr<comm::Communicator> comm,
                           FSDPOptions options = {})
      : module_(std::move(module)),
        state_(detail::build_fsdp(*module_, std::move(comm), std::move(options))) {}
  ~FullyShardedDataParallel() {
    if (state_) detail::detach_units(*module_);
  }
  FullyShardedDataParallel(const FullyShardedDataParallel&) = delete;
  FullyShardedDataParallel& operator=(const FullyShardedDataParallel&) = delete;

  template <typename... Args>
  auto forward(Args&&... args) {
    state_->root_pre_forward();
    auto out = module_->forward(detail::cast_arg(*state_, -1, std::forward<Args>(args))...);
    return detail::finish_forward(*state_, state_->root_unit(), true, std::move(out));
  }
  template <typename... Args>
  auto operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  // The fp32 master shards, for the optimizer (see the header comment).
  std::vector<at::Tensor> parameters() const { return state_->parameters(); }
  std::vector<std::pair<std::string, at::Tensor>> named_parameters() const {
    return state_->named_parameters();
  }
  [[nodiscard]] NoSyncGuard no_sync() { return NoSyncGuard(*state_); }
  // torch.nn.utils.clip_grad_norm_ over the shards: the total norm of the full gradients.
  double clip_grad_norm_(double max_norm, double norm_type = 2.0);

  ModuleHolder& module() { return module_; }
  const ModuleHolder& module() const { return module_; }
  FSDPState& state() { return *state_; }
  const ReducerStats& last_stats() const { return state_->last_stats(); }

 private:
  ModuleHolder module_;
  std::unique_ptr<FSDPState> state_;
};

// Non-template body of FullyShardedDataParallel::clip_grad_norm_.
double clip_sharded_grad_norm_(FSDPState& state, double max_norm, double norm_type);

template <typename ModuleHolder>
double FullyShardedDataParallel<ModuleHolder>::clip_grad_norm_(double max_norm, double norm_type) {
  return clip_sharded_grad_norm_(*state_, max_norm, norm_type);
}

}  // namespace dtrain::sharding
