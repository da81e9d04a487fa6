// The models dtrain-train knows by name (model.type): transformer, mlp and llama, each its
// configuration (framework/models/configs.h) with its module's builder. A new built-in model
// adds its registration here.
#pragma once

namespace dtrain::framework {

// Registers the built-in models; calling it again does nothing more.
void register_builtin_models();

}  // namespace dtrain::framework
