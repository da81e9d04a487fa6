// GradScaler: dynamic loss scaling with the semantics of torch.amp.GradScaler, number for
// number (same kernels: at::_amp_foreach_non_finite_check_and_unscale_ and
// at::_amp_update_scale_; inv_scale computed in fp64 then rounded to fp32, as PyTorch does).
//
//   scaler.scale(loss).backward();
//   scaler.unscale_(optimizer);          // optional: to clip or inspect real gradients
//   clip_grad_norm_(...);
//   bool stepped = scaler.step(optimizer);  // skipped when a gradient is inf/NaN
//   scaler.update();                     // once per iteration, after every optimizer stepped
//
// Per optimizer and iteration the state goes READY -> UNSCALED -> STEPPED and back to READY
// at update(); out-of-order calls throw UsageError with PyTorch's messages. One scaler may
// drive several optimizers; update() sums their found-inf flags. The scale and growth
// tracker live on the device of the first scaled output; the only host sync is the one
// step() needs to decide. Disabled, every call passes through (scale returns its input,
// step just steps, update does nothing), so one loop serves fp32, bf16 and fp16.
//
// The plain scaler refuses fp16 gradients (fp32 master gradients are expected), like
// PyTorch; ShardedGradScaler accepts them.
#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <torch/arg.h>

#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace torch::optim {
class Optimizer;
}

namespace dtrain::amp {

// Orders devices for maps keyed by device.
struct DeviceLess {
  bool operator()(const c10::Device& a, const c10::Device& b) const {
    return std::make_pair(a.type(), a.index()) < std::make_pair(b.type(), b.index());
  }
};
using PerDevice = std::map<c10::Device, at::Tensor, DeviceLess>;

// An optimizer that unscales and skips inside its own step (PyTorch's
// `_step_supports_amp_scaling`, which its fused AdamW and SGD set): GradScaler::step hands it
// the scale and the found-inf flag and always calls step(), instead of unscaling the
// gradients in a pass of its own and skipping the step on the host. dtrain::optim's fused
// optimizers are such optimizers.
class ScalingAwareOptimizer {
 public:
  virtual ~ScalingAwareOptimizer() = default;
  // For the next step() only. grad_scale (0-d fp32): divide the gradients by it inside the
  // step; undefined when unscale_() already did. found_inf (1-element fp32): non-zero leaves
  // parameters and state as they are (the step is skipped); undefined: never skip.
  virtual void set_grad_scaling(at::Tensor grad_scale, at::Tensor found_inf) = 0;
};

struct GradScalerOptions {
  TORCH_ARG(double, init_scale) = 65536.0;
  TORCH_ARG(double, growth_factor) = 2.0;
  TORCH_ARG(double, backoff_factor) = 0.5;
  TORCH_ARG(int64_t, growth_interval) = 2000;
  TORCH_ARG(bool, enabled) = true;
};

class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {});
  virtual ~GradScaler() = default;

  bool is_enabled() const { return enabled_; }

  // outputs * scale (on outputs' device). Disabled: outputs unchanged.
  at::Tensor scale(const at::Tensor& outputs);
  std::vector<at::Tensor> scale(const std::vector<at::Tensor>& outputs);

  // Divides the optimizer's gradients by the scale in place and records inf/NaN.
  void unscale_(torch::optim::Optimizer& optimizer);

  // Unscales if not done yet, then steps unless a gradient was inf/NaN. Returns whether
  // the optimizer stepped (disabled: always steps and returns true).
  bool step(torch::optim::Optimizer& optimizer);
  // The same, with the inf/NaN verdict over every gradient of `optimizer` already made
  // (`found_inf`: 1 element, nonzero when some gradient is inf/NaN), e.g. by DDP's
  // check_finite in the pass that writes its reduced buckets back. A fused optimizer
  // (ScalingAwareOptimizer) then steps without the scaler's own pass over the gradients;
  // any other optimizer, or one unscale_()d already, steps as step(optimizer) does. The
  // flag must come from this iteration's gradients, as they are now.
  bool step(torch::optim::Optimizer& optimizer, const at::Tensor& found_inf);

  // Backs the scale off after a skipped step, grows it after growth_interval clean ones.
  void update();
  // Sets the scale (the growth tracker is left as is, as in PyTorch).
  void update(double new_scale);
  void update(const at::Tensor& new_scale);

  double get_scale() const;
  int64_t get_growth_tracker() const;
  double get_growth_factor() const { return growth_factor_; }
  double get_backoff_factor() const { return backoff_factor_; }
  int64_t get_growth_interval() const { return growth_interval_; }
  void set_growth_factor(double f) { growth_factor_ = f; }
  void set_backoff_factor(double f) { backoff_factor_ = f; }
  void set_growth_interval(int64_t n) { growth_interval_ = n; }

  // Whether any optimizer found inf/NaN this iteration (valid between unscale_ and update;
  // a host sync).
  bool found_inf() const;

  // --- A gradient reduction that unscales while it writes gradients back ---------------
  // DDP with DDPOptions::grad_scaler: its end of backward widens every reduced bucket into
  // the gradients anyway, and with these calls it also checks and unscales them there, so
  // step() (or unscale_()) makes no pass of its own over them and hands the fused kernel no
  // scale. The numbers are the same bit for bit, hence the conditions below.
  //
  // The scale to divide reduced gradients by as they are written back, when that is exactly
  // what unscaling them here would give: enabled, the scale on the CPU and a power of two
  // (the defaults keep it one: init_scale 2^16, growth 2, backoff 0.5), and a product of the
  // scale's reciprocal that is exact. Otherwise nullopt: leave the gradients scaled.
  std::optional<float> scale_for_reduction() const;
  // The reduction `owner` divided `grads` by `scale` (from scale_for_reduction()) as it wrote
  // them back; found_inf[i]: grads[i] holds an inf/NaN. The next unscale_()/step() of an
  // optimizer takes each of these gradients as unscaled, with its verdict, once. A gradient
  // changed in place after this (a backward outside the reduction's wrapper, an in-place
  // edit) makes that unscale_()/step() throw rather than unscale it twice.
  void record_unscaled(const void* owner, const std::vector<at::Tensor>& grads, float scale,
                       const std::vector<bool>& found_inf);
  // Multiplies the gradients `owner` recorded, and no optimizer has taken since, by their
  // scale again, so a further backward accumulates scaled gradients onto scaled ones (DDP
  // calls it before every forward: two backwards before one step). Exact unless a value
  // fell into fp32's subnormal range when it was unscaled.
  void rescale_unscaled(const void* owner);

  // A dict with PyTorch's keys and value types (scale: float, growth_factor: float,
  // backoff_factor: float, growth_interval: int, _growth_tracker: int), so a checkpoint
  // written with torch::pickle_save loads into Python's GradScaler.load_state_dict.
  // Empty when disabled; loading an empty dict into an enabled scaler throws.
  c10::impl::GenericDict state_dict() const;
  void load_state_dict(const c10::impl::GenericDict& state);

 protected:
  // ShardedGradScaler: accept fp16 gradients.
  virtual bool allow_fp16_grads() const { return false; }
  // ShardedGradScaler: make found-inf agree across ranks (called after every unscale_).
  // `found` maps device to a 1-element fp32 flag; it is empty when the optimizer had no
  // gradient (the plain scaler then refuses to step, as PyTorch does).
  virtual void sync_found_inf(PerDevice& /*found*/, const at::Tensor& /*scale*/) {}
  // ShardedGradScaler: cast the scaled output back to the input's dtype.
  virtual at::Tensor finish_scale(const at::Tensor& scaled, const at::Tensor& /*input*/) {
    return scaled;
  }

 private:
  enum class Stage { kReady, kUnscaled, kStepped };
  struct OptimizerState {
    Stage stage = Stage::kReady;
    PerDevice found_inf_per_device;
  };

  void check_initialized(const char* funcname) const;
  void lazy_init(const c10::Device& device);
  PerDevice unscale_grads(torch::optim::Optimizer& optimizer, const at::Tensor& inv_scale);
  // Whether any gradient of `optimizer` is one a reduction recorded as unscaled.
  bool has_unscaled(torch::optim::Optimizer& optimizer) const;
  bool step_impl(torch::optim::Optimizer& optimizer, const at::Tensor* found_inf);

  bool enabled_;
  double init_scale_;
  double growth_factor_;
  double backoff_factor_;
  int64_t growth_interval_;
  int64_t init_growth_tracker_ = 0;
  at::Tensor scale_;           // 0-dim fp32, lazily created on the first output's device
  at::Tensor growth_tracker_;  // 0-dim int32, same device
  std::map<const torch::optim::Optimizer*, OptimizerState> per_optimizer_;
  // record_unscaled's gradients, by TensorImpl, until an optimizer takes them or update().
  struct Unscaled {
    at::Tensor grad;  // held, so the address is not reused while recorded
    int64_t version = 0;
    float scale = 1;
    bool found_inf = false;
    const void* owner = nullptr;
  };
  std::unordered_map<const c10::TensorImpl*, Unscaled> unscaled_;
};

}  // namespace dtrain::amp
