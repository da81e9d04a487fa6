#include "framework/checkpoint/optim_state.h"

#include <ATen/ATen.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "core/error.h"
#include "optim/fused.h"

namespace dtrain::framework {
namespace {

std::vector<at::Tensor> all_params(torch::optim::Optimizer& opt) {
  std::vector<at::Tensor> out;
  for (auto& g : opt.param_groups()) {
    for (auto& p : g.params()) out.push_back(p);
  }
  return out;
}

}  // namespace

std::vector<at::Tensor> optimizer_parameters(torch::optim::Optimizer& opt) {
  return all_params(opt);
}

std::vector<ParamState> export_optimizer_state(torch::optim::Optimizer& opt) {
  std::vector<ParamState> out;
  for (const auto& p : all_params(opt)) {
    ParamState s;
    auto it = opt.state().find(p.unsafeGetTensorImpl());
    if (it != opt.state().end()) {
      if (auto* a = dynamic_cast<torch::optim::AdamWParamState*>(it->second.get())) {
        // dtrain's fused AdamW counts on the device; a plain state holds the count itself.
        auto* counted = dynamic_cast<optim::AdamWState*>(a);
        s["step"] = counted != nullptr
                        ? counted->step_count().to(at::kCPU, at::kFloat, false, /*copy=*/true)
                        : at::scalar_tensor(static_cast<double>(a->step()), at::kFloat);
        s["exp_avg"] = a->exp_avg();
        s["exp_avg_sq"] = a->exp_avg_sq();
        if (a->max_exp_avg_sq().defined()) s["max_exp_avg_sq"] = a->max_exp_avg_sq();
      } else if (auto* m = dynamic_cast<torch::optim::SGDParamState*>(it->second.get())) {
        if (m->momentum_buffer().defined()) s["momentum_buffer"] = m->momentum_buffer();
      } else {
        DTRAIN_FAIL(CheckpointError,
                    "checkpoint: the optimizer's state is of a kind dtrain cannot save (AdamW and "
                    "SGD are supported)");
      }
    }
    out.push_back(std::move(s));
  }
  return out;
}

void import_optimizer_state(torch::optim::Optimizer& opt, const std::vector<ParamState>& states) {
  const std::vector<at::Tensor> params = all_params(opt);
  DTRAIN_CHECK_AS(CheckpointError, states.size() == params.size(),
                  "checkpoint: the optimizer state holds ", states.size(),
                  " parameters but the optimizer has ", params.size());
  const bool adamw = dynamic_cast<torch::optim::AdamW*>(&opt) != nullptr;
  const bool sgd = dynamic_cast<torch::optim::SGD*>(&opt) != nullptr;
  DTRAIN_CHECK_AS(CheckpointError, adamw || sgd,
                  "checkpoint: dtrain restores AdamW and SGD state only");
  // Check everything before changing anything.
  for (size_t i = 0; i < params.size(); ++i) {
    for (const auto& [key, t] : states[i]) {
      if (key == "step") continue;
      DTRAIN_CHECK_AS(CheckpointError, t.sizes() == params[i].sizes(),
                      "checkpoint: optimizer state '", key, "' of parameter #", i, " has shape ",
                      t.sizes(), " but the parameter has ", params[i].sizes());
    }
    if (!states[i].empty()) {
      const char* need = adamw ? "exp_avg" : "momentum_buffer";
      DTRAIN_CHECK_AS(CheckpointError, !sgd || states[i].count(need) || states[i].empty(),
                      "checkpoint: parameter #", i, " lacks optimizer state '", need, "'");
      DTRAIN_CHECK_AS(CheckpointError,
                      !adamw || (states[i].count("exp_avg") && states[i].count("exp_avg_sq") &&
                                 states[i].count("step")),
                      "checkpoint: parameter #", i,
                      " lacks AdamW state (step, exp_avg, exp_avg_sq): was it saved from "
                      "another optimizer?");
    }
  }
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    void* key = params[i].unsafeGetTensorImpl();
    opt.state().erase(key);
    const ParamState& s = states[i];
    if (s.empty()) continue;
    auto on = [&](const at::Tensor& t) { return t.to(params[i].options()).clone(); };
    if (adamw) {
      auto st = std::make_unique<torch::optim::AdamWParamState>();
      st->step(static_cast<int64_t>(s.at("step").item<double>()));
      st->exp_avg(on(s.at("exp_avg")));
      st->exp_avg_sq(on(s.at("exp_avg_sq")));
      if (s.count("max_exp_avg_sq")) st->max_exp_avg_sq(on(s.at("max_exp_avg_sq")));
      opt.state()[key] = std::move(st);
    } else if (s.count("momentum_buffer")) {
      auto st = std::make_unique<torch::optim::SGDParamState>();
      st->momentum_buffer(on(s.at("momentum_buffer")));
      opt.state()[key] = std::move(st);
    }
  }
}

c10::IValue optimizer_param_groups(torch::optim::Optimizer& opt,
                                   const std::vector<std::string>& names) {
  c10::impl::GenericList groups(c10::AnyType::get());
  int64_t index = 0;
  for (auto& g : opt.param_groups()) {
    c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
    if (auto* a = dynamic_cast<torch::optim::AdamWOptions*>(&g.options())) {
      d.insert("lr", a->lr());
      d.insert("betas",
               c10::ivalue::Tuple::create({std::get<0>(a->betas()), std::get<1>(a->betas())}));
      d.insert("eps", a->eps());
      d.insert("weight_decay", a->weight_decay());
      d.insert("amsgrad", a->amsgrad());
    } else if (auto* s = dynamic_cast<torch::optim::SGDOptions*>(&g.options())) {
      d.insert("lr", s->lr());
      d.insert("momentum", s->momentum());
      d.insert("dampening", s->dampening());
      d.insert("weight_decay", s->weight_decay());
      d.insert("nesterov", s->nesterov());
    }
    c10::impl::GenericList ids(c10::AnyType::get());
    c10::impl::GenericList group_names(c10::AnyType::get());
    for (size_t k = 0; k < g.params().size(); ++k) {
      if (!names.empty()) group_names.push_back(names.at(static_cast<size_t>(index)));
      ids.push_back(index++);
    }
    d.insert("params", ids);
    if (!names.empty()) d.insert("param_names", group_names);
    groups.push_back(d);
  }
  return groups;
}

}  // namespace dtrain::framework
