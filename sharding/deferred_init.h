// Deferred initialization: a model built without allocating its parameters, so that no rank
// ever holds the whole model (PyTorch builds on the meta device for this, then FSDP2's
// fully_shard plus to_empty and init_weights; FSDP1 took a param_init_fn).
//
// LibTorch has no default-device mode, and a module's tensors cannot be re-pointed from the
// meta device to real memory (set_data refuses across those tensor types), so dtrain defers
// differently: a deferred module's parameters are *placeholders*, tensors of their full shape,
// dtype and device over one element of storage (a scalar expanded, stride 0). They keep their
// identity, names and requires_grad, which is all the wrappers need to plan the units.
// Then:
//   - FullyShardedDataParallel given FSDPOptions::param_init fills each unit's parameters
//     straight into the unit's fp32 buffer, one unit at a time, keeps this rank's shards and
//     frees the rest: the peak is one unit plus the shards;
//   - anything else calls materialize(module, init) first (full tensors, then init).
// The initializer is called once per parameter with the module's own name for it and a full,
// contiguous fp32 tensor to fill in place (under NoGradGuard). For the result not to depend
// on the order units are built in, an initializer should draw each parameter from a
// generator of its own (TransformerLM seeds one per parameter name); the eager constructor
// then calls the same initializer, and both ways give the same bits.
//
// A placeholder reaching real computation is refused where dtrain can see it (FSDP without
// param_init, DDP): it would silently read one repeated value.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <functional>
#include <string>

namespace dtrain::sharding {

// Fills `full` (fp32, full shape, contiguous) with the initial value of parameter `name`.
using ParamInit = std::function<void(const std::string& name, at::Tensor& full)>;

// A placeholder of `like`'s shape and dtype on `device`: one element of storage.
at::Tensor placeholder(const at::Tensor& like, c10::Device device);
// Whether `t` is a placeholder: more elements than its storage holds.
bool is_placeholder(const at::Tensor& t);
// Makes every parameter of `module` (recursively) a placeholder on `device`, freeing its
// memory; requires_grad and the tensors' identities are kept.
void defer_parameters(torch::nn::Module& module, c10::Device device);
// Gives every placeholder parameter of `module` real memory (fp32 on its device is filled by
// `init`, then cast to the placeholder's dtype), in the module's parameter order.
void materialize(torch::nn::Module& module, const ParamInit& init);
// Initializers whose values do not depend on the order they run in:
//   draw_init_seed()             one draw from the default CPU generator, made when the model
//                                is built (so at::manual_seed decides it);
//   parameter_generator(s, name) a CPU generator of the parameter's own, seeded by splitmix64
//                                of `s` and the FNV-1a hash of its name;
//   normal_from(t, std, gen)     t := N(0, std) drawn in fp32 on the CPU, whatever t's device
//                                and dtype, so every device and dtype starts alike.
uint64_t draw_init_seed();
at::Generator parameter_generator(uint64_t seed, const std::string& name);
void normal_from(at::Tensor& t, double std, at::Generator gen);

// Throws UsageError naming the first placeholder parameter of `params`, for `who` ("DDP").
void check_no_placeholders(const std::vector<std::pair<std::string, at::Tensor>>& params,
                           const std::string& who);

}  // namespace dtrain::sharding
