// A run's whole configuration: YAML -> typed structs, strictly validated.
//
// Every problem raises ConfigError naming where it is and what to do:
//   configs/x.yaml:12: train.lr: must be > 0, got -0.1
//   configs/x.yaml:14: train.learning_rate: unknown key; did you mean 'lr'? (keys under train: ...)
//   --set train.steps=ten: train.steps: expected an integer, got 'ten'
// Overrides (`--set key.path=value`, parsed as YAML scalars) pass through the same checks.
// Required keys: model.type, train.steps, train.batch_size, train.lr. Everything else has the
// default shown in configs/README.md. The model section belongs to the model model.type names:
// its registration (framework/model_registry.h) reads and checks it, so those keys are the
// only ones accepted there.
//
// A key with named choices is an enum, parsed once: its names are listed once, in the table
// beside it (core/choices.h), which the parser, its "expected one of" messages and the logs
// read (name_of). The backend's table is comm/backend.h's.
#pragma once

#include <c10/core/DeviceType.h>

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <typeinfo>
#include <utility>
#include <vector>

#include "amp/policy.h"
#include "comm/backend.h"
#include "core/choices.h"
#include "core/error.h"
#include "core/logging.h"
#include "sharding/pipeline_schedule.h"
#include "sharding/sharding_strategy.h"

namespace dtrain::framework {

// data.source
enum class DataSource { kSynthetic, kCorpus, kTokens };
inline constexpr std::array<std::pair<DataSource, const char*>, 3> kDataSources{{
    {DataSource::kSynthetic, "synthetic"},
    {DataSource::kCorpus, "corpus"},
    {DataSource::kTokens, "tokens"},
}};
constexpr const auto& choices(DataSource) { return kDataSources; }

// train.optimizer
enum class OptimizerType { kAdamW, kSgd };
inline constexpr std::array<std::pair<OptimizerType, const char*>, 2> kOptimizerTypes{{
    {OptimizerType::kAdamW, "adamw"},
    {OptimizerType::kSgd, "sgd"},
}};
constexpr const auto& choices(OptimizerType) { return kOptimizerTypes; }

// train.spike_guard.action: what a loss spike does (framework/spike_guard.h).
enum class SpikeAction { kOff, kWarn, kRollback };
inline constexpr std::array<std::pair<SpikeAction, const char*>, 3> kSpikeActions{{
    {SpikeAction::kOff, "off"},
    {SpikeAction::kWarn, "warn"},
    {SpikeAction::kRollback, "rollback"},
}};
constexpr const auto& choices(SpikeAction) { return kSpikeActions; }

// parallel.strategy
enum class ParallelStrategy { kNone, kDdp, kFsdp };
inline constexpr std::array<std::pair<ParallelStrategy, const char*>, 3> kParallelStrategies{{
    {ParallelStrategy::kNone, "none"},
    {ParallelStrategy::kDdp, "ddp"},
    {ParallelStrategy::kFsdp, "fsdp"},
}};
constexpr const auto& choices(ParallelStrategy) { return kParallelStrategies; }

// device
enum class ComputeDevice { kCpu, kCuda };
inline constexpr std::array<std::pair<ComputeDevice, const char*>, 2> kComputeDevices{{
    {ComputeDevice::kCpu, "cpu"},
    {ComputeDevice::kCuda, "cuda"},
}};
constexpr const auto& choices(ComputeDevice) { return kComputeDevices; }
inline c10::DeviceType torch_device(ComputeDevice d) {
  return d == ComputeDevice::kCuda ? c10::kCUDA : c10::kCPU;
}

// checkpoint.format. auto: sharded under FSDP, else full.
enum class CheckpointFormat { kAuto, kFull, kSharded };
inline constexpr std::array<std::pair<CheckpointFormat, const char*>, 3> kCheckpointFormats{{
    {CheckpointFormat::kAuto, "auto"},
    {CheckpointFormat::kFull, "full"},
    {CheckpointFormat::kSharded, "sharded"},
}};
constexpr const auto& choices(CheckpointFormat) { return kCheckpointFormats; }

// A model's own keys (model: besides type), as its registered reader made them
// (framework/model_registry.h). Derive from ModelSettingsOf<YourSettings>.
struct ModelSettings {
  virtual ~ModelSettings() = default;
  virtual std::unique_ptr<ModelSettings> clone() const = 0;
};
template <typename Derived>
struct ModelSettingsOf : ModelSettings {
  std::unique_ptr<ModelSettings> clone() const override {
    return std::make_unique<Derived>(static_cast<const Derived&>(*this));
  }
};

// model.type "custom": a model given in code, through framework::train(module, data, loss,
// config, comm); its model section has no other keys.
inline constexpr const char* kCustomModel = "custom";

struct ModelConfig {
  std::string type;  // a registered model's name (framework/model_registry.h), or "custom"
  std::unique_ptr<ModelSettings> settings;  // null for custom

  ModelConfig() = default;
  ModelConfig(const ModelConfig& o)
      : type(o.type), settings(o.settings ? o.settings->clone() : nullptr) {}
  ModelConfig& operator=(const ModelConfig& o) {
    if (this != &o) {
      type = o.type;
      settings = o.settings ? o.settings->clone() : nullptr;
    }
    return *this;
  }
  ModelConfig(ModelConfig&&) noexcept = default;
  ModelConfig& operator=(ModelConfig&&) noexcept = default;

  bool custom() const { return type == kCustomModel; }
  // The settings as the registered model's type (UsageError when they are another model's).
  template <typename T>
  const T& as() const {
    const T* t = dynamic_cast<const T*>(settings.get());
    DTRAIN_CHECK(t != nullptr, "model.type ", type, ": its settings are not ", typeid(T).name());
    return *t;
  }
  template <typename T>
  T& as() {
    return const_cast<T&>(static_cast<const ModelConfig*>(this)->as<T>());
  }
};

struct DataConfig {
  DataSource source = DataSource::kSynthetic;
  std::string path = "/usr/share/common-licenses/GPL-3";  // corpus: a text file
  // tokens (framework/data.h TokenFileSource): path is a file or a glob of .bin/.npy files;
  // dtype is the .bin files' (an .npy says its own); val_path the validation files (none:
  // the training files' last windows are held out, val_fraction of them and at least
  // train.eval_samples).
  std::string dtype = "uint16";  // taken from dtrain-prepare's meta.json beside the files
  std::string val_path;
  double val_fraction = 0;
  int64_t seed = 1;
  // From dtrain-prepare's meta.json beside the token files, when there is one: its path and the
  // tokenizer's vocabulary, which the model's must hold (0: no meta.json).
  std::string token_meta;
  int64_t tokenizer_vocab_size = 0;
};

// train.spike_guard (framework/spike_guard.h): a loss above `factor` times the median of the
// last `window` steps' losses (or not finite, where no loss scaler skipped the step) for
// `steps` judged steps in a row is a spike. warn: a warning says so. rollback: every rank goes
// back to the newest checkpoint (none is written during a possible spike), skips the batches
// of the spike's steps and goes on; the (max_rollbacks + 1)-th spike stops the run.
struct SpikeGuardConfig {
  SpikeAction action = SpikeAction::kWarn;
  double factor = 2.0;
  int64_t steps = 2;
  int64_t window = 50;
  int64_t max_rollbacks = 3;
};

struct TrainConfig {
  int64_t steps = 0;
  int64_t batch_size = 0;  // per rank per optimizer step, split into micro_batches
  int64_t micro_batches = 1;
  double lr = 0;
  double weight_decay = 0.0;
  int64_t warmup_steps = 0;
  double clip_grad_norm = 0.0;  // 0: off
  int64_t eval_every = 0;       // validation loss every N steps (and at the end); 0: off
  int64_t eval_samples = 12;    // the fixed validation set, split over the ranks
  OptimizerType optimizer = OptimizerType::kAdamW;
  double momentum = 0.9;  // sgd
  // FSDP only: each unit is stepped as soon as its gradients are reduced, in backward, and its
  // gradient shard freed (PyTorch's _apply_optimizer_in_backward): 4 bytes per parameter less
  // per rank. Not with clipping or loss scaling, which need every gradient first.
  bool optimizer_in_backward = false;
  int64_t seed = 1234;
  // Without loss scaling (fp32, bf16), this many consecutive steps with a non-finite loss
  // stop the run (with a scaler, such steps are skipped and the scale backs off).
  int64_t max_nonfinite_steps = 1;
  SpikeGuardConfig spike_guard;
};

struct ParallelConfig {
  ParallelStrategy strategy = ParallelStrategy::kDdp;
  comm::Backend backend = comm::Backend::kAuto;
  // As PyTorch's: unset, 25 MB with a 1 MB first bucket; set, the first bucket's limit too.
  double bucket_cap_mb = 25.0;
  bool bucket_cap_mb_set = false;
  bool find_unused_parameters = false;
  bool broadcast_buffers = true;
  sharding::ShardingStrategy sharding_strategy = sharding::ShardingStrategy::kFullShard;
  bool forward_prefetch = false;
  bool backward_prefetch = true;
  int64_t limit_all_gathers = 2;
  sharding::ShardLayout shard_layout = sharding::ShardLayout::kPerParameter;
  // FSDP auto-wrap: which of the model's wrap points become units (class names; empty: all),
  // and the fewest parameters a unit must hold.
  std::vector<std::string> wrap_modules;
  int64_t wrap_min_params = 0;
  int64_t hybrid_group_size = 0;  // hybrid_shard: ranks per shard group; 0: LOCAL_WORLD_SIZE
  // Tensor parallelism (sharding/mesh.h): ranks per TP group, consecutive ranks of one node;
  // the strategy (ddp or fsdp) runs over the world / tp data-parallel ranks. 1: off.
  int64_t tp = 1;
  // Sequence parallelism inside the TP groups: the norms and the residual stream between the
  // tensor-parallel layers hold 1/tp of the sequence.
  bool sequence_parallel = false;
  // Sequence parallelism: the column-wise layers all-gather their input again in backward
  // rather than hold the gathered sequence (Megatron-LM's way; false: PyTorch's).
  bool sequence_parallel_regather = true;
  // Pipeline parallelism (sharding/pipeline.h; docs/pipeline.md): the model's layers split
  // into pp x pp_stages_per_rank stages, pp_split layers each (empty: as even as it goes), and
  // train.micro_batches micro-batches run through them under pp_schedule. The mesh is pp x
  // (data-parallel ranks) x tp, pp outermost; the strategy (ddp) runs over the data-parallel
  // ranks of each stage. 1: off.
  int64_t pp = 1;
  sharding::pp::ScheduleKind pp_schedule = sharding::pp::ScheduleKind::k1F1B;
  int64_t pp_stages_per_rank = 1;  // interleaved_1f1b: 2 or more (zero_bubble: 1)
  std::vector<int64_t> pp_split;
  double timeout_s = 300.0;
};

// precision.policy: a preset of amp::MixedPrecisionPolicy. auto: bf16 where the hardware has
// it, else fp16 where that is native, else fp32. PyTorch's spellings (bfloat16, float16,
// torch.float32, half, ...) are read as these names (canonical_precision_name).
enum class Precision { kFp32, kBf16, kFp16, kAuto };
inline constexpr std::array<std::pair<Precision, const char*>, 4> kPrecisions{{
    {Precision::kFp32, "fp32"},
    {Precision::kBf16, "bf16"},
    {Precision::kFp16, "fp16"},
    {Precision::kAuto, "auto"},
}};
constexpr const auto& choices(Precision) { return kPrecisions; }

struct ScalerConfig {
  bool enabled = false;
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  // Scale collapse: the run stops when the scale falls below min_scale (DeepSpeed's
  // min_loss_scale, default 1) or after max_consecutive_skips skipped steps in a row
  // (0: no limit). Either means the gradients overflow whatever the scale.
  double min_scale = 1.0;
  int64_t max_consecutive_skips = 50;
};

struct PrecisionConfig {
  Precision policy = Precision::kFp32;  // never kAuto: auto is resolved while parsing
  std::string chosen_by;                // what auto chose and why; empty otherwise
  amp::MixedPrecisionPolicy mixed;      // the preset with any explicit dtype overrides applied
  ScalerConfig scaler;
};

struct CheckpointConfig {
  std::string dir;          // empty: no checkpoints
  int64_t every_steps = 0;  // 0: only at the end
  int64_t keep = 2;
  std::string resume = "auto";  // auto | never | <path of a step_* directory>
  CheckpointFormat format = CheckpointFormat::kAuto;
  // The step waits only while the state is copied into staging buffers; the files are written,
  // checksummed and fsynced on a thread while training goes on (PyTorch DCP's async_save).
  bool async = false;
  // SIGTERM or SIGUSR1 (what Slurm and Kubernetes send before a kill): every rank finishes its
  // step, they agree, save within this many seconds and exit with kRequeueExitCode. 0: off
  // (the signal ends the run unsaved, as before).
  double on_signal_s = 120;
  // Ctrl-C (SIGINT) saves the same way too; false: Ctrl-C ends the run unsaved.
  bool on_interrupt = false;
  // A resume onto data (or a tokenizer) other than the checkpoint's is refused unless true.
  bool allow_data_change = false;
};

struct LoggingConfig {
  logging::Level level = logging::Level::kInfo;
  int64_t every_steps = 10;
  bool all_ranks = false;
  std::string metrics_file;  // JSON lines; empty: none
  bool progress_bar = true;
  // Byte-level language models: greedy tokens generated at the end of the run (0: none). Each
  // token is one forward, which under FSDP gathers the whole model once.
  int64_t sample_tokens = 48;
  // Without a terminal (under dtrain-launch, mpirun, into a file), rank 0 prints a progress
  // line (rate, time left) when this many seconds pass without a line of its own.
  double progress_every_s = 15.0;
  bool numerics = false;  // per-unit numerics monitor (amp/numerics.h), reported on skipped steps
  // Step timeline (core/trace.h): a Chrome trace-event JSON of steps trace_start ..
  // trace_start + trace_steps - 1 (1-based), all ranks in one file written by rank 0; empty: off.
  std::string trace;
  int64_t trace_start = 2;
  int64_t trace_steps = 2;
};

struct RunConfig {
  std::string source;  // the file it came from
  ComputeDevice device = ComputeDevice::kCpu;
  ModelConfig model;
  DataConfig data;
  TrainConfig train;
  ParallelConfig parallel;
  PrecisionConfig precision;
  CheckpointConfig checkpoint;
  LoggingConfig logging;
  std::vector<std::string> warnings;  // valid but questionable choices, for the log
};

// Loads `path`, applies `overrides` ("key.path=value"), validates. Throws ConfigError.
RunConfig load_config(const std::string& path, const std::vector<std::string>& overrides = {});

// The same from YAML text (`name` stands in for the file name in messages).
RunConfig parse_config(const std::string& yaml_text, const std::string& name,
                       const std::vector<std::string>& overrides = {});

}  // namespace dtrain::framework
