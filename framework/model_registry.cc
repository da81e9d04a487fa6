#include "framework/model_registry.h"

#include <algorithm>
#include <map>
#include <mutex>

#include "core/error.h"

namespace dtrain::framework {
namespace {

struct Registry {
  std::mutex mu;
  std::map<std::string, ModelSpec> specs;
};

Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace

void register_model(ModelSpec spec) {
  DTRAIN_CHECK_AS(UsageError, !spec.name.empty() && spec.name != kCustomModel,
                  "register_model: a model needs a name other than '", kCustomModel,
                  "' (reserved for a module given to framework::train)");
  DTRAIN_CHECK_AS(UsageError, spec.read && spec.memory, "register_model(", spec.name,
                  "): read and memory are required");
  DTRAIN_CHECK_AS(UsageError, spec.data != ModelData::kTokens || spec.tokens, "register_model(",
                  spec.name, "): a token model needs tokens()");
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  const std::string name = spec.name;
  r.specs.insert_or_assign(name, std::move(spec));
}

const ModelSpec* find_model(const std::string& name) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.specs.find(name);
  return it == r.specs.end() ? nullptr : &it->second;
}

const ModelSpec& model_spec(const RunConfig& c) {
  const ModelSpec* s = find_model(c.model.type);
  DTRAIN_CHECK_AS(UsageError, s != nullptr, c.source, ": model.type ", c.model.type,
                  " is not a registered model");
  return *s;
}

std::vector<std::string> registered_models() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<std::string> names;
  for (const auto& [name, spec] : r.specs) names.push_back(name);
  return names;
}

int64_t read_recompute(ConfigSection& s) {
  int64_t every = 0;
  if (s.has_map("recompute")) {
    ConfigSection r = s.section("recompute");
    r.read("every_n", every);
    r.finish();  // a misspelt every_n is named first
    r.check(r.has("every_n"), "every_n", "required key is missing ({every_n: K})");
    r.check(every >= 1, "every_n",
            "must be >= 1 (1 recomputes every block), got " + std::to_string(every));
    return every;
  }
  std::string recompute = "none";
  s.read("recompute", recompute);
  s.check(recompute == "none" || recompute == "full", "recompute",
          "expected none, full or {every_n: K}, got '" + recompute + "'");
  return recompute == "full" ? 1 : 0;
}

double compute_bytes(const RunConfig& c) {
  const c10::ScalarType t = c.precision.mixed.param_dtype;
  return t == c10::kFloat ? 4 : t == c10::kDouble ? 8 : 2;
}

double micro_batch_samples(const RunConfig& c) {
  return static_cast<double>(c.train.batch_size / c.train.micro_batches);
}

}  // namespace dtrain::framework
