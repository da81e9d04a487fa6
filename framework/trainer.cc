#include "framework/trainer.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/optim/optimizer.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "amp/autocast.h"
#include "amp/sharded_grad_scaler.h"
#include "comm/factory.h"
#include "comm/flight_recorder.h"
#include "comm/rendezvous.h"
#include "core/logging.h"
#include "core/trace.h"
#include "framework/hardware.h"
#include "framework/memory.h"
#include "framework/memory_estimate.h"
#include "framework/model_registry.h"
#include "framework/models/builtin.h"
#include "framework/pipeline_strategy.h"
#include "framework/report.h"
#include "optim/fused.h"

namespace dtrain::framework {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

double lr_at(const TrainConfig& t, int64_t step) {
  if (t.warmup_steps > 0 && step < t.warmup_steps) {
    return t.lr * static_cast<double>(step + 1) / static_cast<double>(t.warmup_steps);
  }
  double span = std::max<int64_t>(1, t.steps - t.warmup_steps);
  double progress = std::min(1.0, static_cast<double>(step - t.warmup_steps) / span);
  return t.lr * (0.1 + 0.9 * 0.5 * (1.0 + std::cos(M_PI * progress)));
}

double mean_over_ranks(comm::Communicator* comm, double v) {
  if (comm == nullptr || comm->size() == 1) return v;
  at::Tensor t = at::full({1}, v, at::TensorOptions().dtype(at::kDouble).device(comm->device()));
  comm->all_reduce(t, comm::ReduceOp::kAvg).wait();
  return t.item<double>();
}

// Before any backend is chosen: a CPU-only LibTorch, or one that sees no GPU.
void check_device(const RunConfig& c) {
  if (c.device != ComputeDevice::kCuda || at::hasCUDA()) return;
  const bool built = at::detail::getCUDAHooks().isBuilt();
  DTRAIN_FAIL(ConfigError, c.source, ": device: cuda, but ",
              built ? "this LibTorch sees no CUDA GPU (check the driver and "
                      "CUDA_VISIBLE_DEVICES); use device: cpu"
                    : "this LibTorch is a CPU-only build, without CUDA; use device: cpu, or "
                      "build dtrain against a CUDA LibTorch");
}

void check_supported(const RunConfig& c, const comm::Communicator* comm) {
  DTRAIN_CHECK_AS(
      ConfigError,
      c.parallel.strategy != ParallelStrategy::kNone || comm == nullptr || comm->size() == 1,
      c.source, ": parallel.strategy: none trains one process, but this job has ",
      comm ? comm->size() : 1, " ranks; use ddp");
  check_device(c);
}

// ATen's fused kernels, as Python's AdamW(fused=True) and SGD(fused=True): one pass per step,
// PyTorch's rounding, and the GradScaler's skip inside the kernel (optim/fused.h).
std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainConfig& t,
                                                        std::vector<at::Tensor> params) {
  if (t.optimizer == OptimizerType::kAdamW) {
    return std::make_unique<optim::AdamW>(
        std::move(params), torch::optim::AdamWOptions(t.lr).weight_decay(t.weight_decay));
  }
  return std::make_unique<optim::SGD>(
      std::move(params),
      torch::optim::SGDOptions(t.lr).momentum(t.momentum).weight_decay(t.weight_decay));
}

// FSDP's gradients are shards (and may be fp16), and TP's slices: the inf verdict must be
// agreed over ranks.
std::unique_ptr<amp::GradScaler> make_scaler(const RunConfig& c,
                                             const std::shared_ptr<comm::Communicator>& comm) {
  const auto& sc = c.precision.scaler;
  const auto o = amp::GradScalerOptions()
                     .init_scale(sc.init_scale)
                     .growth_factor(sc.growth_factor)
                     .backoff_factor(sc.backoff_factor)
                     .growth_interval(sc.growth_interval)
                     .enabled(sc.enabled);
  // Under tensor parallelism each TP rank holds other slices: the verdict is agreed over all.
  // Under pipeline parallelism each stage judges its own gradients: all skip together.
  if (comm &&
      (c.parallel.strategy == ParallelStrategy::kFsdp || c.parallel.tp > 1 || c.parallel.pp > 1))
    return std::make_unique<amp::ShardedGradScaler>(comm, o);
  return std::make_unique<amp::GradScaler>(o);
}

// What stops `path` (a file, or a folder when `folder`) from being written; nullopt when it
// can be. Makes the folders the run would make, and removes a file it made.
std::optional<std::string> unwritable(const std::string& path, bool folder) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path p(path);
  if (folder && fs::exists(p, ec) && !fs::is_directory(p, ec)) {
    return "'" + path + "' is a file; give a folder";
  }
  if (!folder && fs::is_directory(p, ec)) return "'" + path + "' is a folder; give a file";
  const fs::path dir = folder ? p : p.parent_path();
  if (!dir.empty()) {
    fs::create_directories(dir, ec);
    if (ec) {
      return "cannot write '" + path + "': the folder '" + dir.string() +
             "' cannot be made: " + ec.message();
    }
  }
  const fs::path probe = folder ? p / (".dtrain_write_check." + std::to_string(::getpid())) : p;
  const bool existed = fs::exists(probe, ec);
  errno = 0;
  if (!std::ofstream(probe, std::ios::app)) {
    return "cannot write '" + probe.string() + "': " + std::strerror(errno);
  }
  if (!existed) fs::remove(probe, ec);
  return std::nullopt;
}

// Every path the run will write, checked before training rather than at its first write:
// the first problem found on this rank, naming its key, or an empty string.
std::string output_problem(const RunConfig& c, int rank) {
  std::vector<std::tuple<const char*, std::string, bool>> outputs;  // key, path, folder
  if (!c.checkpoint.dir.empty()) outputs.emplace_back("checkpoint.dir", c.checkpoint.dir, true);
  if (rank == 0 && !c.logging.metrics_file.empty()) {  // rank 0 writes these
    outputs.emplace_back("logging.metrics_file", c.logging.metrics_file, false);
  }
  if (rank == 0 && !c.logging.trace.empty()) {
    outputs.emplace_back("logging.trace", c.logging.trace, false);
  }
  for (const auto& [key, path, folder] : outputs) {
    if (auto why = unwritable(path, folder)) return c.source + ": " + key + ": " + *why;
  }
  return {};
}

// A start-up check that one rank fails stops every rank before the first collective: the
// rank that failed reports its problem, the others say whose problem stopped them (instead of
// a peer's closed connection later).
void agree_to_start(comm::Communicator* comm, int rank, int world, const std::string& problem) {
  std::vector<int> failed;
  if (comm != nullptr && world > 1) {
    at::Tensor t = at::zeros({world}, at::kFloat);
    t[rank] = problem.empty() ? 0.0 : 1.0;
    t = t.to(comm->device());
    comm->all_reduce(t, comm::ReduceOp::kSum).wait();
    t = t.cpu();
    for (int r = 0; r < world; ++r) {
      if (t[r].item<float>() > 0) failed.push_back(r);
    }
  }
  if (!problem.empty()) DTRAIN_FAIL(ConfigError, problem);
  if (failed.empty()) return;
  // The rank with the problem exits first, so that its message comes first; the others exit
  // with cli::kConsequenceExitCode, which dtrain-launch never names as the cause.
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  std::string ranks;
  for (int r : failed) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  DTRAIN_FAIL(PeerLostError, "stopping before the first step: rank", failed.size() > 1 ? "s " : " ",
              ranks, " could not start (",
              failed.size() > 1 ? "their messages name" : "its message names", " the key to fix)");
}

// More compute threads than CPUs on this node (the ranks here times ATen's intra-op threads,
// OMP_NUM_THREADS): they preempt each other inside every kernel.
void warn_if_oversubscribed(c10::DeviceType device, const comm::Communicator* comm) {
  if (device != c10::kCPU) return;
  const int ranks = comm != nullptr ? comm->local_size() : 1;
  const int threads = at::get_num_threads();
  const int cpus = usable_cpus();
  if (static_cast<int64_t>(ranks) * threads <= cpus) return;
  logging::warn(ranks, " rank(s) on this node x ", threads, " compute threads each (",
                "OMP_NUM_THREADS) is more than its ", cpus,
                " CPUs: the threads preempt each other inside every kernel (configs/default.yaml, "
                "2 ranks on 2 CPUs: OMP_NUM_THREADS=8 made steps 2.3-2.6x slower than 1). Set "
                "OMP_NUM_THREADS=",
                std::max(1, cpus / ranks), ", or leave it unset under dtrain-launch");
}

// dtrain-launch's output is a terminal: it shows a line this rank redraws with '\r' as it
// comes (launcher/launcher.h).
bool launched_on_terminal() {
  const char* tty = std::getenv("DTRAIN_TTY");
  return tty != nullptr && std::string(tty) == "1";
}

// Fault injection (core/faults.h). KILL_AT_STEP / STOP_AT_STEP: SIGKILL / SIGSTOP that rank
// once <step> steps are done (and their checkpoint written), in the first attempt only
// (launcher restarts; TORCHELASTIC_RESTART_COUNT 0).
std::optional<faults::StepRank> kill_hook(const char* name) {
  const char* restarts = std::getenv("TORCHELASTIC_RESTART_COUNT");
  if (restarts != nullptr && std::string(restarts) != "0") return std::nullopt;
  return faults::step_rank(name);
}

// Where the flight recorder dumps (comm/flight_recorder.h): DTRAIN_FLIGHT_DIR, else the run's
// folder (the metrics file's, else the checkpoints'); "" (no dumps) when the run has none.
std::string flight_dir(const RunConfig& c) {
  if (const char* dir = std::getenv("DTRAIN_FLIGHT_DIR"); dir != nullptr && *dir) return dir;
  if (!c.logging.metrics_file.empty()) {
    const auto parent = std::filesystem::path(c.logging.metrics_file).parent_path();
    return parent.empty() ? "." : parent.string();
  }
  return c.checkpoint.dir;
}

// Each rank's compute per step in the window (the step time minus the time it was blocked
// waiting for collectives), gathered on every rank: a straggler computes longest, while the
// others wait for it. Returns "compute min/median/max a/b/c ms (slowest rank k)" on rank 0
// and adds the figures to `row`.
std::string straggler_report(comm::Communicator* comm, double compute_s, JsonObject& row) {
  if (comm == nullptr || comm->size() < 2) return {};
  at::Tensor mine = at::full({1}, compute_s, at::kDouble).to(comm->device());
  at::Tensor all = at::empty({comm->size()}, mine.options());
  comm->all_gather(mine, all).wait();
  all = all.cpu();
  std::vector<std::pair<double, int>> t;
  for (int r = 0; r < comm->size(); ++r) t.emplace_back(all[r].item<double>(), r);
  std::sort(t.begin(), t.end());
  const double median = t.size() % 2 ? t[t.size() / 2].first
                                     : (t[t.size() / 2 - 1].first + t[t.size() / 2].first) / 2;
  row.number("compute_min_s", t.front().first, "%.6f")
      .number("compute_median_s", median, "%.6f")
      .number("compute_max_s", t.back().first, "%.6f")
      .integer("slowest_rank", t.back().second);
  return ", compute min/median/max " + logging::fixed(t.front().first * 1000, 1) + "/" +
         logging::fixed(median * 1000, 1) + "/" + logging::fixed(t.back().first * 1000, 1) +
         " ms (slowest rank " + std::to_string(t.back().second) + ")";
}

// The mesh in the run's line: " over pp 2 x 2 data-parallel rank(s) x tp 2 (sequence
// parallel)"; empty without tp and pp.
std::string mesh_text(const ParallelConfig& p, int world) {
  if (p.tp == 1 && p.pp == 1) return "";
  return " over " + (p.pp > 1 ? "pp " + std::to_string(p.pp) + " x " : std::string()) +
         std::to_string(world / (p.tp * p.pp)) + " data-parallel rank(s)" +
         (p.tp > 1 ? " x tp " + std::to_string(p.tp) : std::string()) +
         (p.sequence_parallel ? " (sequence parallel)" : "");
}

// "transformer, mlp, llama".
std::string registered_model_list() {
  std::string list;
  for (const auto& n : registered_models()) list += (list.empty() ? "" : ", ") + n;
  return list;
}

// A token model's batches, as data.source says: synthetic tokens, a text corpus's bytes, or
// token files.
std::unique_ptr<BatchSource> make_token_source(const RunConfig& c, TokenShape shape,
                                               int64_t micro_batch, int world, int rank) {
  const uint64_t seed = static_cast<uint64_t>(c.data.seed);
  switch (c.data.source) {
    case DataSource::kCorpus:
      return std::make_unique<ByteCorpusSource>(c.data.path, shape.seq_len, micro_batch,
                                                c.train.micro_batches, world, rank, seed);
    case DataSource::kTokens:
      return std::make_unique<TokenFileSource>(
          c.data.path, c.data.dtype, c.data.val_path, shape.vocab_size, shape.seq_len, micro_batch,
          c.train.micro_batches, world, rank, seed, c.train.eval_samples, c.data.val_fraction);
    case DataSource::kSynthetic:
      break;
  }
  return std::make_unique<SyntheticLMSource>(shape.vocab_size, shape.seq_len, micro_batch, rank,
                                             seed);
}

// The mesh of a tensor- or pipeline-parallel run (parallel.tp or parallel.pp > 1), its layout
// logged; null otherwise.
std::shared_ptr<sharding::DeviceMesh> make_mesh(const RunConfig& c,
                                                const std::shared_ptr<comm::Communicator>& comm) {
  const int tp = static_cast<int>(c.parallel.tp), pp = static_cast<int>(c.parallel.pp);
  if (tp == 1 && pp == 1) return nullptr;
  const int world = comm ? comm->size() : 1;
  if (pp > 1) {
    DTRAIN_CHECK_AS(
        ConfigError, world % pp == 0, c.source, ": parallel.pp is ", pp, ", and the job has ",
        world, " rank(s), which do not split into ", pp,
        " pipeline stages: the mesh is pp x (data-parallel ranks) = the job's ranks. "
        "Start a multiple of ",
        pp, " ranks (dtrain-launch --nproc-per-node), or set parallel.pp to a divisor of ", world);
  }
  DTRAIN_CHECK_AS(
      ConfigError, world % tp == 0, c.source, ": parallel.tp is ", tp, ", and the job has ", world,
      " rank(s), which do not split into groups of ", tp,
      ": the mesh is (data-parallel ranks) x tp = the job's ranks. Start a multiple of ", tp,
      " ranks (dtrain-launch --nproc-per-node), or set parallel.tp to a divisor of ", world);
  DTRAIN_CHECK_AS(ConfigError, world % (tp * pp) == 0, c.source, ": parallel.pp x parallel.tp is ",
                  pp, " x ", tp, ", and the job has ", world,
                  " rank(s): the mesh is pp x (data-parallel ranks) x tp = the job's ranks. Start "
                  "a multiple of ",
                  pp * tp, " ranks (dtrain-launch --nproc-per-node)");
  const int dp = world / (tp * pp);
  sharding::MeshShape shape;
  shape.tp = tp;
  shape.pp = pp;
  const bool hybrid = c.parallel.strategy == ParallelStrategy::kFsdp &&
                      c.parallel.sharding_strategy == sharding::ShardingStrategy::kHybridShard;
  if (c.parallel.strategy == ParallelStrategy::kDdp ||
      (c.parallel.strategy == ParallelStrategy::kFsdp &&
       c.parallel.sharding_strategy == sharding::ShardingStrategy::kNoShard)) {
    shape.replicate = dp;
  } else if (hybrid && c.parallel.hybrid_group_size > 0 && dp % c.parallel.hybrid_group_size == 0) {
    shape.shard = static_cast<int>(c.parallel.hybrid_group_size);
    shape.replicate = dp / shape.shard;
  } else {
    shape.shard = dp;
  }
  auto mesh = std::make_shared<sharding::DeviceMesh>(comm, shape);
  for (const auto& line : mesh->describe()) logging::info(line);
  if (c.parallel.sequence_parallel) {
    logging::info("mesh: sequence parallel inside each tp group (parallel.sequence_parallel)");
  }
  const std::string across = mesh->tp_across_nodes();
  if (!across.empty()) {
    logging::warn("mesh: tensor-parallel groups span nodes (", across,
                  "): each layer's all-reduces then cross the network. Start a multiple of "
                  "parallel.tp ranks on every node (dtrain-launch --nproc-per-node)");
  }
  return mesh;
}

}  // namespace

std::shared_ptr<comm::Communicator> connect(const RunConfig& config) {
  check_device(config);
  comm::CommOptions co;
  co.backend = config.parallel.backend;
  co.device = torch_device(config.device);
  // DTRAIN_COMM_TIMEOUT_S, when set, wins over parallel.timeout_s (like DTRAIN_LOG_LEVEL): an
  // operator's knob that needs no config edit.
  if (std::getenv("DTRAIN_COMM_TIMEOUT_S") == nullptr) {
    co.timeout = std::chrono::milliseconds(static_cast<int64_t>(config.parallel.timeout_s * 1000));
  }
  auto info = comm::detect_rank_info(co.rendezvous);
  logging::configure(info.rank, {config.logging.level, config.logging.all_ranks});
  if (config.parallel.strategy == ParallelStrategy::kNone && info.world_size == 1) return nullptr;
  return comm::create_world(co);
}

TrainResult train(const RunConfig& c, std::shared_ptr<comm::Communicator> comm) {
  register_builtin_models();
  DTRAIN_CHECK_AS(ConfigError, !c.model.custom(), c.source,
                  ": model.type: custom is a model given in code, through "
                  "framework::train(module, data, loss, config, comm) (examples/); dtrain-train "
                  "trains a registered model (",
                  registered_model_list(), ")");
  const ModelSpec& spec = model_spec(c);
  DTRAIN_CHECK_AS(UsageError, spec.build != nullptr, "model.type ", spec.name,
                  " is registered without a builder in this program: it can be read and "
                  "estimated, not trained");
  const int rank = comm ? comm->rank() : 0;
  const int world = comm ? comm->size() : 1;
  const c10::DeviceType device = torch_device(c.device);
  // Before anything is allocated: refuse a run that cannot fit (a real OOM is the kernel's
  // killer). Host memory only; a CUDA run's device memory is not estimated here.
  check_supported(c, comm.get());
  if (device == c10::kCPU) {
    check_memory_fits(c, world, comm ? comm->local_size() : 1, available_memory_bytes());
    logging::info("memory: about ", estimate_memory(c, world).describe(), " per rank");
  }
  at::manual_seed(static_cast<uint64_t>(c.train.seed));  // identical init; DDP broadcasts anyway
  const int64_t micro_batch = c.train.batch_size / c.train.micro_batches;
  const uint64_t data_seed = static_cast<uint64_t>(c.data.seed);
  std::shared_ptr<sharding::DeviceMesh> mesh = make_mesh(c, comm);
  // Data goes by data-parallel rank: the ranks of a TP group take the same batches.
  const int dp_rank = mesh ? mesh->dp_rank() : rank, dp_size = mesh ? mesh->dp_size() : world;
  BuiltModel built;
  spec.build(BuildContext{c, comm, rank, world, device, micro_batch, data_seed, mesh}, built);
  DTRAIN_CHECK(built.task.make_strategy && built.task.loss, "model ", c.model.type,
               ": its build gave no strategy or no loss");
  if (spec.data == ModelData::kTokens) {
    DTRAIN_CHECK(built.data == nullptr, "model ", c.model.type,
                 ": a token model's data comes from the config (data.source), not its build");
    built.data =
        make_token_source(c, spec.tokens(*c.model.settings), micro_batch, dp_size, dp_rank);
  }
  DTRAIN_CHECK(built.data != nullptr, "model ", c.model.type, ": its build made no data source");
  return Trainer(c, comm, std::move(built.task), std::move(built.data)).train();
}

Trainer::Trainer(const RunConfig& config, std::shared_ptr<comm::Communicator> comm, Task task,
                 std::unique_ptr<BatchSource> data)
    : c_(config),
      comm_(std::move(comm)),
      task_(std::move(task)),
      data_(std::move(data)),
      rank_(comm_ ? comm_->rank() : 0),
      world_(comm_ ? comm_->size() : 1),
      device_(torch_device(config.device)),
      tty_(rank_ == 0 && config.logging.progress_bar && (::isatty(2) || launched_on_terminal())),
      monitor_(config.logging.numerics),
      checkpointer_(config),
      collapse_(config.precision.scaler),
      nonfinite_(config.train),
      spike_(config.train.spike_guard),
      kill_at_(kill_hook("KILL_AT_STEP")),
      nan_from_(faults::step_rank("NAN_FROM_STEP")),
      stop_at_(kill_hook("STOP_AT_STEP")),
      slow_(faults::step_rank("SLOW_RANK")),
      bad_batches_(faults::range("BAD_BATCHES", 1000.0)) {
  if (const auto skip = faults::range("SKIP_BATCHES", 0)) {
    spike_.skip_batches(skip->first - 1, skip->count);
  }
}

Trainer::~Trainer() = default;

void Trainer::setup() {
  DTRAIN_CHECK(!model_, "Trainer::setup: called twice");
  check_supported(c_, comm_.get());
  if (rank_ == 0) {  // once per job, not once per rank
    for (const auto& w : c_.warnings) logging::warn(c_.source, ": ", w);
    if (!c_.precision.chosen_by.empty()) logging::info(c_.precision.chosen_by);
    warn_if_oversubscribed(device_, comm_.get());
  }
  DTRAIN_CHECK_AS(ConfigError, c_.train.eval_every == 0 || c_.train.eval_samples >= world_,
                  c_.source, ": train.eval_samples (", c_.train.eval_samples,
                  ") must be at least the number of ranks (", world_,
                  "): every rank evaluates its share");
  agree_to_start(comm_.get(), rank_, world_, output_problem(c_, rank_));
  comm::flight::set_dump_dir(flight_dir(c_), rank_);
  // Misuse caught by default: from here (every rank agreed to start) through the first steps,
  // each collective is compared across ranks before it runs, so a rank that issues another one
  // gets an error naming both instead of garbage or an abort.
  const char* check = std::getenv("DTRAIN_COMM_CHECK");
  if (world_ > 1 && (check == nullptr || *check == '\0')) {
    comm::set_default_call_check(true);
    checking_calls_ = true;
    if (rank_ == 0) {
      logging::info(
          "collective check: every collective compared across ranks through setup "
          "and the first ",
          kCheckedSteps, " steps (DTRAIN_COMM_CHECK=1: always; 0: never)");
    }
  }
  model_ = task_.make_strategy(&monitor_);
  if (PipelineStrategy* pipeline = model_->pipeline()) {
    for (const auto& line : pipeline->describe()) logging::info(line);
  }
  logging::info("model ready: process peak RSS so far ", logging::fixed(peak_rss_mb(), 0),
                " MB (building, initializing and sharding the model)");
  opt_ = make_optimizer(c_.train, model_->parameters());
  if (c_.train.optimizer_in_backward) {
    // Each unit steps in backward; the step after it finds no gradient left, and does nothing.
    auto* fused = dynamic_cast<optim::GradScaling*>(opt_.get());
    DTRAIN_CHECK(fused != nullptr, "optimizer_in_backward: the optimizer cannot step a subset");
    model_->step_in_backward([fused](const std::vector<at::Tensor>& ps) { fused->step_only(ps); });
    logging::info(
        "the optimizer steps each FSDP unit in backward, as its gradients are reduced "
        "(train.optimizer_in_backward): no rank holds the whole gradient");
  }
  scaler_ = make_scaler(c_, comm_);
  const auto& sc = c_.precision.scaler;
  // DDP unscales and judges the gradients as it writes them back, so unscale_ makes no pass
  // of its own; under TP the scaler's own pass agrees on the verdict over every rank.
  if (sc.enabled && c_.parallel.tp == 1) model_->use_grad_scaler(scaler_.get());
  autocast_ = c_.precision.mixed.is_low_precision() && model_->uses_autocast();
  logging::info(
      "run: ", c_.source, ", ", task_.description.empty() ? "custom model" : task_.description,
      " on ", data_->describe(), ", ", world_, " rank(s), strategy ", name_of(c_.parallel.strategy),
      mesh_text(c_.parallel, world_), comm_ ? ", backend " + comm_->backend() : std::string(),
      ", precision ", name_of(c_.precision.policy), " ", c_.precision.mixed.to_string(),
      ", loss scaling ", sc.enabled ? "on" : "off");
  checkpointer_.set_job(job_record());
  if (checkpointer_.enabled() && c_.checkpoint.on_signal_s > 0) {
    preemption::install(c_.checkpoint.on_interrupt);
    stop_ = std::make_unique<StopAgreement>(comm_);
  }
  restore();
  metrics_.emplace(c_, rank_, first_step_,
                   JsonObject()
                       .string("config", c_.source)
                       .string("model", task_.description)
                       .string("strategy", name_of(c_.parallel.strategy))
                       .string("precision", name_of(c_.precision.policy))
                       .integer("ranks", world_)
                       .string("backend", comm_ ? comm_->backend() : std::string("none")));
  if (first_step_ > 0 && c_.train.eval_every > 0) {
    // The restored model's validation loss: the same number, at any world size, as the run
    // that wrote the checkpoint logged at this step.
    const double v = validation_loss();
    logging::info(
        "step ", first_step_,
        checkpointer_.data_changed() ? " (restored, on this run's other data)" : " (restored)",
        " val_loss ", logging::fixed(v, 6), perplexity_text(v));
    JsonObject row;
    row.integer("step", first_step_).number("val_loss", v);
    if (language_model()) row.number("val_ppl", std::exp(v), "%.6g");
    row.boolean("restored", true);
    if (checkpointer_.data_changed()) row.boolean("data_changed", true);
    metrics_->write(row);
  }
}

// What this run trains on, for the checkpoint (framework/checkpoint/checkpointer.h set_job).
std::map<std::string, std::string> Trainer::job_record() const {
  std::map<std::string, std::string> job;
  job["data"] = data_->fingerprint();
  job["data_what"] = data_->describe();
  if (c_.data.source == DataSource::kTokens) {
    job["tokenizer"] = tokenizer_fingerprint(c_.data.token_meta);
  }
  job["model"] = (task_.description.empty() ? std::string("custom model") : task_.description) +
                 " (model.type " + c_.model.type + ")";
  job["mesh"] = std::to_string(world_) + " rank(s), " + name_of(c_.parallel.strategy) +
                (c_.parallel.tp > 1 ? ", tp " + std::to_string(c_.parallel.tp) : std::string()) +
                (c_.parallel.pp > 1 ? ", pp " + std::to_string(c_.parallel.pp) : std::string()) +
                (c_.parallel.sequence_parallel ? ", sequence parallel" : "");
  for (auto it = job.begin(); it != job.end();) {
    it = it->second.empty() ? job.erase(it) : std::next(it);
  }
  return job;
}

void Trainer::restore() {
  const std::string& resume = c_.checkpoint.resume;
  if (!checkpointer_.enabled() && (resume == "auto" || resume == "never")) return;
  // A pipeline's ranks read the whole model and its optimizer state: each keeps its stages'.
  PipelineStrategy* pipeline = model_->pipeline();
  if (pipeline != nullptr) pipeline->hold_whole(true);
  const std::optional<TrainerProgress> p = checkpointer_.restore(checkpoint_parts(), resume);
  if (pipeline != nullptr) pipeline->drop_foreign_state(*opt_);
  if (!p) return;
  step_ = first_step_ = p->step;
  // Nothing left to train: said, not a "done" line over an empty run. A launcher's restart
  // of a run that had finished (TORCHELASTIC_RESTART_COUNT > 0) finishes again quietly.
  const char* restarts = std::getenv("TORCHELASTIC_RESTART_COUNT");
  const bool restarted = restarts != nullptr && std::string(restarts) != "0";
  DTRAIN_CHECK_AS(ConfigError, p->step < c_.train.steps || (p->step == c_.train.steps && restarted),
                  c_.source, ": train.steps is ", c_.train.steps, ", but the checkpoint resumed (",
                  resume == "auto" ? "the newest in " + c_.checkpoint.dir : resume, ") is at step ",
                  p->step, ": nothing is left to train. Raise train.steps above ", p->step,
                  " to train further, or start afresh with checkpoint.resume: never (or another "
                  "checkpoint.dir)");
  result_.skipped_steps = p->skipped_steps;
  nonfinite_.resume(p->nonfinite_run);
  collapse_.resume(p->consecutive_skips, monitor_);
  spike_.resume(p->spike, /*rollback=*/false);
  resume_data(*p);
  newest_checkpoint_ = checkpointer_.restored_dir();
  settle_each_step_ = trouble();
}

CheckpointParts Trainer::checkpoint_parts() {
  return {&model_->module(),
          model_->fsdp(),
          opt_.get(),
          scaler_.get(),
          &monitor_,
          comm_.get(),
          model_->tensor_parallel(),
          model_->ddp_reducer()};
}

// Forwards (training and validation) run under autocast in param_dtype when the policy
// computes in low precision and the strategy asks for it (Strategy::uses_autocast).
amp::AutocastGuard Trainer::autocast() const {
  return amp::AutocastGuard(
      device_,
      autocast_ ? std::optional<c10::ScalarType>(c_.precision.mixed.param_dtype) : std::nullopt,
      autocast_);
}

// A host batch onto the GPU without waiting: from pinned memory, non-blocking (PyTorch's
// DataLoader(pin_memory=True) and .to(non_blocking=True)); a pageable copy would wait for every
// kernel queued before it. The caching host allocator keeps the pinned buffer until the copy
// is done. A batch the data source hands out already pinned is copied waiting: the source may
// refill that buffer for the next batch while a non-blocking copy still reads it.
at::Tensor Trainer::to_device(const at::Tensor& t) const {
  if (device_ != c10::kCUDA || !t.is_cpu() || t.is_pinned()) return t.to(device_);
  return t.pin_memory().to(device_, /*non_blocking=*/true);
}

at::Tensor Trainer::forward_loss(const Batch& b) {
  amp::AutocastGuard ac = autocast();
  at::Tensor out = model_->forward(b.inputs);
  monitor_.record("model.output", out);
  return task_.loss(out, b);
}

// Mean loss over the validation set, the same number at any world size: every rank evaluates
// its share; sums and counts are added over the ranks.
double Trainer::validation_loss() {
  // In eval mode, as a PyTorch recipe runs validation (model.eval(), then model.train()): a
  // user's BatchNorm keeps its running statistics and uses them, and Dropout draws nothing.
  struct EvalMode {
    torch::nn::Module& m;
    const bool was_training = m.is_training();
    explicit EvalMode(torch::nn::Module& module) : m(module) { m.eval(); }
    ~EvalMode() {
      if (was_training) m.train();
    }
    EvalMode(const EvalMode&) = delete;
    EvalMode& operator=(const EvalMode&) = delete;
  } eval_mode(model_->module());
  // By data-parallel rank: a TP group or a pipeline evaluates one share (and adds it once per
  // rank, as it adds its count). Ranks are pp x (data-parallel) x tp, pp outermost.
  const int tp = static_cast<int>(c_.parallel.tp), pp = static_cast<int>(c_.parallel.pp);
  const int per_stage = world_ / pp;
  Batch b = data_->validation((rank_ % per_stage) / tp, per_stage / tp);
  b.inputs = b.inputs.to(device_);
  b.targets = b.targets.to(device_);
  c10::NoGradGuard no_grad;
  at::Tensor sum;
  double count = 0;
  if (PipelineStrategy* pipeline = model_->pipeline()) {
    // The last stage computes the sum, which reaches every rank of the pipeline.
    amp::AutocastGuard ac = autocast();
    const bool per_token = task_.per_token_validation;
    count = static_cast<double>(per_token ? b.targets.numel() : b.inputs.size(0));
    sum = pipeline->evaluate(b.inputs, [&](const at::Tensor& out) {
      return per_token ? model_->cross_entropy_sum(out, b.targets)
                       : task_.loss(out, b).to(at::kFloat) * count;
    });
  } else {
    amp::AutocastGuard ac = autocast();
    at::Tensor out = model_->forward(b.inputs);
    if (task_.per_token_validation) {  // per token: the mean over every target of the set
      sum = model_->cross_entropy_sum(out, b.targets);
      count = static_cast<double>(b.targets.numel());
    } else {
      count = static_cast<double>(b.inputs.size(0));
      sum = task_.loss(out, b).to(at::kFloat) * count;
    }
  }
  at::Tensor t = at::stack(
      {sum.to(at::kDouble).reshape({}), at::scalar_tensor(count, at::kDouble).to(sum.device())});
  if (comm_ && world_ > 1) {
    t = t.to(comm_->device());
    comm_->all_reduce(t, comm::ReduceOp::kSum).wait();
  }
  t = t.cpu();
  return t[0].item<double>() / t[1].item<double>();
}

Trainer::PendingStep Trainer::run_step() {
  DTRAIN_CHECK(model_ != nullptr, "Trainer::train_step: call setup() first");
  const auto t0 = Clock::now();
  const int64_t step = step_;  // 0-based here; the figures and the log count from 1
  const bool tracing = !c_.logging.trace.empty() && step + 1 >= c_.logging.trace_start &&
                       step + 1 < c_.logging.trace_start + c_.logging.trace_steps;
  trace::set_recording(tracing);
  const int64_t step_start_us = tracing ? trace::now_us() : 0;
  const int64_t micro_batches = c_.train.micro_batches;
  if (slow_ && slow_->rank == rank_) {  // DTRAIN_TEST_SLOW_RANK=<ms>:<rank>
    std::this_thread::sleep_for(std::chrono::milliseconds(slow_->step));
  }
  PendingStep s;
  s.step = step + 1;
  s.lr = lr_at(c_.train, step);
  monitor_.begin_step(step);
  for (auto& g : opt_->param_groups()) g.options().set_lr(s.lr);
  opt_->zero_grad(/*set_to_none=*/true);
  const auto on_device = at::TensorOptions(at::kDouble).device(device_);
  at::Tensor loss_sum = at::zeros({}, on_device);    // this rank's, over the micro-batches
  const int64_t data_step = spike_.data_step(step);  // step, less any skipped batches
  auto injected = [&](at::Tensor loss) {
    // Fault injection: NAN_FROM_STEP makes that rank's loss NaN from <step> (1-based) on.
    if (nan_from_ && nan_from_->step >= 1 && s.step >= nan_from_->step &&
        rank_ == nan_from_->rank) {
      loss = loss * std::numeric_limits<double>::quiet_NaN();
    }
    // Fault injection: BAD_BATCHES, batches whose loss spikes (on every rank).
    if (bad_batches_ && data_step + 1 >= bad_batches_->first &&
        data_step + 1 < bad_batches_->first + bad_batches_->count) {
      loss = loss * bad_batches_->factor;
    }
    return loss;
  };
  PipelineStrategy* pipeline = model_->pipeline();
  if (pipeline != nullptr) {
    // Every rank of a pipeline reads the same micro-batches: its first stage the inputs, its
    // last the targets. The schedule runs every forward and backward (traced by action).
    std::vector<Batch> batches;
    for (int64_t m = 0; m < micro_batches; ++m) {
      Batch b = data_->next(data_step, m);
      b.inputs = to_device(b.inputs);
      b.targets = to_device(b.targets);
      batches.push_back(std::move(b));
    }
    // Only the last stage scales a loss; every stage unscales its gradients, so each rank's
    // scaler holds its scale (lazily made by scale(), as PyTorch's).
    if (scaler_->is_enabled()) (void)scaler_->scale(at::zeros({}, on_device));
    amp::AutocastGuard ac = autocast();
    loss_sum = pipeline->train(
        batches,
        [&](int m, const at::Tensor& out) {
          monitor_.record("model.output", out);
          return injected(task_.loss(out, batches[static_cast<size_t>(m)]) /
                          static_cast<double>(micro_batches));
        },
        [&](const at::Tensor& loss) { return scaler_->scale(loss); });
  }
  for (int64_t m = 0; pipeline == nullptr && m < micro_batches; ++m) {
    Batch b = data_->next(data_step, m);
    b.inputs = to_device(b.inputs);
    b.targets = to_device(b.targets);
    // Every micro-batch but the last accumulates locally.
    std::optional<sharding::NoSyncGuard> local =
        m + 1 < micro_batches ? model_->no_sync() : std::nullopt;
    at::Tensor loss;
    {
      std::optional<trace::Scope> span;
      if (tracing) span.emplace("forward " + std::to_string(m), "compute");
      loss = injected(forward_loss(b) / static_cast<double>(micro_batches));
    }
    {
      std::optional<trace::Scope> span;
      if (tracing) span.emplace("backward " + std::to_string(m), "compute");
      scaler_->scale(loss).backward();
    }
    loss_sum.add_(loss.detach().reshape({}).to(on_device));
  }
  loss_sum = loss_sum.to(on_device);
  {
    std::optional<trace::Scope> span;
    if (tracing) span.emplace("optimizer", "compute");
    model_->finish_backward();  // sequence parallelism: the norms' gradients over the TP group
    scaler_->unscale_(*opt_);
    const at::Tensor grad_norm = model_->clip_grad_norm(c_.train.clip_grad_norm);
    // Without loss scaling the scale is 1 and nothing is found: made on the device, so that no
    // host value is copied in.
    const bool scaling = scaler_->is_enabled();
    const at::Tensor scale_used = scaling ? scaler_->scale_tensor() : at::ones({}, on_device);
    const at::Tensor found_inf = scaler_->step_deferred(*opt_);
    scaler_->update();
    auto figure = [&](const at::Tensor& t) { return t.reshape({}).to(on_device); };
    s.figures = at::stack({loss_sum, figure(grad_norm), figure(scale_used),
                           scaling ? figure(found_inf) : at::zeros({}, on_device),
                           scaling ? figure(scaler_->scale_tensor()) : scale_used});
  }
  if (tracing) {
    trace::complete("step " + std::to_string(s.step), "step", trace::kMain, step_start_us,
                    trace::now_us());
    trace::set_recording(false);
  }
  step_ = s.step;
  s.seconds = seconds_since(t0);
  return s;
}

// A guard is counting: the run's figures are read after every step until a clean one.
bool Trainer::trouble() const {
  return save_owed_ || (c_.precision.scaler.enabled ? collapse_.skips() > 0 : nonfinite_.run() > 0);
}

StepStats Trainer::settle() {
  DTRAIN_CHECK(!pending_.empty(), "Trainer::settle: no step taken since the last read");
  const auto t0 = Clock::now();
  std::vector<at::Tensor> rows;
  rows.reserve(pending_.size());
  for (const auto& p : pending_) rows.push_back(p.figures);
  const at::Tensor figures = at::stack(rows).cpu().contiguous();  // the one host read
  // On a GPU the host ran ahead of the device; the read waited for it, within these steps.
  window_time_ += seconds_since(t0);
  const double* f = figures.data_ptr<double>();
  std::vector<StepStats> steps;
  for (size_t i = 0; i < pending_.size(); ++i, f += 5) {
    StepStats s;
    s.step = pending_[i].step;
    s.lr = pending_[i].lr;
    s.seconds = pending_[i].seconds;
    s.loss = f[0];
    s.grad_norm = f[1];
    s.scale_used = f[2];
    s.stepped = f[3] == 0;
    s.scale = f[4];
    steps.push_back(s);
  }
  pending_.clear();
  if (spike_.on()) {
    std::vector<double> losses;
    std::vector<bool> stepped;
    for (const auto& s : steps) {
      losses.push_back(s.loss);
      stepped.push_back(s.stepped);
    }
    for (const auto& spike : spike_.after_steps(steps.front().step, losses, stepped, comm_.get())) {
      if (spike_.rolls_back()) {
        roll_back(spike);
        StepStats now = steps.back();
        now.step = step_;
        now.rolled_back = true;
        return now;
      }
      if (tty_) std::fprintf(stderr, "\r\033[K");
      logging::warn(spike_text(spike),
                    " (train.spike_guard). With checkpoints, train.spike_guard.action: rollback "
                    "goes back past a spike and skips its batches; a lower train.lr or "
                    "train.clip_grad_norm may prevent it");
      JsonObject row;
      row.integer("step", spike.last)
          .boolean("spike", true)
          .integer("spike_from", spike.first)
          .number("loss", spike.loss)
          .number("median", spike.median);
      metrics_->write(row);
    }
  }
  // Under rollback a non-finite loss is a spike step, which train.spike_guard judges.
  if (!c_.precision.scaler.enabled && !spike_.rolls_back()) {
    std::vector<double> losses;
    for (const auto& s : steps) losses.push_back(s.loss);
    nonfinite_.after_steps(steps.front().step - 1, losses, comm_.get(), monitor_);
  }
  for (const auto& s : steps) {
    monitor_.record_scale(s.step - 1, s.scale);
    if (!s.stepped) {
      ++result_.skipped_steps;
      if (tty_) std::fprintf(stderr, "\r\033[K");
      logging::warn("step ", s.step, ": inf/NaN gradients, step skipped; loss scale ", s.scale_used,
                    " -> ", s.scale);
      if (c_.logging.numerics) logging::warn(monitor_.report());
    }
    if (c_.precision.scaler.enabled) collapse_.after_step(s.step - 1, s.stepped, s.scale, monitor_);
    window_loss_ += s.loss;
    window_time_ += s.seconds;
    ++window_steps_;
  }
  settle_each_step_ = trouble();
  return steps.back();
}

// "step 13: loss spike: the loss (...) has been above 2x the median ... since step 12"
std::string Trainer::spike_text(const SpikeGuard::Spike& spike) const {
  std::ostringstream o;
  o << "step " << spike.last << ": loss spike: the loss (" << logging::fixed(spike.loss, 4)
    << ", over ranks) has been above " << c_.train.spike_guard.factor
    << "x the median of the last steps (" << logging::fixed(spike.median, 4) << ") since step "
    << spike.first;
  return o.str();
}

// The data goes on from where the checkpoint left it, at this run's world size: the same
// samples as from its step alone when the world is the checkpoint's, and at another world
// (a job resized between restarts) the rest of the epoch once, none repeated or skipped.
void Trainer::resume_data(const TrainerProgress& p) {
  if (p.data) data_->resume_at(p.data_step, *p.data);
}

void Trainer::roll_back(const SpikeGuard::Spike& spike) {
  const int64_t from = step_;
  checkpointer_.finish();                           // a save still being written (checkpoint.async)
  std::string skipped;                              // 1-based, as the log counts steps
  for (int64_t d : spike_.roll_back_past(spike)) {  // stops the run when spikes keep coming
    skipped += (skipped.empty() ? "" : ", ") + std::to_string(d + 1);
  }
  DTRAIN_CHECK(!newest_checkpoint_.empty(), "step ", spike.last, ": loss spike since step ",
               spike.first,
               ", and this run has no checkpoint before it to roll back to "
               "(train.spike_guard.action: rollback); stopping. checkpoint.every_steps below ",
               spike.first, " gives it one");
  PipelineStrategy* pipeline = model_->pipeline();
  if (pipeline != nullptr) pipeline->hold_whole(true);
  const std::optional<TrainerProgress> p =
      checkpointer_.restore(checkpoint_parts(), newest_checkpoint_);
  if (pipeline != nullptr) pipeline->drop_foreign_state(*opt_);
  DTRAIN_CHECK(p && p->step < spike.first, "roll back: the checkpoint '", newest_checkpoint_,
               "' is not before the spike's first step ", spike.first);
  step_ = p->step;
  result_.skipped_steps = p->skipped_steps;
  nonfinite_.resume(p->nonfinite_run);
  collapse_.resume(p->consecutive_skips, monitor_);
  spike_.resume(p->spike, /*rollback=*/true);
  resume_data(*p);
  window_loss_ = window_time_ = window_wait_ = 0;
  window_steps_ = 0;
  save_owed_ = false;
  settle_each_step_ = trouble();
  if (tty_) std::fprintf(stderr, "\r\033[K");
  logging::warn(spike_text(spike), "; rolled back from step ", from, " to the checkpoint of step ",
                step_, ", skipping the batches of data step(s) ", skipped, " (rollback ",
                spike_.record().spikes.size(), " of at most ", c_.train.spike_guard.max_rollbacks,
                ", train.spike_guard)");
  JsonObject row;
  row.integer("step", step_)
      .boolean("rolled_back", true)
      .integer("rolled_back_from", from)
      .integer("spike_from", spike.first)
      .integer("spike_to", spike.last)
      .number("loss", spike.loss)
      .number("median", spike.median)
      .string("skipped_batches", skipped);
  metrics_->write(row);
}

StepStats Trainer::train_step() {
  pending_.push_back(run_step());
  return settle();
}

// Validation perplexity, exp(the mean cross-entropy per token), for the config's language
// model; a classifier's or a user's loss has no tokens to speak of.
bool Trainer::language_model() const {
  if (!task_.per_token_validation || c_.model.custom()) return false;
  const ModelSpec* spec = find_model(c_.model.type);
  return spec != nullptr && spec->data == ModelData::kTokens;
}

std::string Trainer::perplexity_text(double val_loss) const {
  return language_model() ? " val_ppl " + logging::fixed(std::exp(val_loss), 2) : std::string();
}

// One line in the log and one row in the metrics file for the steps since the last logged
// one (the loss is their mean, over ranks too). Collective (the mean).
void Trainer::log_step(const StepStats& s, std::optional<double> val_loss) {
  const double loss = mean_over_ranks(comm_.get(), window_loss_ / window_steps_);
  if (!first_logged_) {
    result_.first_loss = loss;
    first_logged_ = true;
  }
  result_.last_loss = loss;
  const double avg_time = window_time_ / window_steps_;
  const double tokens_per_s = world_ / (c_.parallel.tp * c_.parallel.pp) * c_.train.batch_size *
                              data_->items_per_sample() / avg_time;
  JsonObject row;
  const std::string spread = straggler_report(
      comm_.get(), std::max(0.0, window_time_ - window_wait_) / static_cast<double>(window_steps_),
      row);
  const sharding::ReducerStats* rs = model_->stats();
  if (tty_) std::fprintf(stderr, "\r\033[K");  // the bar gives way to the line
  logging::info(
      "step ", s.step, "/", c_.train.steps, " loss ", logging::fixed(loss, 4),
      val_loss ? " val_loss " + logging::fixed(*val_loss, 4) + perplexity_text(*val_loss)
               : std::string(),
      " scale ", s.scale, " grad_norm ", logging::fixed(s.grad_norm, 3), " skipped ",
      result_.skipped_steps, " lr ", s.lr, " tokens/s ", logging::fixed(tokens_per_s, 0), " step ",
      logging::fixed(avg_time * 1000, 1), " ms", spread,
      rs ? " comm hidden " + logging::fixed(100 * rs->hidden_fraction(), 0) + "%" : std::string(),
      " peak_rss ", logging::fixed(peak_rss_mb(), 0), " MB",
      tty_ ? "" : "  " + progress_bar(s.step, c_.train.steps));
  row.integer("step", s.step)
      .number("loss", loss)
      .number("scale", s.scale)
      .number("grad_norm", s.grad_norm, "%.6g")
      .integer("skipped", result_.skipped_steps)
      .number("lr", s.lr, "%.6g")
      .number("tokens_per_s", tokens_per_s, "%.1f")
      .number("step_time_s", avg_time, "%.6f")
      .number("comm_hidden", rs ? rs->hidden_fraction() : 1.0, "%.4f")
      .number("peak_rss_mb", peak_rss_mb(), "%.1f");
  if (val_loss) row.number("val_loss", *val_loss);
  if (val_loss && language_model()) row.number("val_ppl", std::exp(*val_loss), "%.6g");
  metrics_->write(row);
  window_loss_ = window_time_ = 0;
  window_steps_ = 0;
  window_wait_ = 0;
}

// On a terminal, the bar under the log lines. Otherwise (under dtrain-launch, mpirun, into a
// file) a line with the rate and the time left when logging.progress_every_s has passed since
// rank 0's last line, so that a slow run never looks hung between logged steps.
void Trainer::show_progress(int64_t step, bool logged) {
  if (tty_) {
    std::fprintf(stderr, "\r%s ", progress_bar(step, c_.train.steps).c_str());
    return;
  }
  if (rank_ != 0 || !c_.logging.progress_bar) return;
  const auto now = Clock::now();
  if (logged) {
    last_line_ = now;
    return;
  }
  if (std::chrono::duration<double>(now - last_line_).count() < c_.logging.progress_every_s) {
    return;
  }
  last_line_ = now;
  const double rate = static_cast<double>(step - first_step_) / seconds_since(train_start_);
  const auto left = static_cast<int64_t>(static_cast<double>(c_.train.steps - step) / rate);
  char eta[32];
  std::snprintf(eta, sizeof(eta), "%lld:%02lld", static_cast<long long>(left / 60),
                static_cast<long long>(left % 60));
  logging::info("progress: step ", step, "/", c_.train.steps, ", ",
                logging::fixed(rate, rate < 10 ? 2 : 1), " step/s, ", eta, " left");
}

void Trainer::save_checkpoint(const StepStats& s, bool background) {
  const auto t = Clock::now();
  background = background && c_.checkpoint.async;
  TrainerProgress progress{s.step,           result_.skipped_steps, s.lr, collapse_.skips(),
                           nonfinite_.run(), spike_.record()};
  progress.data_step = spike_.data_step(s.step);  // the next step's
  progress.data = data_->position(progress.data_step);
  // A full checkpoint of a pipeline: rank 0, which writes it, holds the whole model and
  // optimizer state while it is staged, its own stages' alone again after.
  PipelineStrategy* pipeline = model_->pipeline();
  if (pipeline != nullptr) pipeline->share(opt_.get(), /*to_first=*/true);
  const std::string path = checkpointer_.save(checkpoint_parts(), progress, background);
  if (pipeline != nullptr) pipeline->drop_foreign_state(*opt_);
  newest_checkpoint_ = path;
  if (tty_) std::fprintf(stderr, "\r\033[K");
  if (background) {
    logging::info("checkpoint ", path, " staged in ", logging::fixed(seconds_since(t), 2),
                  " s; written in the background (checkpoint.async)");
  } else {
    logging::info("checkpoint ", path, " written in ", logging::fixed(seconds_since(t), 2), " s");
  }
}

// Every rank agreed to stop after this step: a checkpoint within checkpoint.on_signal seconds
// (or the previous complete one stands), then the caller exits with kRequeueExitCode.
void Trainer::stop_on_signal(int sig, const StepStats& s, bool saved_already) {
  const double limit = c_.checkpoint.on_signal_s;
  if (tty_) std::fprintf(stderr, "\r\033[K");
  logging::warn(preemption::signal_name(sig), " received: saving a checkpoint at step ", s.step,
                " (within ", limit, " s, checkpoint.on_signal), then exiting with code ",
                kRequeueExitCode, " for the job to be requeued");
  // A save that outlives the limit would be killed half-written anyway: the previous complete
  // checkpoint stands, and the exit says so.
  std::atomic<bool> saved{false};
  std::thread watchdog([&saved, limit, step = s.step] {
    const auto deadline =
        Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(limit * 1000));
    while (!saved && Clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (saved) return;
    logging::error("the checkpoint of step ", step, " did not finish within ", limit,
                   " s (checkpoint.on_signal): exiting without it; the newest complete one "
                   "stands");
    std::fflush(stdout);
    std::fflush(stderr);
    std::_Exit(kRequeueExitCode);
  });
  try {
    if (saved_already) {  // this step's own save, maybe still being written: finished
      checkpointer_.finish();
      if (comm_ && world_ > 1) comm_->barrier().wait();
    } else {
      save_checkpoint(s, /*background=*/false);
    }
  } catch (...) {
    saved = true;
    watchdog.join();
    throw;
  }
  saved = true;
  watchdog.join();
  stop_->drain();
  result_.preempted_by = sig;
}

TrainResult Trainer::train() {
  if (!model_) setup();
  const bool trace_on = !c_.logging.trace.empty();
  if (trace_on) {
    // The time origin of every rank's timeline, taken as they leave a barrier.
    if (comm_ && world_ > 1) comm_->barrier().wait();
    trace::configure(rank_);
  }
  const int64_t steps = c_.train.steps;
  train_start_ = last_line_ = Clock::now();
  while (step_ < steps) {
    const double waited = comm::host_wait_seconds();
    pending_.push_back(run_step());
    window_wait_ += comm::host_wait_seconds() - waited;
    const int64_t step = step_;
    const bool last = step == steps;
    const bool evaluate = c_.train.eval_every > 0 && (step % c_.train.eval_every == 0 || last);
    const bool logged =
        step % c_.logging.every_steps == 0 || last || step == first_step_ + 1 || evaluate;
    bool due = checkpointer_.enabled() &&
               ((c_.checkpoint.every_steps > 0 && step % c_.checkpoint.every_steps == 0) || last ||
                save_owed_);
    // The figures are read when something needs them; the guards judge them then.
    std::optional<StepStats> s;
    if (logged || due || settle_each_step_) s = settle();
    if (s && s->rolled_back) {  // train.spike_guard: back at an earlier step
      if (stop_) {
        if (const std::optional<int> sig = stop_->poll()) {
          stop_on_signal(*sig, *s, /*saved=*/true);  // the checkpoint rolled back to stands
          break;
        }
      }
      continue;
    }
    if (due && !last && spike_.rolls_back() && spike_.in_streak()) {
      // A checkpoint now could hold a spike that a rollback must go back past.
      if (!save_owed_) {
        logging::info("checkpoint of step ", step, " postponed: the loss has been above ",
                      c_.train.spike_guard.factor, "x its median since step ",
                      spike_.streak_start(),
                      " (train.spike_guard); saved at the first step that is not a spike");
      }
      save_owed_ = true;
      settle_each_step_ = true;
      due = false;
    } else if (due) {
      save_owed_ = false;
    }
    std::optional<double> val_loss;
    if (evaluate) val_loss = validation_loss();
    if (logged) log_step(*s, val_loss);
    show_progress(step, logged);
    if (due) save_checkpoint(*s, /*background=*/!last);
    if (stop_) {
      if (const std::optional<int> sig = stop_->poll()) {
        if (!s) s = settle();
        stop_on_signal(*sig, *s, /*saved=*/due);
        break;
      }
    }
    if (kill_at_ && step == kill_at_->step && rank_ == kill_at_->rank) {
      logging::warn("DTRAIN_TEST_KILL_AT_STEP: rank ", rank_, " kills itself after step ",
                    step - 1);
      std::raise(SIGKILL);
    }
    if (stop_at_ && step == stop_at_->step && rank_ == stop_at_->rank) {
      logging::warn("DTRAIN_TEST_STOP_AT_STEP: rank ", rank_, " stops itself after step ", step);
      std::raise(SIGSTOP);
    }
    if (checking_calls_ && step >= first_step_ + kCheckedSteps) {  // every rank, this step
      comm::set_default_call_check(false);
      checking_calls_ = false;
    }
  }
  if (checking_calls_) {
    comm::set_default_call_check(false);
    checking_calls_ = false;
  }
  if (tty_) std::fprintf(stderr, "\n");
  checkpointer_.finish();  // a save still being written (checkpoint.async)
  if (trace_on) write_trace(c_, comm_.get(), rank_, world_);
  if (result_.preempted_by != 0) {
    result_.steps = step_;
    logging::info("stopped after step ", step_, " of ", c_.train.steps, " on ",
                  preemption::signal_name(result_.preempted_by),
                  ", checkpoint saved: resume with "
                  "the same command (checkpoint.resume: auto)");
    return result_;
  }
  report();
  return result_;
}

void Trainer::report() {
  result_.steps = c_.train.steps;
  log_parameters_agree(*model_, comm_.get());
  if (task_.on_finish) task_.on_finish(*model_);
  // A language model's greedy continuation: text for byte data (the prompt "The "), token
  // ids after the first validation tokens otherwise (token files carry no tokenizer).
  if (language_model() && first_step_ < c_.train.steps && c_.logging.sample_tokens > 0) {
    const TokenShape shape = model_spec(c_).tokens(*c_.model.settings);
    const bool bytes = c_.data.source == DataSource::kCorpus;
    std::vector<int64_t> prompt = {'T', 'h', 'e', ' '};
    if (!bytes) {
      const at::Tensor first = data_->validation(0, 1).inputs[0].to(at::kLong).cpu().contiguous();
      prompt.assign(first.data_ptr<int64_t>(),
                    first.data_ptr<int64_t>() + std::min<int64_t>(4, first.numel()));
    }
    const auto tokens =
        sample_tokens(*model_, device_, shape.seq_len, prompt, c_.logging.sample_tokens);
    if (bytes) {
      logging::info("sample: \"", printable_bytes(tokens), "\"");
    } else {
      std::string ids;
      for (size_t i = 0; i < tokens.size(); ++i) {
        ids += (i == 0 ? "" : i == prompt.size() ? " | " : " ") + std::to_string(tokens[i]);
      }
      logging::info("sample (token ids; prompt | greedy continuation): ", ids);
    }
  }
  result_.final_scale = scaler_->get_scale();
  // Each rank's peak beside the estimate it started with (rank 0 prints the table).
  log_peak_memory(c_, comm_.get());
  logging::info("done: ", result_.steps, " steps, loss ", logging::fixed(result_.first_loss, 4),
                " -> ", logging::fixed(result_.last_loss, 4), ", ", result_.skipped_steps,
                " skipped");
}

}  // namespace dtrain::framework
