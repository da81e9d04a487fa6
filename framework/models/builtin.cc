#include "framework/models/builtin.h"

#include <mutex>
#include <utility>

#include "framework/model_registry.h"
#include "framework/models/configs.h"
#include "framework/models/llama.h"
#include "framework/models/mlp.h"
#include "framework/models/transformer_lm.h"

namespace dtrain::framework {
namespace {

ModelSpec with_build(ModelSpec spec, std::function<void(const BuildContext&, BuiltModel&)> build) {
  spec.build = std::move(build);
  return spec;
}

}  // namespace

void register_builtin_models() {
  static std::once_flag once;
  std::call_once(once, [] {
    register_model(with_build(transformer_lm_config(), build_transformer_lm));
    register_model(with_build(mlp_config(), build_mlp));
    register_model(with_build(llama_config(), build_llama));
  });
}

}  // namespace dtrain::framework
