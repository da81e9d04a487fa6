// The built-in models' configurations: their options (what the modules are built from), the
// settings their `model:` sections are read into, and their registrations without the
// builders (framework/model_registry.h). This half needs no module code, so the config, the
// memory estimate and the config fuzzer (fuzz/) use it alone; framework/models/builtin.h adds
// the builders from the model files.
#pragma once

#include <torch/arg.h>

#include <cstdint>
#include <string>

#include "framework/config.h"
#include "framework/model_registry.h"
#include "framework/models/attention.h"

namespace dtrain::framework {

// --- transformer (framework/models/transformer_lm.h) ---------------------------------------

struct TransformerLMOptions {
  TORCH_ARG(int64_t, vocab_size) = 256;
  TORCH_ARG(int64_t, seq_len) = 128;
  TORCH_ARG(int64_t, d_model) = 256;
  TORCH_ARG(int64_t, n_layers) = 4;
  TORCH_ARG(int64_t, n_heads) = 4;
  TORCH_ARG(int64_t, d_ff) = 1024;
  TORCH_ARG(bool, tie_weights) = true;
  // Activation recompute (sharding/recompute.h) of block i when i % recompute_every == 0:
  // 0 none, 1 every block ("full"), K every K-th.
  TORCH_ARG(int64_t, recompute_every) = 0;
  // Parameters are placeholders (no memory) until param_init() fills them: under FSDP
  // (FSDPOptions::param_init) one unit at a time, otherwise with sharding::materialize.
  TORCH_ARG(bool, deferred_init) = false;
  // Which kernel the attention runs (framework/models/attention.h): auto follows the rule.
  TORCH_ARG(AttentionSetting, attention) = AttentionSetting::kAuto;
};

// Parameters of a TransformerLM with these options (for sizing configs and benchmarks).
int64_t transformer_lm_parameter_count(const TransformerLMOptions& o);

// model.type: transformer (framework/model_registry.h): its keys, as configs/README.md lists
// them, and its registration.
struct TransformerLMSettings : ModelSettingsOf<TransformerLMSettings> {
  int64_t vocab_size = 256;
  int64_t seq_len = 128;
  int64_t d_model = 256;
  int64_t n_layers = 4;
  int64_t n_heads = 4;
  int64_t d_ff = 1024;
  bool tie_weights = true;
  int64_t recompute_every = 0;  // model.recompute: 0 none, 1 full, K {every_n: K}
  // model.deferred_init: under FSDP the model is built with placeholder parameters and each
  // unit is initialized as it is sharded, so no rank holds the whole model; false builds it
  // whole first. The same initial values either way.
  bool deferred_init = true;
  AttentionSetting attention = AttentionSetting::kAuto;  // model.attention
  TransformerLMOptions options() const;
};
ModelSpec transformer_lm_config();

// --- mlp (framework/models/mlp.h) ------------------------------------------------------------

struct MLPOptions {
  TORCH_ARG(int64_t, in_features) = 64;
  TORCH_ARG(int64_t, hidden) = 256;
  TORCH_ARG(int64_t, depth) = 3;
  TORCH_ARG(int64_t, out_features) = 10;
};

// model.type: mlp (framework/model_registry.h): a classifier of synthetic data (the
// in_features-wide inputs of out_features classes, framework/data.h), for tests and benchmarks.
struct MLPSettings : ModelSettingsOf<MLPSettings> {
  int64_t in_features = 64;
  int64_t hidden = 256;
  int64_t depth = 3;
  int64_t out_features = 10;
  MLPOptions options() const;
};
ModelSpec mlp_config();

// --- llama (framework/models/llama.h) --------------------------------------------------------

struct LlamaOptions {
  TORCH_ARG(int64_t, vocab_size) = 32000;
  TORCH_ARG(int64_t, hidden_size) = 4096;
  TORCH_ARG(int64_t, intermediate_size) = 11008;
  TORCH_ARG(int64_t, num_hidden_layers) = 32;
  TORCH_ARG(int64_t, num_attention_heads) = 32;
  TORCH_ARG(int64_t, num_key_value_heads) = 32;
  TORCH_ARG(int64_t, head_dim) = 0;  // 0: hidden_size / num_attention_heads
  TORCH_ARG(int64_t, max_position_embeddings) = 2048;
  TORCH_ARG(double, rms_norm_eps) = 1e-6;
  TORCH_ARG(double, rope_theta) = 10000.0;
  TORCH_ARG(bool, tie_word_embeddings) = false;
  // Llama's initializer_range: weights N(0, 0.02), RMSNorms at one.
  TORCH_ARG(double, initializer_range) = 0.02;
  // Placeholder parameters until param_init() fills them (sharding/deferred_init.h): under
  // FSDP one unit at a time (FSDPOptions::param_init), otherwise sharding::materialize.
  TORCH_ARG(bool, deferred_init) = false;
  // Activation recompute (sharding/recompute.h) of decoder layer i when i % recompute_every
  // == 0 (model.recompute): 0 none, 1 every layer.
  TORCH_ARG(int64_t, recompute_every) = 0;

 public:
  int64_t head_size() const {
    return head_dim_ > 0 ? head_dim_ : hidden_size_ / num_attention_heads_;
  }
};

int64_t llama_parameter_count(const LlamaOptions& o);
// A Hugging Face config.json as options (ConfigError naming the file and key; only the
// default RoPE).
LlamaOptions read_hf_llama_config(const std::string& config_json);

// model.type: llama (framework/model_registry.h). The shape keys are LlamaConfig's names
// (hidden_size, num_hidden_layers, ...), with its defaults; or `pretrained: DIR`, a Hugging
// Face checkpoint whose config.json gives the shape and whose weights are the initial values
// (loaded one layer at a time under FSDP), and then no shape key may be given. seq_len is the
// training context (<= max_position_embeddings).
struct LlamaSettings : ModelSettingsOf<LlamaSettings> {
  LlamaOptions options;
  int64_t seq_len = 128;
  std::string pretrained;  // a Hugging Face checkpoint directory; empty: initialized
  // Where the end of the run writes the trained model as a Hugging Face checkpoint; empty: not.
  std::string save_pretrained;
};
ModelSpec llama_config();

// Registers the three without builders: enough to read and estimate configs, not to train.
void register_builtin_model_configs();

}  // namespace dtrain::framework
