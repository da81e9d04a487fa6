// The model registry: what dtrain knows of a model, as TorchTitan's TrainSpec. A model is one
// file that fills a ModelSpec, plus one register_model() call; the config (model.type), the
// trainer, the memory estimate and FSDP's auto-wrap then all know it:
//   - read: its config section (`model:` besides `type`), read through a ConfigSection so its
//     errors name the file, key and line like every other section's, and so unknown keys are
//     refused with a "did you mean";
//   - build: the module behind its strategy, its loss, and (data kOwn) its batches;
//   - wrap_points: the module types FSDP's auto-wrap may make units of (parallel.wrap_modules
//     must name one of them);
//   - memory: its parameter count, the sizes FSDP gathers, and its activations per micro-batch,
//     for the estimate that refuses a run that cannot fit (framework/memory_estimate.h);
//   - data: what it trains on: language-model tokens (synthetic, a text corpus's bytes, token
//     files; the trainer makes the source from tokens()) or batches of its own.
//
// The built-in models (transformer, mlp, llama; framework/models/builtin.h) are registered by
// register_builtin_models(), which dtrain-train and framework::train(config, comm) call; their
// configuration halves (framework/models/configs.h) need no module code. A
// program registers its own before load_config (examples/own_data_trainer). "custom" is
// reserved: a module handed to framework::train(module, data, loss, config, comm).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "framework/config.h"
#include "framework/config_section.h"

namespace dtrain::framework {

struct BuildContext;  // framework/trainer.h
struct BuiltModel;

// What the model trains on.
enum class ModelData {
  kTokens,  // next-token prediction: data.source synthetic, corpus or tokens
  kOwn,     // batches its build makes (data.source must stay synthetic, the default)
};

// A token model's vocabulary and context, which the token sources are made for.
struct TokenShape {
  int64_t vocab_size = 0;
  int64_t seq_len = 0;
  // A checkpoint the model starts from, which fixes the vocabulary (and the tokenizer the
  // tokens must come from); empty: none.
  std::string pretrained;
};

// The model's side of the memory estimate, for one config.
struct ModelMemory {
  int64_t parameters = 0;
  // Parameters of its largest wrap point and of what stays in the root (FSDP gathers
  // limit_all_gathers of the first and all of the second).
  double largest_unit = 0, root = 0;
  // Bytes saved for backward by one micro-batch, in the config's compute dtype and recompute.
  double activations = 0;
  // The same with recompute turned the other way (none <-> full), when the model has it.
  std::optional<double> activations_other_recompute;
  // What else the activations depend on, for --estimate ("attention: the explicit softmax").
  std::string activations_note;
  // Whether FSDP builds it deferred (placeholders, one unit initialized at a time).
  bool deferred_under_fsdp = false;
  // Pipeline stages (ModelSpec::pipeline_layers): the parameters before the first layer (the
  // embedding, on the first stage; the rest of `root` is after the last layer, on the last),
  // and the part of `activations` the head makes (the logits and the loss, on the last stage;
  // the rest is the layers', alike).
  double embedding = 0;
  double head_activations = 0;
};

struct ModelSpec {
  std::string name;     // model.type
  std::string summary;  // one line: what it is
  ModelData data = ModelData::kTokens;
  // model's keys besides type; the registry calls finish() after it.
  std::function<std::unique_ptr<ModelSettings>(ConfigSection& model)> read;
  // kTokens: the shape the token data is made for, and (for model.vocab_size: auto) how the
  // config sets the vocabulary it found in the tokens' meta.json.
  std::function<TokenShape(const ModelSettings&)> tokens;
  std::function<void(ModelSettings&, int64_t vocab_size)> set_vocab_size;
  // Module type names FSDP's auto-wrap may choose ("Block"); empty: no wrap points.
  std::vector<std::string> wrap_points;
  std::function<ModelMemory(const RunConfig&)> memory;
  // The key that sets its depth ("n_layers"), and a setter for the estimate's "deepest model
  // that fits" search; empty/null when it has none.
  std::string depth_key;
  std::function<void(ModelSettings&, int64_t)> set_depth;
  // The model behind its strategy (and kOwn: its data) for this rank.
  std::function<void(const BuildContext&, BuiltModel&)> build;
  // Why the model cannot be cut over `tp` tensor-parallel ranks (naming the model's keys), or
  // an empty string; null: the model has no tensor-parallel plan (parallel.tp must be 1).
  std::function<std::string(const ModelSettings&, int64_t tp)> tp_problem;
  // Pipeline parallelism (parallel.pp > 1): the layers its stages split (null: the model
  // cannot be pipelined), and why this configuration of it cannot be (naming the model's
  // keys), or an empty string.
  std::function<int64_t(const ModelSettings&)> pipeline_layers;
  std::function<std::string(const ModelSettings&)> pp_problem;
};

// Adds `spec`; a second registration of the same name replaces the first (UsageError when
// the spec lacks read or memory, or names itself "custom"). A spec without build can be read
// and estimated but not trained (the config fuzzer registers the built-ins so).
void register_model(ModelSpec spec);
// The spec registered as `name`, or null.
const ModelSpec* find_model(const std::string& name);
// The spec of this config's model (UsageError when unregistered: a config is parsed first).
const ModelSpec& model_spec(const RunConfig& c);
std::vector<std::string> registered_models();

// Helpers for models' readers. model.vocab_size: an integer >= 2, or `auto` (kAutoVocab): the
// tokenizer's, from the meta.json dtrain-prepare writes beside data.path's token files, which
// the config reader puts in through spec.set_vocab_size once the data section is read.
inline constexpr int64_t kAutoVocab = 0;
void read_vocab_size(ConfigSection& model, int64_t& out);
// model.recompute: none | full | {every_n: K}, as 0, 1 or K (the
// block i with i % K == 0 recomputes its activations in backward; sharding/recompute.h).
int64_t read_recompute(ConfigSection& model);
// Bytes of one element of the compute dtype (the policy's param_dtype).
double compute_bytes(const RunConfig& c);
// Samples (sequences, items) in one micro-batch.
double micro_batch_samples(const RunConfig& c);

}  // namespace dtrain::framework
