// An optimizer's per-parameter state as named tensors, for checkpoints: in, out, and in
// PyTorch's layout (`optimizer.state_dict()`), whatever optimizer holds it.
//
// Names are PyTorch's: AdamW "step" (a 0-d fp32 tensor, as Python keeps it), "exp_avg",
// "exp_avg_sq" (and "max_exp_avg_sq" with amsgrad); SGD "momentum_buffer". Parameters are
// in the optimizer's order (param groups in turn), which is the order the trainer gave them:
// the module's for DDP, FSDP's named_parameters() for FSDP.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <map>
#include <string>
#include <vector>

namespace torch::optim {
class Optimizer;
}

namespace dtrain::framework {

using ParamState = std::map<std::string, at::Tensor>;  // empty: no state yet

// Per parameter, in the optimizer's order.
std::vector<ParamState> export_optimizer_state(torch::optim::Optimizer& opt);
// Replaces the optimizer's state; `states` in the same order and shapes (CheckpointError
// naming the parameter index and key otherwise, before anything is changed).
void import_optimizer_state(torch::optim::Optimizer& opt, const std::vector<ParamState>& states);
// The optimizer's parameters, param groups in turn (the order of the functions above).
std::vector<at::Tensor> optimizer_parameters(torch::optim::Optimizer& opt);
// PyTorch's "param_groups": per group its hyperparameters, the parameters' indices and, when
// `names` (one per parameter, in the optimizer's order) is given, their "param_names" (as
// PyTorch's optimizers built from named parameters save them).
c10::IValue optimizer_param_groups(torch::optim::Optimizer& opt,
                                   const std::vector<std::string>& names = {});

}  // namespace dtrain::framework
