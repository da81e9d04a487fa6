// GradScaler: dynamic loss scaling with the semantics of torch.amp.GradScaler, number for
// number (same kernels: at::_amp_foreach_non_finite_check_and_unscale_ and
// at::_amp_update_scale_; inv_scale computed in fp64 then rounded to fp32, as PyTorch does).
//
//   scaler.scale(loss).backward();
//   scaler.unscale_(optimizer);          // optional: to clip or inspect real gradients
//   clip_grad_norm_(...);
//   scaler.step(optimizer);              // skipped when a gradient is inf/NaN
//   scaler.update();                     // once per iteration, after every optimizer stepped
//
// Per optimizer and iteration the state goes READY -> UNSCALED -> STEPPED and back to READY
// at update(); out-of-order calls throw UsageError with PyTorch's messages. One scaler may
// drive several optimizers; update() sums their found-inf flags. The scale and growth
// tracker live on the device of the first scaled output. With a fused optimizer
// (ScalingAwareOptimizer) nothing waits for the device: step_deferred() hands back the
// verdict as a tensor and scale_tensor() the scale, as PyTorch's GradScaler does for its fused
// optimizers; step()'s bool and get_scale() are host reads, for code that asks for them.
// Disabled, every call passes through (scale returns its input,
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

// `t` on `device` for the next op there: without waiting when that is a GPU (the stream orders
// the copy before its use), waiting when it is the host, which may read the copy at once (a
// non-blocking copy into pinned memory could be read before it landed). The scaler and the
// fused optimizers move their flags and scales with it.
at::Tensor moved_for_use(const at::Tensor& t, const c10::Device& device);

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
  // step(), with the verdict left on the device: the 1-element fp32 flag on the scale's device,
  // non-zero when a gradient was inf/NaN and the step was skipped (undefined when disabled).
  // With a ScalingAwareOptimizer nothing here reads a value back to the host; any other
  // optimizer is told on the host whether to step, which needs the read (as in PyTorch).
  at::Tensor step_deferred(torch::optim::Optimizer& optimizer);

  // Backs the scale off after a skipped step, grows it after growth_interval clean ones.
  void update();
  // Sets the scale (the growth tracker is left as is, as in PyTorch).
  void update(double new_scale);
  void update(const at::Tensor& new_scale);

  double get_scale() const;
  // The scale now, as a 0-d fp32 tensor on the scale's device (a copy; 1 when disabled,
  // init_scale on the CPU before the first scale()): get_scale() without the host read.
  at::Tensor scale_tensor() const;
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

  // --- Gradients unscaled and judged before unscale_ ------------------------------------
  // Code that writes gradients anyway (a reduction widening its buckets into them, say) may
  // divide them by the scale and check them for inf/NaN on the way, and hand the scaler that
  // verdict. The next unscale_()/step() of an optimizer then takes each of those gradients as
  // it is, with its verdict, once: no pass of its own over them, no scale handed to a fused
  // kernel. The numbers are unscale_'s bit for bit, hence the conditions on the scale.
  //
  // The scale to divide gradients by, when that is exactly what unscale_ would give: enabled,
  // the scale on the CPU and a power of two (the defaults keep it one: init_scale 2^16,
  // growth 2, backoff 0.5), with a reciprocal whose products are exact. Otherwise nullopt:
  // leave the gradients scaled.
  std::optional<float> exact_unscale_divisor() const;
  // Gradients already divided by `scale` (from exact_unscale_divisor()); found_inf[i]: grads[i]
  // holds an inf/NaN.
  struct UnscaledGrads {
    std::vector<at::Tensor> grads;
    float scale = 1;
    std::vector<bool> found_inf;
  };
  // Takes such a verdict; the ticket withdraws it. A gradient changed in place after this (a
  // backward that did not go through the code that unscaled it, an in-place edit) makes the
  // next unscale_()/step() throw rather than unscale it twice.
  using Ticket = uint64_t;
  Ticket accept_unscaled(UnscaledGrads verdict);
  // Multiplies the gradients of `ticket` that no optimizer has taken since by their scale
  // again, so that a further backward accumulates scaled gradients onto scaled ones (two
  // backwards before one step). Exact unless a value fell into fp32's subnormal range when it
  // was unscaled. A ticket already taken or withdrawn is a no-op.
  void withdraw(Ticket ticket);

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
  // The state's per-device found-inf flags summed on the scale's device.
  at::Tensor summed_found_inf(const OptimizerState& state) const;
  // Steps (or skips) and returns the summed found-inf flag; undefined when disabled.
  at::Tensor step_impl(torch::optim::Optimizer& optimizer, const at::Tensor* found_inf);

  bool enabled_;
  double init_scale_;
  double growth_factor_;
  double backoff_factor_;
  int64_t growth_interval_;
  int64_t init_growth_tracker_ = 0;
  at::Tensor scale_;           // 0-dim fp32, lazily created on the first output's device
  at::Tensor growth_tracker_;  // 0-dim int32, same device
  std::map<const torch::optim::Optimizer*, OptimizerState> per_optimizer_;
  // accept_unscaled's gradients, by TensorImpl, until an optimizer takes them, their ticket
  // is withdrawn, or update().
  struct Unscaled {
    at::Tensor grad;  // held, so the address is not reused while recorded
    int64_t version = 0;
    float scale = 1;
    bool found_inf = false;
    Ticket ticket = 0;
  };
  std::unordered_map<const c10::TensorImpl*, Unscaled> unscaled_;
  Ticket last_ticket_ = 0;
};

}  // namespace dtrain::amp
