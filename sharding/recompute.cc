#include "sharding/recompute.h"

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/Generator.h>
#include <ATen/core/ivalue.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <mutex>
#include <optional>
#include <utility>

namespace dtrain::sharding {
namespace {

constexpr c10::DeviceType kAutocastDevices[] = {c10::DeviceType::CPU, c10::DeviceType::CUDA};

struct AutocastState {
  bool enabled[2] = {false, false};
  c10::ScalarType dtype[2] = {c10::kBFloat16, c10::kHalf};
  bool cache = true;

  static AutocastState now() {
    AutocastState s;
    for (int i = 0; i < 2; ++i) {
      s.enabled[i] = at::autocast::is_autocast_enabled(kAutocastDevices[i]);
      s.dtype[i] = at::autocast::get_autocast_dtype(kAutocastDevices[i]);
    }
    s.cache = at::autocast::is_autocast_cache_enabled();
    return s;
  }
  void apply() const {
    for (int i = 0; i < 2; ++i) {
      at::autocast::set_autocast_enabled(kAutocastDevices[i], enabled[i]);
      at::autocast::set_autocast_dtype(kAutocastDevices[i], dtype[i]);
    }
    at::autocast::set_autocast_cache_enabled(cache);
  }
};

// Sets `s` until it ends, then puts back what was there; the cast cache is cleared when no
// autocast region is open around it (as amp::AutocastGuard does). `cache` false: the cache
// is off inside.
class AutocastScope {
 public:
  AutocastScope(AutocastState s, bool cache) : saved_(AutocastState::now()) {
    s.cache = s.cache && cache;
    s.apply();
    at::autocast::increment_nesting();
  }
  ~AutocastScope() {
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    saved_.apply();
  }
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  AutocastState saved_;
};

// The default generators a region draws from: the CPU's, and the CUDA device's of its inputs.
std::vector<at::Generator> generators(const std::vector<at::Tensor>& inputs) {
  std::vector<at::Generator> out{at::detail::getDefaultCPUGenerator()};
  for (const auto& t : inputs) {
    if (t.defined() && t.is_cuda()) {
      out.push_back(at::globalContext().defaultGenerator(t.device()));
      break;
    }
  }
  return out;
}

std::vector<at::Tensor> states_of(std::vector<at::Generator>& gens) {
  std::vector<at::Tensor> out;
  for (auto& g : gens) {
    std::lock_guard<std::mutex> lock(g.mutex());
    out.push_back(g.get_state());
  }
  return out;
}

void set_states(std::vector<at::Generator>& gens, const std::vector<at::Tensor>& states) {
  for (size_t i = 0; i < gens.size(); ++i) {
    std::lock_guard<std::mutex> lock(gens[i].mutex());
    gens[i].set_state(states[i]);
  }
}

// What the backward needs besides the saved inputs; held by the autograd context.
struct Region : torch::CustomClassHolder {
  RegionFn fn;
  std::vector<at::Tensor> params;  // the trainable ones: the module's own (not saved copies)
  std::vector<bool> input_requires_grad;
  std::vector<at::Generator> gens;
  std::vector<at::Tensor> rng;
  AutocastState autocast;
};

struct RecomputeFunction : torch::autograd::Function<RecomputeFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                c10::intrusive_ptr<Region> region,
                                                at::TensorList inputs, at::TensorList params) {
    (void)params;  // inputs of the node only, so that their gradients leave its backward
    std::vector<at::Tensor> in(inputs.begin(), inputs.end());
    ctx->save_for_backward(in);
    std::vector<at::Tensor> out;
    {
      AutocastScope same(region->autocast, /*cache=*/false);  // no cast without its gradient
      out = region->fn(in);
    }
    ctx->saved_data["region"] = c10::IValue::make_capsule(std::move(region));
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto region = c10::static_intrusive_pointer_cast<Region>(ctx->saved_data["region"].toCapsule());
    const std::vector<at::Tensor> saved = ctx->get_saved_variables();
    std::vector<at::Tensor> in;
    std::vector<at::Tensor> wrt;
    for (size_t i = 0; i < saved.size(); ++i) {
      at::Tensor x = saved[i].defined() ? saved[i].detach() : saved[i];
      if (x.defined() && region->input_requires_grad[i]) {
        x.requires_grad_(true);
        wrt.push_back(x);
      }
      in.push_back(x);
    }
    for (const auto& p : region->params) wrt.push_back(p);
    std::vector<at::Tensor> out;
    {
      const std::vector<at::Tensor> now = states_of(region->gens);
      set_states(region->gens, region->rng);
      try {
        c10::AutoGradMode grad_on(true);
        AutocastScope same(region->autocast, /*cache=*/true);
        out = region->fn(in);
      } catch (...) {
        set_states(region->gens, now);
        throw;
      }
      set_states(region->gens, now);
    }
    std::vector<at::Tensor> roots, root_grads;
    for (size_t i = 0; i < out.size() && i < grads.size(); ++i) {
      if (out[i].defined() && out[i].requires_grad() && grads[i].defined()) {
        roots.push_back(out[i]);
        root_grads.push_back(grads[i]);
      }
    }
    std::vector<at::Tensor> got;
    if (!roots.empty() && !wrt.empty()) {
      got = torch::autograd::grad(roots, wrt, root_grads, /*retain_graph=*/false,
                                  /*create_graph=*/false, /*allow_unused=*/true);
    } else {
      got.resize(wrt.size());
    }
    // One gradient per forward argument: the region (none), each input, each parameter.
    torch::autograd::variable_list result{at::Tensor()};
    size_t next = 0;
    for (size_t i = 0; i < in.size(); ++i) {
      result.push_back(in[i].defined() && region->input_requires_grad[i] ? got[next++]
                                                                         : at::Tensor());
    }
    for (size_t i = 0; i < region->params.size(); ++i) result.push_back(got[next++]);
    return result;
  }
};

}  // namespace

std::vector<at::Tensor> recompute(RegionFn fn, const std::vector<at::Tensor>& inputs,
                                  const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> trainable;
  for (const auto& p : params) {
    if (p.defined() && p.requires_grad()) trainable.push_back(p);
  }
  bool any = !trainable.empty();
  for (const auto& x : inputs) any = any || (x.defined() && x.requires_grad());
  if (!c10::GradMode::is_enabled() || !any) return fn(inputs);
  auto region = c10::make_intrusive<Region>();
  region->fn = std::move(fn);
  region->params = trainable;
  for (const auto& x : inputs)
    region->input_requires_grad.push_back(x.defined() && x.requires_grad());
  region->gens = generators(inputs);
  region->rng = states_of(region->gens);
  region->autocast = AutocastState::now();
  return RecomputeFunction::apply(std::move(region), at::TensorList(inputs),
                                  at::TensorList(trainable));
}

}  // namespace dtrain::sharding
