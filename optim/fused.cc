#include "optim/fused.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include "amp/policy.h"
#include "core/error.h"

namespace dtrain::optim {
namespace {

using torch::optim::OptimizerParamGroup;

// PyTorch's _group_tensors_by_device_and_dtype: one kernel call per (device, dtype), in the
// order of first appearance.
using GroupKey = std::pair<std::string, c10::ScalarType>;

GroupKey key_of(const at::Tensor& p) { return {p.device().str(), p.scalar_type()}; }

void check_fusable(const at::Tensor& p, const at::Tensor& g, const char* who) {
  DTRAIN_CHECK_AS(UsageError, !g.is_sparse(), who, ": sparse gradients are not supported");
  DTRAIN_CHECK_AS(UsageError, at::isFloatingType(p.scalar_type()), who,
                  ": the fused kernel needs floating-point parameters, got ",
                  c10::toString(p.scalar_type()));
  DTRAIN_CHECK_AS(UsageError, g.device() == p.device() && g.scalar_type() == p.scalar_type(), who,
                  ": a gradient's device and dtype must be its parameter's (", p.device().str(),
                  " ", c10::toString(p.scalar_type()), "), got ", g.device().str(), " ",
                  c10::toString(g.scalar_type()));
}

std::optional<at::Tensor> on(const at::Tensor& t, const c10::Device& d) {
  if (!t.defined()) return std::nullopt;
  return amp::moved_for_use(t, d);
}

// The skip flag the kernels read, on `d`: 1 when the step is skipped, 0 otherwise. The kernels
// skip on exactly 1, and a flag summed over devices may exceed it. No host read.
std::optional<at::Tensor> skip_flag(const at::Tensor& found_inf, const c10::Device& d) {
  if (!found_inf.defined()) return std::nullopt;
  return amp::moved_for_use(found_inf, d).ne(0).to(at::kFloat).reshape({});
}

}  // namespace

void AdamWState::serialize(torch::serialize::OutputArchive& archive) const {
  torch::optim::AdamWParamState plain(*this);
  if (step_count_.defined()) plain.step(static_cast<int64_t>(step_count_.item<float>()));
  plain.serialize(archive);
}

std::unique_ptr<torch::optim::OptimizerParamState> AdamWState::clone() const {
  return std::make_unique<AdamWState>(*this);
}

namespace {

// The state of `p` as an AdamWState: made on its first step (zero moments, count 0), or taken
// over from a plain AdamWParamState (a loaded checkpoint), its count from step().
AdamWState& adamw_state(std::unique_ptr<torch::optim::OptimizerParamState>& slot,
                        const at::Tensor& p, bool amsgrad) {
  if (auto* st = dynamic_cast<AdamWState*>(slot.get())) return *st;
  auto st = std::make_unique<AdamWState>();
  if (slot) {
    const auto& loaded = static_cast<const torch::optim::AdamWParamState&>(*slot);
    st->step(loaded.step());
    st->exp_avg(loaded.exp_avg());
    st->exp_avg_sq(loaded.exp_avg_sq());
    st->max_exp_avg_sq(loaded.max_exp_avg_sq());
  } else {
    st->step(0);
    st->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
    st->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
  }
  if (amsgrad && !st->max_exp_avg_sq().defined()) {
    st->max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
  }
  // Python keeps the step as a 0-d fp32 tensor on the parameter's device.
  st->set_step_count(at::full({}, static_cast<double>(st->step()),
                              at::TensorOptions(at::kFloat).device(p.device())));
  slot = std::move(st);
  return static_cast<AdamWState&>(*slot);
}

// The closure's loss, computed with gradients on (as torch::optim's step does).
at::Tensor run(const torch::optim::Optimizer::LossClosure& closure) {
  if (closure == nullptr) return at::Tensor();
  at::AutoGradMode enable_grad(true);
  return closure();
}

}  // namespace

void GradScaling::set_grad_scaling(at::Tensor grad_scale, at::Tensor found_inf) {
  grad_scale_ = std::move(grad_scale);
  found_inf_ = std::move(found_inf);
}

void GradScaling::step_only(const std::vector<at::Tensor>& params) {
  std::unordered_set<const c10::TensorImpl*> only;
  for (const auto& p : params) only.insert(p.unsafeGetTensorImpl());
  auto& optimizer = dynamic_cast<torch::optim::Optimizer&>(*this);
  only_ = &only;
  try {
    optimizer.step();
  } catch (...) {
    only_ = nullptr;
    throw;
  }
  only_ = nullptr;
}

// At construction: a parameter whose gradients its strategy leaves in a low-precision dtype
// (FSDP's keep_low_precision_grads) is refused, naming both settings, rather than at the first
// step.
void check_grad_dtypes(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                       const char* who) {
  size_t index = 0;
  for (const auto& g : groups) {
    for (const auto& p : g.params()) {
      const auto dtype = amp::low_precision_grad_dtype(p);
      DTRAIN_CHECK_AS(UsageError, !dtype || *dtype == p.scalar_type(), who, ": parameter ", index,
                      " (", c10::toString(p.scalar_type()),
                      ") is an FSDP master whose gradients FSDP leaves in ", c10::toString(*dtype),
                      " (MixedPrecisionPolicy::keep_low_precision_grads, precision."
                      "keep_low_precision_grads), and the fused kernel steps a parameter with a "
                      "gradient of its own dtype, as PyTorch's fused AdamW and SGD do: turn "
                      "keep_low_precision_grads off, or step with an optimizer that takes "
                      "low-precision gradients");
      ++index;
    }
  }
}

AdamW::AdamW(std::vector<at::Tensor> params, torch::optim::AdamWOptions defaults)
    : torch::optim::AdamW(std::move(params), std::move(defaults)) {
  check_grad_dtypes(param_groups_, "dtrain::optim::AdamW");
}

AdamW::AdamW(const std::vector<OptimizerParamGroup>& groups, torch::optim::AdamWOptions defaults)
    : torch::optim::AdamW(groups, std::move(defaults)) {
  check_grad_dtypes(param_groups_, "dtrain::optim::AdamW");
}

at::Tensor AdamW::step(LossClosure closure) {
  at::Tensor loss = run(closure);
  at::NoGradGuard no_grad;
  for (auto& group : param_groups_) {
    auto& o = static_cast<torch::optim::AdamWOptions&>(group.options());
    struct Lists {
      std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps;
    };
    std::vector<std::pair<GroupKey, Lists>> by_key;
    for (auto& p : group.params()) {
      if (!p.grad().defined() || !selected(p)) continue;
      check_fusable(p, p.grad(), "dtrain::optim::AdamW");
      AdamWState& st = adamw_state(state_[p.unsafeGetTensorImpl()], p, o.amsgrad());
      const GroupKey k = key_of(p);
      auto it = std::find_if(by_key.begin(), by_key.end(), [&](auto& e) { return e.first == k; });
      if (it == by_key.end()) it = by_key.insert(by_key.end(), {k, Lists{}});
      Lists& l = it->second;
      l.params.push_back(p);
      l.grads.push_back(p.grad());
      l.exp_avgs.push_back(st.exp_avg());
      l.exp_avg_sqs.push_back(st.exp_avg_sq());
      if (o.amsgrad()) l.max_exp_avg_sqs.push_back(st.max_exp_avg_sq());
      l.steps.push_back(st.step_count());
    }
    const auto [beta1, beta2] = o.betas();
    for (auto& [k, l] : by_key) {
      const c10::Device d = l.params.front().device();
      // Python's _fused_adamw: count the step, run the kernel (a no-op when skipped), take the
      // count back when skipped. The state exists either way, as in Python.
      const std::optional<at::Tensor> skip = skip_flag(found_inf_, d);
      at::_foreach_add_(l.steps, 1);
      at::_fused_adamw_(l.params, l.grads, l.exp_avgs, l.exp_avg_sqs, l.max_exp_avg_sqs, l.steps,
                        o.lr(), beta1, beta2, o.weight_decay(), o.eps(), o.amsgrad(),
                        /*maximize=*/false, on(grad_scale_, d), skip);
      if (skip) at::_foreach_sub_(l.steps, std::vector<at::Tensor>(l.steps.size(), *skip));
    }
  }
  return loss;
}

SGD::SGD(std::vector<at::Tensor> params, torch::optim::SGDOptions defaults)
    : torch::optim::SGD(std::move(params), std::move(defaults)) {
  check_grad_dtypes(param_groups_, "dtrain::optim::SGD");
}

SGD::SGD(const std::vector<OptimizerParamGroup>& groups, torch::optim::SGDOptions defaults)
    : torch::optim::SGD(groups, std::move(defaults)) {
  check_grad_dtypes(param_groups_, "dtrain::optim::SGD");
}

at::Tensor SGD::step(LossClosure closure) {
  at::Tensor loss = run(closure);
  at::NoGradGuard no_grad;
  for (auto& group : param_groups_) {
    auto& o = static_cast<torch::optim::SGDOptions&>(group.options());
    const bool momentum = o.momentum() != 0;
    std::vector<at::Tensor> params, grads, buffers;
    std::vector<torch::optim::SGDParamState*> states;
    bool first_step = momentum;  // Python: every buffer absent, and momentum on
    for (auto& p : group.params()) {
      if (!p.grad().defined() || !selected(p)) continue;
      check_fusable(p, p.grad(), "dtrain::optim::SGD");
      params.push_back(p);
      grads.push_back(p.grad());
      auto it = state_.find(p.unsafeGetTensorImpl());
      auto* st = it == state_.end() ? nullptr
                                    : static_cast<torch::optim::SGDParamState*>(it->second.get());
      states.push_back(st);
      if (st != nullptr && st->momentum_buffer().defined()) first_step = false;
    }
    if (params.empty()) continue;
    if (momentum) {
      for (size_t i = 0; i < params.size(); ++i) {
        // On the first step the kernel fills empty buffers with the gradient; PyTorch then
        // stores them, even when found_inf skipped the step.
        const bool has = states[i] != nullptr && states[i]->momentum_buffer().defined();
        // Python's fused SGD cannot step a parameter that joins after the first step either.
        DTRAIN_CHECK_AS(UsageError, first_step || has, "dtrain::optim::SGD: parameter ", i,
                        " of its group has a gradient but "
                        "no momentum buffer after the first step (the fused kernel initializes "
                        "every buffer on the first step only)");
        buffers.push_back(first_step ? at::empty_like(grads[i]) : states[i]->momentum_buffer());
      }
    }
    std::vector<std::pair<GroupKey, std::vector<size_t>>> by_key;
    for (size_t i = 0; i < params.size(); ++i) {
      const GroupKey k = key_of(params[i]);
      auto it = std::find_if(by_key.begin(), by_key.end(), [&](auto& e) { return e.first == k; });
      if (it == by_key.end()) it = by_key.insert(by_key.end(), {k, {}});
      it->second.push_back(i);
    }
    for (auto& [k, idx] : by_key) {
      std::vector<at::Tensor> ps, gs, bs;
      for (size_t i : idx) {
        ps.push_back(params[i]);
        gs.push_back(grads[i]);
        if (momentum) bs.push_back(buffers[i]);
      }
      const c10::Device d = ps.front().device();
      at::_fused_sgd_(ps, gs, bs, o.weight_decay(), o.momentum(), o.lr(), o.dampening(),
                      o.nesterov(), /*maximize=*/false, first_step, on(grad_scale_, d),
                      skip_flag(found_inf_, d));
    }
    if (momentum) {
      for (size_t i = 0; i < params.size(); ++i) {
        auto& slot = state_[params[i].unsafeGetTensorImpl()];
        if (!slot) slot = std::make_unique<torch::optim::SGDParamState>();
        static_cast<torch::optim::SGDParamState&>(*slot).momentum_buffer(buffers[i]);
      }
    }
  }
  return loss;
}

}  // namespace dtrain::optim
