#include "framework/config.h"

#include <gtest/gtest.h>

#include <dirent.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <tuple>

#include "core/error.h"
#include "framework/hardware.h"
#include "framework/models/configs.h"

namespace dtrain::framework {
namespace {

// model.type's readers: the built-in models' configuration halves.
const bool kRegistered = (register_builtin_model_configs(), true);

const char* kGood = R"(device: cpu
model:
  type: transformer
  d_model: 64
  n_heads: 4
train:
  steps: 10
  batch_size: 8
  lr: 1.0e-3
parallel:
  strategy: ddp
precision:
  policy: bf16
)";

// Expects ConfigError whose message contains every needle.
void expect_config_error(const std::function<void()>& f, const std::vector<std::string>& needles) {
  try {
    f();
    ADD_FAILURE() << "no ConfigError";
  } catch (const ConfigError& e) {
    for (const auto& n : needles) {
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos)
          << "missing '" << n << "' in: " << e.what();
    }
  }
}

void expect_yaml_error(const std::string& yaml, const std::vector<std::string>& needles,
                       const std::vector<std::string>& overrides = {}) {
  expect_config_error([&] { parse_config(yaml, "run.yaml", overrides); }, needles);
}

std::string replace(std::string s, const std::string& from, const std::string& to) {
  auto at = s.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  return s.replace(at, from.size(), to);
}

// kGood with model.type: mlp (whose section has none of the transformer's keys).
std::string mlp_good() {
  return replace(kGood, "  type: transformer\n  d_model: 64\n  n_heads: 4\n", "  type: mlp\n");
}

TEST(Config, ParsesAValidConfigWithDefaults) {
  RunConfig c = parse_config(kGood, "run.yaml");
  EXPECT_EQ(c.model.type, "transformer");
  EXPECT_EQ(c.model.as<TransformerLMSettings>().d_model, 64);
  EXPECT_EQ(c.train.steps, 10);
  EXPECT_EQ(c.train.micro_batches, 1);
  EXPECT_DOUBLE_EQ(c.train.lr, 1e-3);
  EXPECT_EQ(c.parallel.bucket_cap_mb, 25.0);
  EXPECT_EQ(c.precision.mixed.param_dtype, c10::kBFloat16);
  EXPECT_EQ(c.precision.mixed.effective_reduce_dtype(), c10::kBFloat16);
  EXPECT_FALSE(c.precision.scaler.enabled);
}

TEST(Config, ExplicitDtypesOverrideThePreset) {
  RunConfig c = parse_config(replace(kGood, "policy: bf16", "policy: bf16\n  reduce_dtype: fp32"),
                             "run.yaml");
  EXPECT_EQ(c.precision.mixed.param_dtype, c10::kBFloat16);
  EXPECT_EQ(c.precision.mixed.effective_reduce_dtype(), c10::kFloat);
}

TEST(Config, OverridesApplyAndCreateKeys) {
  RunConfig c = parse_config(kGood, "run.yaml",
                             {"train.lr=0.5", "train.micro_batches=2", "logging.level=debug",
                              "precision.scaler.growth_interval=7"});
  EXPECT_DOUBLE_EQ(c.train.lr, 0.5);
  EXPECT_EQ(c.train.micro_batches, 2);
  EXPECT_EQ(c.logging.level, logging::Level::kDebug);
  EXPECT_EQ(c.precision.scaler.growth_interval, 7);
}

TEST(Config, RecomputeIsNoneFullOrEveryNthBlock) {
  EXPECT_EQ(parse_config(kGood, "run.yaml").model.as<TransformerLMSettings>().recompute_every, 0);
  EXPECT_EQ(parse_config(kGood, "run.yaml", {"model.recompute=full"})
                .model.as<TransformerLMSettings>()
                .recompute_every,
            1);
  EXPECT_EQ(parse_config(kGood, "run.yaml", {"model.recompute=none"})
                .model.as<TransformerLMSettings>()
                .recompute_every,
            0);
  EXPECT_EQ(parse_config(kGood, "run.yaml", {"model.recompute={every_n: 3}"})
                .model.as<TransformerLMSettings>()
                .recompute_every,
            3);
  expect_yaml_error(kGood, {"model.recompute", "expected none, full or {every_n: K}, got 'yes'"},
                    {"model.recompute=yes"});
  expect_yaml_error(kGood, {"model.recompute.every_n", "must be >= 1"},
                    {"model.recompute={every_n: 0}"});
  expect_yaml_error(kGood, {"model.recompute.evry_n", "did you mean 'every_n'?"},
                    {"model.recompute={evry_n: 2}"});
  expect_yaml_error(mlp_good(),
                    {"model.recompute", "unknown key", "keys under model: type, in_features"},
                    {"model.recompute=full"});
}

TEST(Config, DeferredInitIsTheTransformersDefaultAndOnlyTheTransformers) {
  EXPECT_TRUE(parse_config(kGood, "run.yaml").model.as<TransformerLMSettings>().deferred_init);
  EXPECT_FALSE(parse_config(kGood, "run.yaml", {"model.deferred_init=false"})
                   .model.as<TransformerLMSettings>()
                   .deferred_init);
  expect_yaml_error(mlp_good(), {"model.deferred_init", "unknown key"},
                    {"model.deferred_init=true"});
}

// The model section belongs to the registered model model.type names.
TEST(ModelRegistry, UnknownTypesAreNamedWithTheRegisteredOnes) {
  expect_yaml_error(replace(kGood, "type: transformer", "type: transfomer"),
                    {"run.yaml:3:", "model.type", "unknown model 'transfomer'",
                     "did you mean 'transformer'?", "llama", "mlp", "custom"});
  // A key of another model: the known ones are listed.
  expect_yaml_error(kGood, {"model.hidden_size", "unknown key", "d_model"},
                    {"model.hidden_size=64"});
}

struct ToySettings : ModelSettingsOf<ToySettings> {
  int64_t width = 0;
};

TEST(ModelRegistry, ARegisteredModelReadsItsOwnKeysStrictly) {
  ModelSpec toy;
  toy.name = "toy_for_config_test";
  toy.data = ModelData::kOwn;
  toy.read = [](ConfigSection& s) {
    auto m = std::make_unique<ToySettings>();
    s.read("width", m->width, /*required=*/true);
    s.check(m->width >= 1, "width", "must be >= 1");
    return m;
  };
  toy.memory = [](const RunConfig& c) {
    ModelMemory m;
    m.parameters = c.model.as<ToySettings>().width;
    return m;
  };
  toy.wrap_points = {"ToyLayer"};
  register_model(toy);
  const std::string yaml = replace(kGood, "  type: transformer\n  d_model: 64\n  n_heads: 4\n",
                                   "  type: toy_for_config_test\n  width: 3\n");
  RunConfig c = parse_config(yaml, "run.yaml");
  EXPECT_EQ(c.model.as<ToySettings>().width, 3);
  // A copied config owns its settings.
  RunConfig copy = c;
  copy.model.as<ToySettings>().width = 9;
  EXPECT_EQ(c.model.as<ToySettings>().width, 3);
  EXPECT_THROW(c.model.as<TransformerLMSettings>(), Error);
  expect_yaml_error(replace(yaml, "width: 3", "width: 3\n  widht: 4"),
                    {"run.yaml:5:", "model.widht", "unknown key", "did you mean 'width'?"});
  expect_yaml_error(yaml, {"model.width", "must be >= 1"}, {"model.width=0"});
  expect_yaml_error(replace(yaml, "  width: 3\n", ""), {"model.width", "required key is missing"});
  // Its wrap points are the ones parallel.wrap_modules may name.
  EXPECT_NO_THROW(parse_config(yaml, "run.yaml",
                               {"parallel.strategy=fsdp", "parallel.wrap_modules=[ToyLayer]"}));
  expect_yaml_error(yaml, {"parallel.wrap_modules", "'Block' is not a wrap point", "ToyLayer"},
                    {"parallel.strategy=fsdp", "parallel.wrap_modules=[Block]"});
  ModelSpec nameless = toy;
  nameless.name = "custom";
  EXPECT_THROW(register_model(nameless), UsageError);
}

TEST(ModelRegistry, LlamaReadsLlamaConfigsNamesOrAPretrainedCheckpoint) {
  const std::string llama = replace(kGood, "  type: transformer\n  d_model: 64\n  n_heads: 4\n",
                                    "  type: llama\n  vocab_size: 512\n  hidden_size: 64\n"
                                    "  intermediate_size: 160\n  num_hidden_layers: 2\n"
                                    "  num_attention_heads: 4\n  num_key_value_heads: 2\n"
                                    "  seq_len: 32\n");
  RunConfig c = parse_config(llama, "run.yaml");
  const auto& l = c.model.as<LlamaSettings>();
  EXPECT_EQ(l.options.hidden_size(), 64);
  EXPECT_EQ(l.options.num_key_value_heads(), 2);
  EXPECT_EQ(l.seq_len, 32);
  EXPECT_TRUE(l.options.deferred_init());
  // Without num_key_value_heads: one per head, as LlamaConfig.
  EXPECT_EQ(parse_config(replace(llama, "  num_key_value_heads: 2\n", ""), "run.yaml")
                .model.as<LlamaSettings>()
                .options.num_key_value_heads(),
            4);
  expect_yaml_error(llama, {"--set model.num_key_value_heads=3", "must divide"},
                    {"model.num_key_value_heads=3"});
  expect_yaml_error(llama, {"model.seq_len", "max_position_embeddings 16"},
                    {"model.max_position_embeddings=16"});
  expect_yaml_error(llama, {"model.num_layers", "unknown key"}, {"model.num_layers=2"});
  EXPECT_EQ(parse_config(llama, "run.yaml", {"model.recompute=full"})
                .model.as<LlamaSettings>()
                .options.recompute_every(),
            1);
  expect_yaml_error(llama, {"model.recompute", "expected none, full"}, {"model.recompute=some"});
  // A pretrained checkpoint gives the shape: shape keys beside it are refused.
  const std::string dir = ::testing::TempDir() + "/llama_config_test";
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/config.json")
      << R"({"model_type": "llama", "vocab_size": 300, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
            "num_key_value_heads": 1, "max_position_embeddings": 64})";
  const std::string pretrained =
      replace(kGood, "  type: transformer\n  d_model: 64\n  n_heads: 4\n",
              "  type: llama\n  pretrained: " + dir + "\n  seq_len: 16\n");
  const auto& p = parse_config(pretrained, "run.yaml").model;
  EXPECT_EQ(p.as<LlamaSettings>().options.num_hidden_layers(), 3);
  EXPECT_EQ(p.as<LlamaSettings>().options.vocab_size(), 300);
  expect_yaml_error(pretrained, {"model.hidden_size", "comes from the pretrained checkpoint"},
                    {"model.hidden_size=64"});
  expect_yaml_error(pretrained, {"model.pretrained", "no readable config.json"},
                    {"model.pretrained=" + dir + "/missing"});
  expect_yaml_error(pretrained, {"model.seq_len", "max_position_embeddings 64"},
                    {"model.seq_len=65"});
}

// dtrain-prepare's meta.json beside the token files: the dtype, and model.vocab_size: auto.
TEST(Config, PreparedTokensGiveTheDtypeAndTheVocabulary) {
  const std::string dir = ::testing::TempDir() + "/prepared_tokens";
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/a-0000.bin") << "";
  std::ofstream(dir + "/meta.json")
      << R"({"written_by": "dtrain-prepare", "tokenizer": "sentencepiece", "vocab_size": 3000,
            "dtype": "uint16", "tokens": 0, "shards": []})";
  const std::vector<std::string> data = {"data.path=" + dir + "/*.bin"};
  RunConfig c = parse_config(replace(kGood, "  d_model: 64", "  d_model: 64\n  vocab_size: auto"),
                             "run.yaml", data);
  EXPECT_EQ(c.model.as<TransformerLMSettings>().vocab_size, 3000);
  EXPECT_EQ(c.data.dtype, "uint16");
  EXPECT_EQ(c.data.tokenizer_vocab_size, 3000);
  // Too small a vocabulary, or another dtype: refused, naming meta.json and the fix.
  expect_yaml_error(kGood, {"model.vocab_size", "meta.json", "set model.vocab_size: 3000"}, data);
  std::vector<std::string> wrong_dtype = data;
  wrong_dtype.push_back("data.dtype=uint32");
  expect_yaml_error(kGood, {"data.dtype", "meta.json", "remove data.dtype"}, wrong_dtype);
  // auto without meta.json.
  expect_yaml_error(replace(kGood, "  d_model: 64", "  d_model: 64\n  vocab_size: auto"),
                    {"run.yaml:5:", "model.vocab_size", "auto", "give a number"});
  expect_yaml_error(kGood, {"model.vocab_size", "must be >= 2, or auto"}, {"model.vocab_size=1"});
}

TEST(Config, SampleTokensCountsTheEndOfRunSample) {
  EXPECT_EQ(parse_config(kGood, "run.yaml").logging.sample_tokens, 48);
  EXPECT_EQ(parse_config(kGood, "run.yaml", {"logging.sample_tokens=0"}).logging.sample_tokens, 0);
  expect_yaml_error(kGood, {"logging.sample_tokens", "must be >= 0"}, {"logging.sample_tokens=-1"});
}

TEST(Config, TokenFilesAreADataSourceWithTheirOwnChecks) {
  const char* base = std::getenv("TEST_TMPDIR");
  const std::string dir = std::string(base ? base : "/tmp") + "/config_tokens";
  std::system(("mkdir -p " + dir + " && : > " + dir + "/a.bin && : > " + dir + "/b.npy").c_str());
  // A .bin or .npy path selects token files; a glob matches many. A .bin file's token type is
  // never guessed: without dtrain-prepare's meta.json, data.dtype must say it.
  expect_yaml_error(kGood, {"data.path", "whose token type nothing records", "set data.dtype"},
                    {"data.path=" + dir + "/*.bin"});
  RunConfig c =
      parse_config(kGood, "run.yaml", {"data.path=" + dir + "/*.bin", "data.dtype=uint16"});
  EXPECT_EQ(c.data.source, DataSource::kTokens);
  EXPECT_EQ(c.data.dtype, "uint16");
  c = parse_config(kGood, "run.yaml", {"data.path=" + dir + "/b.npy"});  // .npy says its own
  EXPECT_EQ(c.data.source, DataSource::kTokens);
  c = parse_config(kGood, "run.yaml",
                   {"data.source=tokens", "data.path=" + dir + "/a.bin", "data.dtype=uint32",
                    "data.val_path=" + dir + "/b.npy"});
  EXPECT_EQ(c.data.dtype, "uint32");
  EXPECT_EQ(c.data.val_path, dir + "/b.npy");
  c = parse_config(kGood, "run.yaml",
                   {"data.path=" + dir + "/a.bin", "data.dtype=uint16", "data.val_fraction=0.05"});
  EXPECT_EQ(c.data.val_fraction, 0.05);
  expect_yaml_error(kGood, {"data.val_fraction", "must be in [0, 1)"},
                    {"data.path=" + dir + "/a.bin", "data.val_fraction=1"});
  expect_yaml_error(
      kGood, {"data.val_fraction", "data.val_path both name the validation split"},
      {"data.path=" + dir + "/a.bin", "data.val_fraction=0.1", "data.val_path=" + dir + "/b.npy"});
  expect_yaml_error(kGood, {"data.val_fraction", "applies to data.source: tokens, not corpus"},
                    {"data.source=corpus", "data.val_fraction=0.1"});
  expect_yaml_error(kGood, {"data.path", "'" + dir + "/none*.bin' matches no file"},
                    {"data.path=" + dir + "/none*.bin"});
  expect_yaml_error(kGood, {"data.dtype", "expected uint16 or uint32", "got 'int8'"},
                    {"data.path=" + dir + "/a.bin", "data.dtype=int8"});
  expect_yaml_error(kGood, {"data.dtype", "applies to data.source: tokens, not corpus"},
                    {"data.source=corpus", "data.dtype=uint32"});
  expect_yaml_error(kGood, {"data.path", "is a token file", "use data.source: tokens"},
                    {"data.source=corpus", "data.path=" + dir + "/a.bin"});
  expect_yaml_error(kGood, {"data.path", "is required with data.source: tokens"},
                    {"data.source=tokens"});
  expect_yaml_error(mlp_good(), {"data.source", "model.type: mlp"},
                    {"data.path=" + dir + "/a.bin", "data.dtype=uint16"});
}

TEST(ConfigError, UnknownKeyNamesPathLineAndSuggestion) {
  expect_yaml_error(replace(kGood, "  lr: 1.0e-3", "  lr: 1.0e-3\n  learnin_rate: 2"),
                    {"run.yaml:10:", "train.learnin_rate", "unknown key", "keys under train"});
  expect_yaml_error(replace(kGood, "  steps: 10", "  stpes: 10\n  steps: 10"),
                    {"run.yaml:7:", "train.stpes", "did you mean 'steps'?"});
  expect_yaml_error(std::string(kGood) + "optimiser: {}\n",
                    {"run.yaml:14:", "optimiser", "keys under the top level"});
}

TEST(ConfigError, WrongTypeNamesPathLineAndValue) {
  expect_yaml_error(replace(kGood, "steps: 10", "steps: ten"),
                    {"run.yaml:7:", "train.steps", "expected an integer, got 'ten'"});
  expect_yaml_error(replace(kGood, "lr: 1.0e-3", "lr: fast"),
                    {"run.yaml:9:", "train.lr", "expected a number"});
  expect_yaml_error(replace(kGood, "strategy: ddp", "strategy: [ddp]"),
                    {"run.yaml:11:", "parallel.strategy", "expected a string"});
  expect_yaml_error(
      replace(kGood, "model:\n  type: transformer\n  d_model: 64\n  n_heads: 4\n", "model: 3\n"),
      {"run.yaml:2:", "model", "expected a mapping"});
}

TEST(ConfigError, MissingRequiredKeyNamesPathAndSectionLine) {
  expect_yaml_error(replace(kGood, "  lr: 1.0e-3\n", ""),
                    {"run.yaml:7:", "train.lr", "required key is missing"});
  expect_yaml_error(replace(kGood, "  type: transformer\n", ""),
                    {"run.yaml:3:", "model.type", "required key is missing"});
}

TEST(ConfigError, OutOfRangeValuesNamePathAndLine) {
  expect_yaml_error(replace(kGood, "lr: 1.0e-3", "lr: -0.1"),
                    {"run.yaml:9:", "train.lr", "must be > 0"});
  expect_yaml_error(replace(kGood, "strategy: ddp", "strategy: ddp\n  bucket_cap_mb: 0"),
                    {"run.yaml:12:", "parallel.bucket_cap_mb", "must be > 0"});
  expect_yaml_error(replace(kGood, "n_heads: 4", "n_heads: 5"),
                    {"run.yaml:5:", "model.n_heads", "divisible"});
  expect_yaml_error(replace(kGood, "strategy: ddp", "strategy: zero3"),
                    {"run.yaml:11:", "parallel.strategy", "expected one of none, ddp, fsdp"});
  expect_yaml_error(kGood, {"--set logging.trace_start=0", "logging.trace_start", "must be >= 1"},
                    {"logging.trace=t.json", "logging.trace_start=0"});
}

TEST(ConfigError, ImpossibleCombinationsNamePathAndLine) {
  // fp16 without loss scaling underflows.
  expect_yaml_error(replace(kGood, "policy: bf16", "policy: fp16"),
                    {"run.yaml", "precision.scaler.enabled", "set precision.scaler.enabled: true"});
  expect_yaml_error(replace(kGood, "policy: bf16", "policy: fp16\n  scaler:\n    enabled: false"),
                    {"run.yaml:15:", "precision.scaler.enabled", "underflow"});
  expect_yaml_error(replace(kGood, "policy: bf16", "policy: bf16\n  reduce_dtype: fp16"),
                    {"run.yaml:13:", "precision.policy", "mixes fp16 and bf16"});
  expect_yaml_error(replace(kGood, "strategy: ddp", "strategy: ddp\n  backend: nccl"),
                    {"run.yaml:12:", "parallel.backend", "needs device: cuda"});
  expect_yaml_error(replace(kGood, "batch_size: 8", "batch_size: 8\n  micro_batches: 3"),
                    {"run.yaml:9:", "train.micro_batches", "divisible"});
  // FSDP-only precision fields under DDP are refused, not ignored.
  expect_yaml_error(replace(kGood, "policy: bf16", "policy: bf16\n  output_dtype: fp32"),
                    {"run.yaml:14:", "precision.output_dtype", "FSDP setting"});
  expect_yaml_error(
      replace(kGood, "policy: bf16", "policy: bf16\n  cast_forward_inputs: true"),
      {"run.yaml:14:", "precision.cast_forward_inputs", "use parallel.strategy: fsdp"});
  expect_yaml_error(
      replace(kGood, "policy: bf16", "policy: bf16\n  keep_low_precision_grads: true"),
      {"run.yaml:14:", "precision.keep_low_precision_grads", "FSDP setting"});
}

TEST(Config, FsdpTakesItsPrecisionFieldsAndWrapPolicy) {
  RunConfig c = parse_config(
      replace(replace(kGood, "strategy: ddp",
                      "strategy: fsdp\n  wrap_modules: [Block]\n  wrap_min_params: 10\n"
                      "  hybrid_group_size: 2"),
              "policy: bf16", "policy: bf16\n  output_dtype: fp32\n  cast_forward_inputs: true"),
      "run.yaml");
  EXPECT_EQ(c.parallel.wrap_modules, std::vector<std::string>{"Block"});
  EXPECT_EQ(c.parallel.wrap_min_params, 10);
  EXPECT_EQ(c.parallel.hybrid_group_size, 2);
  EXPECT_EQ(c.precision.mixed.output_dtype, at::kFloat);
  EXPECT_TRUE(c.precision.mixed.cast_forward_inputs);
  expect_yaml_error(replace(kGood, "strategy: ddp", "strategy: fsdp\n  wrap_modules: {a: 1}"),
                    {"run.yaml:12:", "parallel.wrap_modules", "expected a list of strings"});
}

// The trainer's fused optimizers step fp32 gradients: FSDP's keep_low_precision_grads with a
// 16-bit reduce dtype would throw at the first step, so the config refuses it at load time.
TEST(ConfigError, KeepLowPrecisionGradsIsRefusedForTheTrainersOptimizers) {
  const std::string fsdp = replace(kGood, "strategy: ddp", "strategy: fsdp");
  expect_yaml_error(replace(fsdp, "policy: bf16", "policy: bf16\n  keep_low_precision_grads: true"),
                    {"run.yaml:14:", "precision.keep_low_precision_grads", "fp32 gradients"});
  RunConfig c =
      parse_config(replace(fsdp, "policy: bf16",
                           "policy: bf16\n  reduce_dtype: fp32\n  keep_low_precision_grads: true"),
                   "run.yaml");
  EXPECT_TRUE(c.precision.mixed.keep_low_precision_grads);  // fp32 gradients: nothing to refuse
}

// The optimizer in backward steps each FSDP unit before any rank has the whole gradient: it
// needs FSDP, and refuses what needs that gradient first (clipping, a GradScaler's verdict).
TEST(ConfigError, TheOptimizerInBackwardIsRefusedWhereItCannotStep) {
  const std::string in_backward =
      replace(kGood, "  lr: 1.0e-3\n", "  lr: 1.0e-3\n  optimizer_in_backward: true\n");
  expect_yaml_error(in_backward,
                    {"run.yaml:10:", "train.optimizer_in_backward", "parallel.strategy: fsdp"});
  const std::string fsdp = replace(in_backward, "strategy: ddp", "strategy: fsdp");
  RunConfig c = parse_config(fsdp, "run.yaml");
  EXPECT_TRUE(c.train.optimizer_in_backward);
  // The other key came from the command line: the message names that --set too.
  expect_yaml_error(fsdp,
                    {"run.yaml:10 (with --set train.clip_grad_norm=1.0):",
                     "train.optimizer_in_backward", "clip_grad_norm"},
                    {"train.clip_grad_norm=1.0"});
  expect_yaml_error(replace(fsdp, "policy: bf16", "policy: fp16\n  scaler:\n    enabled: true"),
                    {"run.yaml:10:", "train.optimizer_in_backward", "GradScaler"});
}

// train.spike_guard: warn by default; rollback needs checkpoints during the run to go back to.
TEST(ConfigError, ASpikeGuardRollbackNeedsCheckpointsAndSaneLimits) {
  RunConfig c = parse_config(kGood, "run.yaml");
  EXPECT_EQ(c.train.spike_guard.action, SpikeAction::kWarn);
  const std::string rollback =
      replace(kGood, "  lr: 1.0e-3\n", "  lr: 1.0e-3\n  spike_guard:\n    action: rollback\n");
  expect_yaml_error(rollback, {"run.yaml:11:", "train.spike_guard.action", "checkpoint.dir",
                               "checkpoint.every_steps"});
  expect_yaml_error(rollback, {"train.spike_guard.action", "checkpoint.every_steps"},
                    {"checkpoint.dir=/tmp/x"});
  c = parse_config(rollback, "run.yaml", {"checkpoint.dir=/tmp/x", "checkpoint.every_steps=5"});
  EXPECT_EQ(c.train.spike_guard.action, SpikeAction::kRollback);
  expect_yaml_error(kGood, {"train.spike_guard.factor", "must be > 1"},
                    {"train.spike_guard.factor=0.5"});
  expect_yaml_error(kGood, {"train.spike_guard.action", "expected one of"},
                    {"train.spike_guard.action=stop"});
}

// A check of one key against another, the other given by --set: the --set is named beside the
// file's line, never the line alone.
TEST(ConfigError, ACrossKeyCheckNamesTheSetThatGaveTheOtherKey) {
  expect_yaml_error(kGood, {"(with --set model.d_model=190):", "model.n_heads", "d_model 190"},
                    {"model.d_model=190"});
  expect_yaml_error(replace(kGood, "batch_size: 8", "batch_size: 8\n  micro_batches: 2"),
                    {"(with --set train.batch_size=15):", "train.micro_batches"},
                    {"train.batch_size=15"});
}

TEST(Config, Bf16WithAnEnabledScalerWarns) {
  RunConfig c = parse_config(
      replace(kGood, "policy: bf16", "policy: bf16\n  scaler:\n    enabled: true"), "run.yaml");
  // The scaler's warning, and the CPU's own about bf16 only where it has no bf16 instructions
  // (the warnings depend on the machine the test runs on: CI's may lack AVX512-BF16).
  auto count = [&](const char* text) {
    return std::count_if(c.warnings.begin(), c.warnings.end(),
                         [&](const std::string& w) { return w.find(text) != std::string::npos; });
  };
  const bool emulated = !low_precision_support(c10::kCPU).bf16;
  EXPECT_EQ(count("need no loss scaling"), 1);
  EXPECT_EQ(count("precision uses bf16, which has no hardware path here"), emulated ? 1 : 0);
  EXPECT_EQ(c.warnings.size(), emulated ? 2u : 1u);
}

// A newcomer's spellings: spaces around '=' in one --set word, PyTorch's dtype names.
TEST(Config, ForgivingSpellingsMeanWhatTheySay) {
  RunConfig c = parse_config(kGood, "run.yaml", {"train.lr = 0.5", " train.steps =3"});
  EXPECT_DOUBLE_EQ(c.train.lr, 0.5);
  EXPECT_EQ(c.train.steps, 3);
  for (const auto& [name, policy, dtype] :
       std::vector<std::tuple<std::string, Precision, c10::ScalarType>>{
           {"bfloat16", Precision::kBf16, c10::kBFloat16},
           {"torch.bfloat16", Precision::kBf16, c10::kBFloat16},
           {"float32", Precision::kFp32, c10::kFloat},
           {"torch.float32", Precision::kFp32, c10::kFloat}}) {
    SCOPED_TRACE(name);
    RunConfig p = parse_config(replace(kGood, "policy: bf16", "policy: " + name), "run.yaml");
    EXPECT_EQ(p.precision.policy, policy);
    EXPECT_EQ(p.precision.mixed.param_dtype, dtype);
  }
  RunConfig half = parse_config(replace(kGood, "policy: bf16", "policy: float16"), "run.yaml",
                                {"precision.scaler.enabled=true"});
  EXPECT_EQ(half.precision.policy, Precision::kFp16);
  RunConfig r = parse_config(
      replace(kGood, "policy: bf16", "policy: bf16\n  reduce_dtype: torch.float32"), "run.yaml");
  EXPECT_EQ(r.precision.mixed.effective_reduce_dtype(), c10::kFloat);
  expect_yaml_error(replace(kGood, "policy: bf16", "policy: int8"),
                    {"run.yaml:13:", "precision.policy", "fp32, bf16, fp16, auto", "bfloat16"});
}

TEST(ConfigError, ATabInTheIndentationIsNamed) {
  expect_yaml_error(replace(kGood, "  steps: 10", "\tsteps: 10"),
                    {"run.yaml:7:", "indented with a tab", "spaces only"});
}

// data.path selects the corpus; it never sits unread beside synthetic data.
TEST(Config, ADataPathSelectsTheCorpus) {
  RunConfig c = parse_config(
      std::string(kGood) + "data:\n  path: /usr/share/common-licenses/GPL-3\n", "run.yaml");
  EXPECT_EQ(c.data.source, DataSource::kCorpus);
  EXPECT_EQ(parse_config(kGood, "run.yaml").data.source, DataSource::kSynthetic);
  expect_yaml_error(std::string(kGood) + "data:\n  path: /nonexistent/corpus.txt\n",
                    {"run.yaml:15:", "data.path", "cannot be read"});
  expect_yaml_error(
      std::string(kGood) + "data:\n  source: synthetic\n  path: /usr/share/common-licenses/GPL-3\n",
      {"run.yaml:16:", "data.path", "data.source is synthetic", "data.source: corpus"});
  expect_yaml_error(mlp_good() + "data:\n  path: /usr/share/common-licenses/GPL-3\n",
                    {"data.source", "model.type: mlp", "data of its own"});
}

// The warning about an emulated 16-bit dtype quotes what it costs on this CPU.
TEST(Config, AnEmulatedDtypeWarnsWithItsMeasuredCost) {
  if (low_precision_support(c10::kCPU).fp16) GTEST_SKIP() << "this CPU has native fp16";
  RunConfig c = parse_config(replace(kGood, "policy: bf16", "policy: fp16"), "run.yaml",
                             {"precision.scaler.enabled=true"});
  ASSERT_EQ(c.warnings.size(), 1u);
  EXPECT_NE(c.warnings[0].find("a matmul measured now took "), std::string::npos) << c.warnings[0];
  EXPECT_NE(c.warnings[0].find("x fp32's time"), std::string::npos) << c.warnings[0];
  EXPECT_GT(cpu_matmul_slowdown(c10::kHalf), 0.0);
}

TEST(ConfigError, OverridesAreValidatedAndNamed) {
  expect_yaml_error(kGood, {"--set train.lr=-1", "train.lr", "must be > 0"}, {"train.lr=-1"});
  expect_yaml_error(kGood, {"--set train.steps=ten", "expected an integer"}, {"train.steps=ten"});
  expect_yaml_error(kGood, {"--set train.lrr=1", "train.lrr", "did you mean 'lr'?"},
                    {"train.lrr=1"});
  expect_yaml_error(kGood, {"--set train", "key.path=value"}, {"train"});
  expect_yaml_error(kGood, {"--set train.lr.x=1", "not a section"}, {"train.lr.x=1"});
}

TEST(ConfigError, SyntaxErrorsAndMissingFilesAreClear) {
  expect_yaml_error("model:\n  type: [transformer\n", {"run.yaml:", "not valid YAML"});
  expect_config_error([] { load_config("/nonexistent/run.yaml"); },
                      {"/nonexistent/run.yaml", "cannot be read"});
  expect_yaml_error("", {"run.yaml", "the config is empty", "configs/default.yaml"});
}

// Inputs in fuzz/regressions/fuzz_config/: a recursive alias overflowed
// the stack, nested aliases took minutes, and a list or mapping as a key escaped as a
// yaml-cpp exception.
TEST(ConfigError, RecursiveAliasesExpansionsAndNonNameKeysAreRefused) {
  expect_yaml_error(std::string(kGood) + "logging: &x {all_ranks: *x}\n",
                    {"run.yaml:", "logging.all_ranks", "must not be recursive"});
  std::string laughs = std::string(kGood) + "l0: &l0 [x, x, x, x, x, x, x, x, x, x]\n";
  for (int i = 1; i < 9; ++i) {
    laughs += "l" + std::to_string(i) + ": &l" + std::to_string(i) + " [";
    for (int k = 0; k < 10; ++k) laughs += (k ? ", *l" : "*l") + std::to_string(i - 1);
    laughs += "]\n";
  }
  expect_yaml_error(laughs, {"run.yaml", "expands to more than"});
  expect_yaml_error(std::string(kGood) + "logging: {[a, b]: 1}\n",
                    {"logging", "a key must be a name"});
  expect_yaml_error(kGood, {"--set logging={{x: 1}: 2}", "a key must be a name"},
                    {"logging={{x: 1}: 2}"});
}

TEST(Configs, EveryShippedConfigLoadsAndValidates) {
  int loaded = 0;
  for (std::string dir : {"configs", "configs/tiny"}) {
    DIR* d = ::opendir(dir.c_str());
    ASSERT_NE(d, nullptr) << "run from the repository root (cannot open " << dir << ")";
    while (dirent* e = ::readdir(d)) {
      std::string name = e->d_name;
      if (name.size() < 5 || name.substr(name.size() - 5) != ".yaml") continue;
      SCOPED_TRACE(dir + "/" + name);
      const std::string path = dir + "/" + name;
      if (name == "llama_finetune.yaml") {
        // Its checkpoint is the user's (tests/llama_hf_test.py trains it on one): a
        // config.json stands in for it, and synthetic tokens for the user's.
        const std::string ckpt = ::testing::TempDir() + "/shipped_llama_finetune";
        std::filesystem::create_directories(ckpt);
        std::ofstream(ckpt + "/config.json")
            << R"({"model_type": "llama", "vocab_size": 300, "hidden_size": 32,
                  "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4})";
        EXPECT_NO_THROW(
            load_config(path, {"model.pretrained=" + ckpt, "data={source: synthetic}"}));
      } else if (name == "llama_tokens.yaml") {
        // Its tokens, and the vocabulary in their meta.json, are prepared first
        // (tests/prepare_test.py trains on them).
        EXPECT_NO_THROW(load_config(path, {"data={source: synthetic}", "model.vocab_size=2048"}));
      } else {
        EXPECT_NO_THROW(load_config(path));
      }
      ++loaded;
    }
    ::closedir(d);
  }
  EXPECT_GE(loaded, 12);  // {ddp, fsdp} x {fp32, bf16, fp16}, real and tiny
}

// Pipeline parallelism: parallel.pp and its keys, checked at config time (the schedule and the
// split of the model's layers), each error naming its key.
TEST(Config, PipelineKeys) {
  const std::string llama = R"(device: cpu
model:
  type: llama
  vocab_size: 256
  hidden_size: 32
  intermediate_size: 64
  num_hidden_layers: 4
  num_attention_heads: 4
  num_key_value_heads: 2
  seq_len: 16
train:
  steps: 10
  batch_size: 8
  micro_batches: 4
  lr: 1.0e-3
parallel:
  pp: 2
)";
  const RunConfig c = parse_config(llama, "run.yaml");
  EXPECT_EQ(c.parallel.pp, 2);
  EXPECT_EQ(c.parallel.pp_schedule, sharding::pp::ScheduleKind::k1F1B);
  const RunConfig split = parse_config(llama, "run.yaml", {"parallel.pp_split=[1, 3]"});
  EXPECT_EQ(split.parallel.pp_split, (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(parse_config(llama, "run.yaml",
                         {"parallel.pp_schedule=interleaved_1f1b", "parallel.pp_stages_per_rank=2"})
                .parallel.pp_schedule,
            sharding::pp::ScheduleKind::kInterleaved1F1B);
  expect_yaml_error(llama, {"parallel.pp", "must be in [1, 4096]"}, {"parallel.pp=0"});
  expect_yaml_error(llama, {"parallel.pp", "must be in [1, 4096]"}, {"parallel.pp=100000000"});
  expect_yaml_error(llama, {"parallel.pp", "too large to plan"},
                    {"parallel.pp=4096", "train.micro_batches=4096", "train.batch_size=4096"});
  expect_yaml_error(llama, {"parallel.pp_schedule", "unknown pipeline schedule 'zb'"},
                    {"parallel.pp_schedule=zb"});
  expect_yaml_error(llama, {"parallel.pp_split", "expected a list of layer counts", "'x'"},
                    {"parallel.pp_split=[1, x]"});
  expect_yaml_error(llama, {"parallel.pp_split", "adds up to 3 layers", "the model has 4"},
                    {"parallel.pp_split=[1, 2]"});
  expect_yaml_error(llama, {"parallel.pp_split", "leaves stage 1 without layers"},
                    {"parallel.pp_split=[4, 0]"});
  expect_yaml_error(llama, {"parallel.pp", "would leave a stage empty"}, {"parallel.pp=8"});
  expect_yaml_error(llama, {"parallel.pp", "do not split evenly into 3 stages", "pp_split"},
                    {"parallel.pp=3"});
  expect_yaml_error(
      llama, {"parallel.pp_schedule", "micro_batches (6) must be a multiple"},
      {"parallel.pp=4", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_stages_per_rank=2",
       "model.num_hidden_layers=8", "train.micro_batches=6", "train.batch_size=12"});
  expect_yaml_error(llama, {"parallel.pp_split", "parallel.pp is 1"},
                    {"parallel.pp=1", "parallel.pp_split=[2, 2]"});
  expect_yaml_error(llama, {"parallel.pp_stages_per_rank", "parallel.pp is 1"},
                    {"parallel.pp=1", "parallel.pp_stages_per_rank=2"});
  expect_yaml_error(llama, {"parallel.pp", "tie_word_embeddings"},
                    {"model.tie_word_embeddings=true"});
  expect_yaml_error(llama, {"parallel.pp", "strategy none has no data-parallel ranks"},
                    {"parallel.strategy=none"});
  expect_yaml_error(llama, {"parallel.sharding_strategy", "hybrid_shard with a pipeline"},
                    {"parallel.strategy=fsdp", "parallel.sharding_strategy=hybrid_shard"});
  EXPECT_EQ(parse_config(llama, "run.yaml", {"parallel.strategy=fsdp"}).parallel.strategy,
            ParallelStrategy::kFsdp);                                            // pp x fsdp
  EXPECT_EQ(parse_config(llama, "run.yaml", {"parallel.tp=2"}).parallel.tp, 2);  // 2-D: pp x tp
  expect_yaml_error(kGood, {"parallel.pp", "model.type transformer has no pipeline split"},
                    {"parallel.pp=2"});
}

}  // namespace
}  // namespace dtrain::framework
