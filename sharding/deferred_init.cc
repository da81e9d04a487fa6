#include "sharding/deferred_init.h"

#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>

#include "core/error.h"

namespace dtrain::sharding {

at::Tensor placeholder(const at::Tensor& like, c10::Device device) {
  return at::empty({}, like.options().device(device)).expand(like.sizes());
}

bool is_placeholder(const at::Tensor& t) {
  return t.defined() && t.numel() > 1 && t.has_storage() &&
         t.storage().nbytes() < static_cast<size_t>(t.numel()) * t.element_size();
}

void defer_parameters(torch::nn::Module& module, c10::Device device) {
  c10::NoGradGuard no_grad;
  for (auto& p : module.parameters(/*recurse=*/true)) {
    p.mutable_grad().reset();
    p.set_data(placeholder(p, device));
  }
}

void materialize(torch::nn::Module& module, const ParamInit& init) {
  DTRAIN_CHECK_AS(UsageError, static_cast<bool>(init), "materialize: no initializer given");
  c10::NoGradGuard no_grad;
  for (auto& item : module.named_parameters(/*recurse=*/true)) {
    at::Tensor& p = item.value();
    if (!is_placeholder(p)) continue;
    at::Tensor full = at::empty(p.sizes(), p.options().dtype(at::kFloat));
    init(item.key(), full);
    p.set_data(p.scalar_type() == at::kFloat ? full : full.to(p.scalar_type()));
  }
}

uint64_t draw_init_seed() {
  return static_cast<uint64_t>(at::empty({}, at::kLong).random_().item<int64_t>());
}

at::Generator parameter_generator(uint64_t seed, const std::string& name) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char c : name) h = (h ^ c) * 1099511628211ull;
  uint64_t z = seed + 0x9e3779b97f4a7c15ull * (h | 1);  // splitmix64's finalizer
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return at::make_generator<at::CPUGeneratorImpl>(z ^ (z >> 31));
}

void normal_from(at::Tensor& t, double std, at::Generator gen) {
  c10::NoGradGuard no_grad;
  if (t.is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous()) {
    t.normal_(0.0, std, gen);
    return;
  }
  at::Tensor draw = at::empty(t.sizes(), at::kFloat);
  draw.normal_(0.0, std, gen);
  t.copy_(draw);
}

void check_no_placeholders(const std::vector<std::pair<std::string, at::Tensor>>& params,
                           const std::string& who) {
  for (const auto& [name, t] : params) {
    DTRAIN_CHECK_AS(UsageError, !is_placeholder(t), who, ": parameter '", name,
                    "' is a placeholder of a model built for deferred initialization (no "
                    "memory behind it); give FSDPOptions::param_init, or call "
                    "sharding::materialize(module, init) before wrapping it");
  }
}

}  // namespace dtrain::sharding
