#include "amp/grad_scaler.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/optim/optimizer.h>

#include <cmath>

#include "core/error.h"

namespace dtrain::amp {

at::Tensor moved_for_use(const at::Tensor& t, const c10::Device& device) {
  return t.to(device, /*non_blocking=*/!device.is_cpu());
}

GradScaler::GradScaler(GradScalerOptions options)
    : enabled_(options.enabled()),
      init_scale_(options.init_scale()),
      growth_factor_(options.growth_factor()),
      backoff_factor_(options.backoff_factor()),
      growth_interval_(options.growth_interval()) {
  if (enabled_) {
    DTRAIN_CHECK_AS(UsageError, growth_factor_ > 1.0, "The growth factor must be > 1.0.");
    DTRAIN_CHECK_AS(UsageError, backoff_factor_ < 1.0, "The backoff factor must be < 1.0.");
  }
}

void GradScaler::check_initialized(const char* funcname) const {
  DTRAIN_CHECK_AS(UsageError, scale_.defined(), "Attempted ", funcname,
                  " but _scale is None.  This may indicate your script did not use "
                  "scaler.scale(loss or outputs) earlier in the iteration.");
}

void GradScaler::lazy_init(const c10::Device& device) {
  auto opts = at::TensorOptions().device(device);
  scale_ = at::full({}, init_scale_, opts.dtype(at::kFloat));
  growth_tracker_ = at::full({}, init_growth_tracker_, opts.dtype(at::kInt));
}

at::Tensor GradScaler::scale(const at::Tensor& outputs) {
  if (!enabled_) return outputs;
  if (!scale_.defined()) lazy_init(outputs.device());
  return finish_scale(outputs * moved_for_use(scale_, outputs.device()), outputs);
}

std::vector<at::Tensor> GradScaler::scale(const std::vector<at::Tensor>& outputs) {
  std::vector<at::Tensor> out;
  out.reserve(outputs.size());
  for (const auto& o : outputs) out.push_back(scale(o));
  return out;
}

PerDevice GradScaler::unscale_grads(torch::optim::Optimizer& optimizer,
                                    const at::Tensor& inv_scale) {
  c10::NoGradGuard no_grad;
  std::map<std::pair<std::string, c10::ScalarType>, std::vector<at::Tensor>> grads;
  // Devices of gradients a reduction unscaled already, and whether one of them is inf/NaN.
  std::map<c10::Device, bool, DeviceLess> reduced;
  // Gradients a reduction unscaled exist only with a CPU scale (exact_unscale_divisor): its
  // value is read from memory, not waited for.
  DTRAIN_CHECK_AS(UsageError, unscaled_.empty() || scale_.is_cpu(),
                  "GradScaler: accept_unscaled() was given gradients while the scale lives on ",
                  scale_.device().str(),
                  "; unscaled gradients are taken only with a CPU scale (see "
                  "exact_unscale_divisor())");
  const float current = unscaled_.empty() ? 0.0f : *scale_.data_ptr<float>();
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      const at::Tensor& g = p.grad();
      if (!g.defined()) continue;
      if (auto it = unscaled_.find(g.unsafeGetTensorImpl()); it != unscaled_.end()) {
        const Unscaled& u = it->second;
        DTRAIN_CHECK_AS(UsageError, u.version == g._version(),
                        "GradScaler: a gradient handed over as unscaled (accept_unscaled: DDP "
                        "with DDPOptions::grad_scaler unscales while writing gradients back) "
                        "changed before unscale_()/step() (a backward that did not run through "
                        "the wrapper's forward, or an in-place edit); unscaling it again would "
                        "be wrong. Run every forward through the wrapper, and edit gradients "
                        "only after unscale_().");
        DTRAIN_CHECK_AS(UsageError, u.scale == current,
                        "GradScaler: the scale changed between the backward and unscale_()/"
                        "step() (",
                        u.scale, " -> ", current,
                        "); call update() only after every optimizer stepped.");
        bool& found = reduced[g.device()];
        found = found || u.found_inf;
        unscaled_.erase(it);
        continue;
      }
      DTRAIN_CHECK_AS(UsageError, allow_fp16_grads() || g.scalar_type() != at::kHalf,
                      "Attempting to unscale FP16 gradients. (GradScaler expects fp32 master "
                      "gradients; keep fp32 parameters under autocast, or use a "
                      "ShardedGradScaler.)");
      DTRAIN_CHECK_AS(UsageError, !g.is_sparse(),
                      "GradScaler: sparse gradients are not supported by dtrain");
      grads[{g.device().str(), g.scalar_type()}].push_back(g);
    }
  }
  PerDevice found, inv;
  auto on = [](PerDevice& m, const c10::Device& d, const at::Tensor& master) -> at::Tensor& {
    auto it = m.find(d);
    if (it == m.end()) it = m.emplace(d, moved_for_use(master, d)).first;
    return it->second;
  };
  at::Tensor found_master = at::zeros({1}, scale_.options().dtype(at::kFloat));
  for (auto& [key, list] : grads) {
    c10::Device device = list.front().device();
    at::Tensor& f = on(found, device, found_master);
    at::_amp_foreach_non_finite_check_and_unscale_(list, f, on(inv, device, inv_scale));
  }
  for (auto& [device, inf] : reduced) {
    at::Tensor& f = on(found, device, found_master);
    if (inf) f.fill_(1.0);
  }
  return found;
}

bool GradScaler::has_unscaled(torch::optim::Optimizer& optimizer) const {
  if (unscaled_.empty()) return false;
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      const at::Tensor& g = p.grad();
      if (g.defined() && unscaled_.count(g.unsafeGetTensorImpl())) return true;
    }
  }
  return false;
}

std::optional<float> GradScaler::exact_unscale_divisor() const {
  if (!enabled_ || !scale_.defined() || !scale_.is_cpu()) return std::nullopt;
  const float s = *scale_.data_ptr<float>();  // a CPU tensor: no device to wait for
  if (!(s > 0) || !std::isfinite(s)) return std::nullopt;
  int exponent = 0;
  // A power of two whose reciprocal is a normal float: x * (1 / s) is then the exact real
  // x / s rounded once, as the division (fused kernel) and the multiplication by PyTorch's
  // inv_scale (unscale_) both are.
  if (std::frexp(s, &exponent) != 0.5f || exponent - 1 > 126) return std::nullopt;
  return s;
}

GradScaler::Ticket GradScaler::accept_unscaled(UnscaledGrads verdict) {
  DTRAIN_CHECK_AS(UsageError, verdict.grads.size() == verdict.found_inf.size(),
                  "GradScaler::accept_unscaled: ", verdict.grads.size(), " gradients but ",
                  verdict.found_inf.size(), " verdicts");
  const Ticket ticket = ++last_ticket_;
  for (size_t i = 0; i < verdict.grads.size(); ++i) {
    const at::Tensor& g = verdict.grads[i];
    if (!g.defined()) continue;
    unscaled_[g.unsafeGetTensorImpl()] =
        Unscaled{g, g._version(), verdict.scale, verdict.found_inf[i], ticket};
  }
  return ticket;
}

void GradScaler::withdraw(Ticket ticket) {
  if (unscaled_.empty()) return;
  c10::NoGradGuard no_grad;
  for (auto it = unscaled_.begin(); it != unscaled_.end();) {
    if (it->second.ticket != ticket) {
      ++it;
      continue;
    }
    it->second.grad.mul_(static_cast<double>(it->second.scale));
    it = unscaled_.erase(it);
  }
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (!enabled_) return;
  check_initialized("unscale_");
  OptimizerState& state = per_optimizer_[&optimizer];
  DTRAIN_CHECK_AS(UsageError, state.stage != Stage::kUnscaled,
                  "unscale_() has already been called on this optimizer since the last update().");
  DTRAIN_CHECK_AS(UsageError, state.stage != Stage::kStepped,
                  "unscale_() is being called after step().");
  at::Tensor inv_scale = scale_.to(at::kDouble).reciprocal().to(at::kFloat);
  state.found_inf_per_device = unscale_grads(optimizer, inv_scale);
  sync_found_inf(state.found_inf_per_device, scale_);
  state.stage = Stage::kUnscaled;
}

namespace {
bool stepped(const at::Tensor& found) { return !found.defined() || found.item<double>() == 0; }
}  // namespace

bool GradScaler::step(torch::optim::Optimizer& optimizer) {
  return stepped(step_impl(optimizer, nullptr));
}

bool GradScaler::step(torch::optim::Optimizer& optimizer, const at::Tensor& found_inf) {
  DTRAIN_CHECK_AS(UsageError, !found_inf.defined() || found_inf.numel() == 1,
                  "GradScaler::step: found_inf must hold one element, got ", found_inf.numel());
  return stepped(step_impl(optimizer, found_inf.defined() ? &found_inf : nullptr));
}

at::Tensor GradScaler::step_deferred(torch::optim::Optimizer& optimizer) {
  return step_impl(optimizer, nullptr);
}

at::Tensor GradScaler::step_impl(torch::optim::Optimizer& optimizer, const at::Tensor* found_inf) {
  if (!enabled_) {
    optimizer.step();
    return at::Tensor();
  }
  check_initialized("step");
  OptimizerState& state = per_optimizer_[&optimizer];
  DTRAIN_CHECK_AS(UsageError, state.stage != Stage::kStepped,
                  "step() has already been called since the last update().");
  if (auto* fused = dynamic_cast<ScalingAwareOptimizer*>(&optimizer)) {
    // PyTorch's path for `_step_supports_amp_scaling`: the inf check without unscaling (an
    // inverse scale of 1, as _check_inf_per_device), then the scale and the summed flag go to
    // the optimizer, whose kernel unscales (unless unscale_ already did) and skips.
    if (state.stage == Stage::kReady && has_unscaled(optimizer)) {
      // A reduction unscaled (some of) the gradients and judged them: unscale_ takes them as
      // they are and unscales any others, and the kernel gets no scale. (An explicit
      // found_inf judged the same gradients.)
      unscale_(optimizer);
    } else if (state.stage == Stage::kReady && found_inf != nullptr) {
      // The verdict is in: no pass over the gradients here.
      state.found_inf_per_device.clear();
      state.found_inf_per_device.emplace(
          scale_.device(),
          found_inf->reshape({1}).to(scale_.device(), at::kFloat, !scale_.is_cpu(), true));
      sync_found_inf(state.found_inf_per_device, scale_);
    } else if (state.stage == Stage::kReady) {
      state.found_inf_per_device =
          unscale_grads(optimizer, at::full({}, 1.0, scale_.options().dtype(at::kFloat)));
      sync_found_inf(state.found_inf_per_device, scale_);
    }
    DTRAIN_CHECK_AS(UsageError, !state.found_inf_per_device.empty(),
                    "No inf checks were recorded for this optimizer.");
    const at::Tensor found = summed_found_inf(state);
    fused->set_grad_scaling(state.stage == Stage::kUnscaled ? at::Tensor() : scale_.clone(), found);
    optimizer.step();
    fused->set_grad_scaling(at::Tensor(), at::Tensor());
    state.stage = Stage::kStepped;
    return found;
  }
  if (state.stage == Stage::kReady) unscale_(optimizer);
  DTRAIN_CHECK_AS(UsageError, !state.found_inf_per_device.empty(),
                  "No inf checks were recorded for this optimizer.");
  // PyTorch's _maybe_opt_step: the host decides, so it reads the flags.
  const at::Tensor found = summed_found_inf(state);
  if (found.item<double>() == 0) optimizer.step();
  state.stage = Stage::kStepped;
  return found;
}

void GradScaler::update() {
  if (!enabled_) return;
  check_initialized("update");
  std::vector<at::Tensor> found_infs;
  for (auto& [opt, state] : per_optimizer_) {
    for (auto& [device, f] : state.found_inf_per_device) {
      found_infs.push_back(moved_for_use(f, scale_.device()));
    }
  }
  DTRAIN_CHECK_AS(UsageError, !found_infs.empty(),
                  "No inf checks were recorded prior to update. (Call step() or unscale_() "
                  "for each optimizer first.)");
  at::Tensor combined = found_infs[0].clone();
  for (size_t i = 1; i < found_infs.size(); ++i) combined += found_infs[i];
  at::_amp_update_scale_(scale_, growth_tracker_, combined, growth_factor_, backoff_factor_,
                         growth_interval_);
  per_optimizer_.clear();
  unscaled_.clear();
}

void GradScaler::update(double new_scale) {
  if (!enabled_) return;
  check_initialized("update");
  scale_.fill_(new_scale);
  per_optimizer_.clear();
  unscaled_.clear();
}

void GradScaler::update(const at::Tensor& new_scale) {
  if (!enabled_) return;
  check_initialized("update");
  DTRAIN_CHECK_AS(UsageError,
                  new_scale.device().type() == scale_.device().type() && new_scale.numel() == 1 &&
                      !new_scale.requires_grad(),
                  "new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
                  "torch.FloatTensor with requires_grad=False.");
  scale_.copy_(new_scale.reshape({}));
  per_optimizer_.clear();
  unscaled_.clear();
}

double GradScaler::get_scale() const {
  if (!enabled_) return 1.0;
  return scale_.defined() ? scale_.item<double>() : init_scale_;
}

at::Tensor GradScaler::scale_tensor() const {
  if (!enabled_) return at::scalar_tensor(1.0, at::kFloat);
  return scale_.defined() ? scale_.clone() : at::scalar_tensor(init_scale_, at::kFloat);
}

int64_t GradScaler::get_growth_tracker() const {
  if (!enabled_) return 0;
  return growth_tracker_.defined() ? growth_tracker_.item<int64_t>() : init_growth_tracker_;
}

bool GradScaler::found_inf() const {
  for (const auto& [opt, state] : per_optimizer_) {
    for (const auto& [device, f] : state.found_inf_per_device) {
      if (f.item<double>() != 0) return true;
    }
  }
  return false;
}

c10::impl::GenericDict GradScaler::state_dict() const {
  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
  if (!enabled_) return d;
  d.insert("scale", get_scale());
  d.insert("growth_factor", growth_factor_);
  d.insert("backoff_factor", backoff_factor_);
  d.insert("growth_interval", growth_interval_);
  d.insert("_growth_tracker", get_growth_tracker());
  return d;
}

void GradScaler::load_state_dict(const c10::impl::GenericDict& state) {
  if (!enabled_) return;
  DTRAIN_CHECK_AS(UsageError, !state.empty(),
                  "The source state dict is empty, possibly because it was saved from a "
                  "disabled instance of GradScaler.");
  auto get = [&](const char* key) {
    auto it = state.find(c10::IValue(std::string(key)));
    DTRAIN_CHECK_AS(UsageError, it != state.end(), "GradScaler state dict has no '", key,
                    "' entry");
    return it->value();
  };
  auto as_double = [](const c10::IValue& v) {
    return v.isInt() ? double(v.toInt()) : v.toDouble();
  };
  init_scale_ = as_double(get("scale"));
  if (scale_.defined()) scale_.fill_(init_scale_);
  growth_factor_ = as_double(get("growth_factor"));
  backoff_factor_ = as_double(get("backoff_factor"));
  growth_interval_ = get("growth_interval").toInt();
  init_growth_tracker_ = get("_growth_tracker").toInt();
  if (growth_tracker_.defined()) growth_tracker_.fill_(init_growth_tracker_);
}

at::Tensor GradScaler::summed_found_inf(const OptimizerState& state) const {
  at::Tensor found;
  for (const auto& [device, f] : state.found_inf_per_device) {
    at::Tensor here = moved_for_use(f, scale_.device());
    found = found.defined() ? found + here : here;
  }
  return found;
}

}  // namespace dtrain::amp
