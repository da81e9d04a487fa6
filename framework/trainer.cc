#include "framework/trainer.h"

#include <ATen/ATen.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>

#include "amp/autocast.h"
#include "amp/grad_scaler.h"
#include "amp/numerics.h"
#include "amp/sharded_grad_scaler.h"
#include "comm/factory.h"
#include "comm/rendezvous.h"
#include "core/error.h"
#include "core/faults.h"
#include "core/logging.h"
#include "core/trace.h"
#include "framework/checkpoint.h"
#include "framework/checkpoint_io.h"
#include "framework/data.h"
#include "framework/memory.h"
#include "framework/memory_estimate.h"
#include "framework/models/mlp.h"
#include "framework/models/transformer_lm.h"
#include "optim/fused.h"
#include "sharding/clip_grad.h"
#include "sharding/ddp.h"
#include "sharding/fsdp.h"

namespace dtrain::framework {
namespace {

using internal::Model;

using Clock = std::chrono::steady_clock;

double peak_rss_mb() {
  rusage r{};
  getrusage(RUSAGE_SELF, &r);
  return r.ru_maxrss / 1024.0;
}

double lr_at(const TrainConfig& t, int64_t step) {
  if (t.warmup_steps > 0 && step < t.warmup_steps) {
    return t.lr * static_cast<double>(step + 1) / static_cast<double>(t.warmup_steps);
  }
  double span = std::max<int64_t>(1, t.steps - t.warmup_steps);
  double progress = std::min(1.0, static_cast<double>(step - t.warmup_steps) / span);
  return t.lr * (0.1 + 0.9 * 0.5 * (1.0 + std::cos(M_PI * progress)));
}

std::string progress_bar(int64_t done, int64_t total, int width = 30) {
  int filled = static_cast<int>(width * done / std::max<int64_t>(1, total));
  return "[" + std::string(filled, '#') + std::string(width - filled, '.') + "] " +
         std::to_string(done) + "/" + std::to_string(total);
}

// ",\"key\":<value with every digit>" for JSON lines (losses compared bitwise across runs).
// `prefix` then v in `format`; a non-finite v (a diverged loss) is JSON's null, since JSON
// has no nan or inf.
std::string json_number(const char* prefix, double v, const char* format = "%.17g") {
  char buf[96];
  int n = std::snprintf(buf, sizeof(buf), "%s", prefix);
  if (std::isfinite(v)) {
    std::snprintf(buf + n, sizeof(buf) - n, format, v);
  } else {
    std::snprintf(buf + n, sizeof(buf) - n, "null");
  }
  return buf;
}

// Rank 0's metrics file. A resumed run keeps the rows up to its checkpoint's step (a crashed
// attempt may have logged beyond it) and appends.
// The first row describes the run (for plot titles and legends): {"run": {...}}.
std::ofstream open_metrics(const RunConfig& c, int rank, int64_t resumed_at,
                           const std::string& run_json) {
  std::ofstream metrics;
  if (rank != 0 || c.logging.metrics_file.empty()) return metrics;
  const std::string& path = c.logging.metrics_file;
  std::vector<std::string> kept;
  if (resumed_at > 0) {
    std::ifstream in(path);
    for (std::string line; std::getline(in, line);) {
      const auto at = line.find("\"step\":");
      if (at != std::string::npos && std::atoll(line.c_str() + at + 7) <= resumed_at) {
        kept.push_back(line);
      }
    }
  }
  std::error_code ec;
  auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  metrics.open(path, std::ios::trunc);
  DTRAIN_CHECK_AS(ConfigError, static_cast<bool>(metrics), c.source,
                  ": logging.metrics_file: cannot write '", path, "': ", std::strerror(errno),
                  "; choose a writable place");
  metrics << "{\"run\":" << run_json << "}\n";
  for (const auto& line : kept) metrics << line << "\n";
  return metrics;
}

// The step timeline: every rank's events gathered to rank 0, which writes one Chrome
// trace-event file (core/trace.h). Collective: every rank calls it.
void write_trace(const RunConfig& c, comm::Communicator* comm, int rank, int world) {
  const std::string mine = trace::take_events_json();
  std::vector<std::string> all{mine};
  if (comm != nullptr && world > 1) {
    const auto on = [&](at::ScalarType t) { return at::TensorOptions(t).device(comm->device()); };
    at::Tensor lens = at::empty({world}, on(at::kLong));
    comm->all_gather(at::full({1}, static_cast<int64_t>(mine.size()), on(at::kLong)), lens).wait();
    lens = lens.cpu();
    const int64_t longest = lens.max().item<int64_t>();
    at::Tensor buf = at::zeros({std::max<int64_t>(1, longest)}, at::kByte);
    std::memcpy(buf.data_ptr(), mine.data(), mine.size());
    at::Tensor out = at::empty({buf.numel() * world}, on(at::kByte));
    comm->all_gather(buf.to(comm->device()), out).wait();
    out = out.cpu();
    all.clear();
    for (int r = 0; r < world; ++r) {
      all.emplace_back(static_cast<const char*>(out.data_ptr()) + r * buf.numel(),
                       lens[r].item<int64_t>());
    }
  }
  if (rank != 0) return;
  const std::string& path = c.logging.trace;
  std::error_code ec;
  auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  std::ofstream f(path, std::ios::trunc);
  DTRAIN_CHECK_AS(ConfigError, static_cast<bool>(f), c.source, ": logging.trace: cannot write '",
                  path, "': ", std::strerror(errno), "; choose a writable place");
  f << "{\"traceEvents\":[";
  for (int r = 0; r < world; ++r) f << (r ? "," : "") << all[r];
  f << "],\"displayTimeUnit\":\"ms\",\"otherData\":{\"config\":\"" << trace::json_escape(c.source)
    << "\",\"strategy\":\"" << c.parallel.strategy << "\",\"precision\":\"" << c.precision.policy
    << "\",\"ranks\":" << world << ",\"first_step\":" << c.logging.trace_start
    << ",\"steps\":" << c.logging.trace_steps << "}}\n";
  f.close();
  logging::info("trace: ", path, " (steps ", c.logging.trace_start, "-",
                c.logging.trace_start + c.logging.trace_steps - 1,
                ", every rank; open it in Perfetto or chrome://tracing, or scripts/plot it)");
}

double mean_over_ranks(comm::Communicator* comm, double v) {
  if (comm == nullptr || comm->size() == 1) return v;
  at::Tensor t = at::full({1}, v, at::TensorOptions().dtype(at::kDouble).device(comm->device()));
  comm->all_reduce(t, comm::ReduceOp::kAvg).wait();
  return t.item<double>();
}

// Mean per-token loss over the validation set, the same number at any world size: every rank
// evaluates its share; sums and counts are added over the ranks.
double validation_loss(Model& model, BatchSource& data, comm::Communicator* comm,
                       c10::DeviceType device, bool autocast, c10::ScalarType compute) {
  const int rank = comm ? comm->rank() : 0, world = comm ? comm->size() : 1;
  Batch b = data.validation(rank, world);
  b.inputs = b.inputs.to(device);
  b.targets = b.targets.to(device);
  c10::NoGradGuard no_grad;
  std::pair<at::Tensor, double> sum;
  {
    amp::AutocastGuard ac(device, autocast ? std::optional<c10::ScalarType>(compute) : std::nullopt,
                          autocast);
    sum = model.loss_sum(b);
  }
  at::Tensor t = at::stack({sum.first.to(at::kDouble).reshape({}),
                            at::scalar_tensor(sum.second, at::kDouble).to(sum.first.device())});
  if (comm != nullptr && world > 1) {
    t = t.to(comm->device());
    comm->all_reduce(t, comm::ReduceOp::kSum).wait();
  }
  t = t.cpu();
  return t[0].item<double>() / t[1].item<double>();
}

// Greedy decoding from a prompt (byte vocabulary): what the model has learned, in words. Every
// rank runs it (FSDP's forwards are collective); rank 0 prints.
std::string sample_text(Model& model, c10::DeviceType device, int64_t seq_len, int64_t count) {
  c10::NoGradGuard no_grad;
  std::vector<int64_t> tokens = {'T', 'h', 'e', ' '};
  for (int64_t i = 0; i < count; ++i) {
    const int64_t start = std::max<int64_t>(0, static_cast<int64_t>(tokens.size()) - seq_len);
    at::Tensor in =
        at::tensor(std::vector<int64_t>(tokens.begin() + start, tokens.end()), at::kLong)
            .unsqueeze(0)
            .to(device);
    at::Tensor logits = model.logits(in);
    tokens.push_back(logits[0][-1].argmax().item<int64_t>());
  }
  std::string text;
  for (int64_t t : tokens)
    text += (t >= 32 && t < 127) ? static_cast<char>(t) : (t == '\n' ? ' ' : '?');
  return text;
}

// A checksum of every parameter's bytes (full values), gathered: ranks hold bitwise the same
// model, or the run says which do not.
void check_parameters_agree(Model& model, comm::Communicator* comm) {
  std::vector<at::Tensor> full;
  if (auto* f = model.fsdp()) {
    for (auto& [name, t] : f->full_parameters()) full.push_back(t);
  } else {
    for (const auto& t : model.module().parameters()) full.push_back(t.detach());
  }
  ckpt::Hasher hash;
  for (const auto& t : full) {
    at::Tensor c = t.cpu().contiguous();
    hash.update(static_cast<const char*>(c.data_ptr()), c.nbytes());
  }
  const int64_t sum = static_cast<int64_t>(hash.digest());
  std::vector<int64_t> all{sum};
  if (comm != nullptr && comm->size() > 1) {
    at::Tensor in = at::full({1}, sum, at::kLong).to(comm->device());
    at::Tensor out = at::empty({comm->size()}, at::TensorOptions(at::kLong).device(comm->device()));
    comm->all_gather(in, out).wait();
    out = out.cpu();
    all.assign(out.data_ptr<int64_t>(), out.data_ptr<int64_t>() + out.numel());
  }
  if (std::all_of(all.begin(), all.end(), [&](int64_t v) { return v == all.front(); })) {
    logging::info("parameters identical on all ", all.size(), " rank(s) (xxh64 ",
                  ckpt::hex(static_cast<uint64_t>(all.front())), ")");
  } else {
    std::ostringstream os;
    for (size_t r = 0; r < all.size(); ++r) {
      os << (r ? ", " : "") << "rank " << r << ": " << ckpt::hex(static_cast<uint64_t>(all[r]));
    }
    logging::error("parameters differ across ranks (xxh64 ", os.str(),
                   "): the ranks fell out of sync");
  }
}

void check_supported(const RunConfig& c, const comm::Communicator* comm) {
  DTRAIN_CHECK_AS(ConfigError,
                  c.parallel.strategy != "none" || comm == nullptr || comm->size() == 1, c.source,
                  ": parallel.strategy: none trains one process, but this job has ",
                  comm ? comm->size() : 1, " ranks; use ddp");
  DTRAIN_CHECK_AS(ConfigError, c.device == "cpu" || at::hasCUDA(), c.source,
                  ": device: cuda, but this LibTorch has no CUDA device; use device: cpu");
}

// Loss-scale collapse: the scale keeps halving because the gradients overflow whatever it
// is, so every step is skipped and the run trains nothing while looking alive. After the
// first skipped step the numerics monitor is switched on (if it was off), so that the error
// can name the unit that went non-finite first; it goes back off after a step that stepped.
class ScaleCollapseGuard {
 public:
  explicit ScaleCollapseGuard(const ScalerConfig& c) : c_(c) {}

  // Steps skipped in a row, for checkpoints; resume() takes it back (with the monitor on, as
  // after_step would have left it).
  int64_t skips() const { return skips_; }
  void resume(int64_t skips, amp::NumericsMonitor& monitor) {
    skips_ = skips;
    if (skips_ > 0 && !monitor.enabled()) {
      monitor.set_enabled(true);
      switched_monitor_on_ = true;
    }
  }

  void after_step(int64_t step, bool stepped, double scale, amp::NumericsMonitor& monitor) {
    if (const auto& unit = monitor.first_nonfinite_unit()) last_unit_ = *unit;
    if (stepped) {
      skips_ = 0;
      if (switched_monitor_on_) {
        monitor.set_enabled(false);
        switched_monitor_on_ = false;
      }
    } else {
      ++skips_;
      if (!monitor.enabled()) {
        monitor.set_enabled(true);
        switched_monitor_on_ = true;
      }
    }
    if (scale < 1024 && !warned_) {
      warned_ = true;
      logging::warn("step ", step + 1, ": the loss scale fell to ", scale,
                    ", below 2^10: fp16 gradients are overflowing often. ", advice());
    }
    const bool too_small = scale < c_.min_scale;
    const bool too_many = c_.max_consecutive_skips > 0 && skips_ >= c_.max_consecutive_skips;
    if (!too_small && !too_many) return;
    std::ostringstream history;
    const auto& h = monitor.scale_history();
    for (size_t i = h.size() > 8 ? h.size() - 8 : 0; i < h.size(); ++i) {
      history << "step " << h[i].first + 1 << ": " << h[i].second << (i + 1 < h.size() ? ", " : "");
    }
    DTRAIN_FAIL(Error, "step ", step + 1, ": the loss scale collapsed (",
                too_small ? detail::str("scale ", scale, " is below precision.scaler.min_scale ",
                                        c_.min_scale)
                          : detail::str(skips_,
                                        " steps skipped in a row, precision.scaler."
                                        "max_consecutive_skips: ",
                                        c_.max_consecutive_skips),
                "); stopping. The first unit with an inf/NaN: ",
                last_unit_.empty() ? std::string("none recorded") : last_unit_,
                ". Recent scales: ", history.str(), ". ", advice());
  }

 private:
  static std::string advice() {
    return "Try precision.policy: bf16 (no loss scaling needed), a lower "
           "precision.scaler.init_scale, a lower train.lr, or fp32 for the unstable part "
           "(amp::CustomOpRegion).";
  }

  const ScalerConfig& c_;
  int64_t skips_ = 0;
  bool warned_ = false;
  bool switched_monitor_on_ = false;
  std::string last_unit_;
};

}  // namespace

namespace internal {

at::Tensor cross_entropy(const at::Tensor& output, const Batch& batch) {
  at::Tensor logits = output.to(at::kFloat);  // fp32 whatever the output's dtype, as autocast
  if (logits.dim() > 2) logits = logits.reshape({-1, logits.size(-1)});
  return at::cross_entropy_loss(logits, batch.targets.reshape(-1));
}

}  // namespace internal

std::shared_ptr<comm::Communicator> connect(const RunConfig& config) {
  comm::CommOptions co;
  co.backend = comm::parse_backend(config.parallel.backend);
  co.device = config.device == "cuda" ? c10::kCUDA : c10::kCPU;
  // DTRAIN_COMM_TIMEOUT_S, when set, wins over parallel.timeout_s (like DTRAIN_LOG_LEVEL): an
  // operator's knob that needs no config edit.
  if (std::getenv("DTRAIN_COMM_TIMEOUT_S") == nullptr) {
    co.timeout = std::chrono::milliseconds(static_cast<int64_t>(config.parallel.timeout_s * 1000));
  }
  auto info = comm::detect_rank_info(co.rendezvous);
  logging::configure(info.rank, {config.logging.level, config.logging.all_ranks});
  if (config.parallel.strategy == "none" && info.world_size == 1) return nullptr;
  return comm::create_world(co);
}

TrainResult train(const RunConfig& c, std::shared_ptr<comm::Communicator> comm) {
  DTRAIN_CHECK_AS(ConfigError, c.model.type != "custom", c.source,
                  ": model.type: custom is a model given in code, through "
                  "framework::train(module, data, loss, config, comm) (examples/); dtrain-train "
                  "trains transformer or mlp");
  const int rank = comm ? comm->rank() : 0;
  const int world = comm ? comm->size() : 1;
  const c10::DeviceType device = c.device == "cuda" ? c10::kCUDA : c10::kCPU;
  // Before anything is allocated: refuse a run that cannot fit (a real OOM is the kernel's
  // killer). Host memory only; a CUDA run's device memory is not estimated here.
  check_supported(c, comm.get());
  if (device == c10::kCPU) {
    check_memory_fits(c, world, comm::detect_rank_info().local_world_size,
                      available_memory_bytes());
    logging::info("memory: about ", estimate_memory(c, world).describe(), " per rank");
  }
  at::manual_seed(static_cast<uint64_t>(c.train.seed));  // identical init; DDP broadcasts anyway
  std::unique_ptr<BatchSource> data;
  const int64_t micro_batch = c.train.batch_size / c.train.micro_batches;
  const uint64_t data_seed = static_cast<uint64_t>(c.data.seed);
  std::string model_desc;
  internal::ModelFactory make;
  if (c.model.type == "transformer") {
    auto o = TransformerLMOptions()
                 .vocab_size(c.model.vocab_size)
                 .seq_len(c.model.seq_len)
                 .d_model(c.model.d_model)
                 .n_layers(c.model.n_layers)
                 .n_heads(c.model.n_heads)
                 .d_ff(c.model.d_ff)
                 .tie_weights(c.model.tie_weights);
    TransformerLM lm(o);
    lm->to(device);
    logging::info("model: TransformerLM, ", transformer_lm_parameter_count(o) / 1e6,
                  "M parameters");
    model_desc =
        "TransformerLM " + logging::fixed(transformer_lm_parameter_count(o) / 1e6, 1) + "M";
    make = [lm, &comm, &c](amp::NumericsMonitor* monitor) -> std::unique_ptr<Model> {
      return std::make_unique<internal::Wrapped<TransformerLM>>(lm, comm, c, monitor,
                                                                internal::cross_entropy, true);
    };
    if (c.data.source == "corpus") {
      DTRAIN_CHECK_AS(ConfigError, c.model.vocab_size >= 256, c.source,
                      ": model.vocab_size must be >= 256 for the byte corpus");
      data = std::make_unique<ByteCorpusSource>(c.data.path, c.model.seq_len, micro_batch,
                                                c.train.micro_batches, world, rank, data_seed);
    } else {
      data = std::make_unique<SyntheticLMSource>(c.model.vocab_size, c.model.seq_len, micro_batch,
                                                 rank, data_seed);
    }
  } else {
    MLP mlp(MLPOptions()
                .in_features(c.model.in_features)
                .hidden(c.model.hidden)
                .depth(c.model.depth)
                .out_features(c.model.out_features));
    mlp->to(device);
    int64_t n = 0;
    for (const auto& p : mlp->parameters()) n += p.numel();
    model_desc = "MLP " + logging::fixed(n / 1e6, 2) + "M";
    make = [mlp, &comm, &c](amp::NumericsMonitor* monitor) -> std::unique_ptr<Model> {
      return std::make_unique<internal::Wrapped<MLP>>(mlp, comm, c, monitor,
                                                      internal::cross_entropy, true);
    };
    data = std::make_unique<SyntheticClassificationSource>(
        c.model.in_features, c.model.out_features, micro_batch, rank, data_seed);
  }
  return internal::run(c, comm, make, std::move(data), model_desc);
}

TrainResult internal::run(const RunConfig& c, std::shared_ptr<comm::Communicator> comm,
                          const ModelFactory& make_model, std::unique_ptr<BatchSource> data,
                          const std::string& model_desc) {
  check_supported(c, comm.get());
  const int rank = comm ? comm->rank() : 0;
  const int world = comm ? comm->size() : 1;
  const c10::DeviceType device = c.device == "cuda" ? c10::kCUDA : c10::kCPU;
  if (rank == 0) {  // once per job, not once per rank
    for (const auto& w : c.warnings) logging::warn(c.source, ": ", w);
    if (!c.precision.chosen_by.empty()) logging::info(c.precision.chosen_by);
  }
  amp::NumericsMonitor monitor(c.logging.numerics);
  std::unique_ptr<Model> model = make_model(&monitor);

  // ATen's fused kernels, as Python's AdamW(fused=True) and SGD(fused=True): one pass per
  // step, PyTorch's rounding, and the GradScaler's skip inside the kernel (optim/fused.h).
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (c.train.optimizer == "adamw") {
    opt = std::make_unique<optim::AdamW>(
        model->parameters(),
        torch::optim::AdamWOptions(c.train.lr).weight_decay(c.train.weight_decay));
  } else {
    opt =
        std::make_unique<optim::SGD>(model->parameters(), torch::optim::SGDOptions(c.train.lr)
                                                              .momentum(c.train.momentum)
                                                              .weight_decay(c.train.weight_decay));
  }
  const auto& sc = c.precision.scaler;
  const auto scaler_options = amp::GradScalerOptions()
                                  .init_scale(sc.init_scale)
                                  .growth_factor(sc.growth_factor)
                                  .backoff_factor(sc.backoff_factor)
                                  .growth_interval(sc.growth_interval)
                                  .enabled(sc.enabled);
  // FSDP's gradients are shards (and may be fp16): the inf verdict must be agreed.
  std::unique_ptr<amp::GradScaler> scaler_ptr =
      comm && c.parallel.strategy == "fsdp"
          ? std::make_unique<amp::ShardedGradScaler>(comm, scaler_options)
          : std::make_unique<amp::GradScaler>(scaler_options);
  amp::GradScaler& scaler = *scaler_ptr;
  // DDP unscales and judges the gradients as it writes them back, so unscale_ below makes no
  // pass of its own.
  if (sc.enabled) model->use_grad_scaler(&scaler);
  const bool autocast = c.precision.mixed.is_low_precision() && model->uses_autocast();
  const c10::ScalarType compute = c.precision.mixed.param_dtype;
  logging::info("run: ", c.source, ", ", world, " rank(s), strategy ", c.parallel.strategy,
                comm ? ", backend " + comm->backend() : std::string(), ", precision ",
                c.precision.policy, " ", c.precision.mixed.to_string(), ", loss scaling ",
                sc.enabled ? "on" : "off");

  const bool tty = rank == 0 && c.logging.progress_bar && ::isatty(2);

  TrainResult result;
  Checkpointer checkpointer(c);
  CheckpointParts parts{&model->module(), model->fsdp(), opt.get(), &scaler, &monitor, comm.get()};
  int64_t first_step = 0;
  std::optional<TrainerProgress> restored;
  if (checkpointer.enabled() || (c.checkpoint.resume != "auto" && c.checkpoint.resume != "never")) {
    if ((restored = checkpointer.restore(parts, c.checkpoint.resume))) {
      first_step = restored->step;
      result.skipped_steps = restored->skipped_steps;
    }
  }
  std::ofstream metrics = open_metrics(
      c, rank, first_step,
      "{\"config\":\"" + trace::json_escape(c.source) + "\",\"model\":\"" +
          trace::json_escape(model_desc) + "\",\"strategy\":\"" + c.parallel.strategy +
          "\",\"precision\":\"" + c.precision.policy + "\",\"ranks\":" + std::to_string(world) +
          ",\"backend\":\"" + (comm ? comm->backend() : std::string("none")) + "\"}");
  DTRAIN_CHECK_AS(ConfigError, c.train.eval_every == 0 || c.train.eval_samples >= world, c.source,
                  ": train.eval_samples (", c.train.eval_samples,
                  ") must be at least the number of ranks (", world,
                  "): every rank evaluates its share");
  if (first_step > 0 && c.train.eval_every > 0) {
    // The restored model's validation loss: the same number, at any world size, as the run
    // that wrote the checkpoint logged at this step.
    const double v = validation_loss(*model, *data, comm.get(), device, autocast, compute);
    logging::info("step ", first_step, " (restored) val_loss ", logging::fixed(v, 6));
    if (metrics) {
      metrics << "{\"step\":" << first_step << json_number(",\"val_loss\":", v)
              << ",\"restored\":true}\n"
              << std::flush;
    }
  }
  // Fault injection (core/faults.h). KILL_AT_STEP: SIGKILL that rank once <step> steps are
  // done (and their checkpoint written), in the first attempt only (launcher restarts;
  // TORCHELASTIC_RESTART_COUNT 0). NAN_FROM_STEP: that rank's loss is NaN from step <step>
  // (1-based) on.
  std::optional<faults::StepRank> kill_at;
  {
    const char* restarts = std::getenv("TORCHELASTIC_RESTART_COUNT");
    if (restarts == nullptr || std::string(restarts) == "0") {
      kill_at = faults::step_rank("KILL_AT_STEP");
    }
  }
  const std::optional<faults::StepRank> nan_from = faults::step_rank("NAN_FROM_STEP");
  double window_loss = 0, window_time = 0;
  int64_t window_steps = 0;
  bool first_logged = false;
  int64_t nonfinite_run = restored ? restored->nonfinite_run : 0;
  ScaleCollapseGuard collapse(sc);
  if (restored) collapse.resume(restored->consecutive_skips, monitor);
  const bool trace_on = !c.logging.trace.empty();
  if (trace_on) {
    // The time origin of every rank's timeline, taken as they leave a barrier.
    if (comm && world > 1) comm->barrier().wait();
    trace::configure(rank);
  }
  for (int64_t step = first_step; step < c.train.steps; ++step) {
    auto t0 = Clock::now();
    const bool tracing = trace_on && step + 1 >= c.logging.trace_start &&
                         step + 1 < c.logging.trace_start + c.logging.trace_steps;
    trace::set_recording(tracing);
    const int64_t step_start_us = tracing ? trace::now_us() : 0;
    monitor.begin_step(step);
    const double lr = lr_at(c.train, step);
    for (auto& g : opt->param_groups()) g.options().set_lr(lr);
    opt->zero_grad(/*set_to_none=*/true);
    double loss_sum = 0;
    for (int64_t m = 0; m < c.train.micro_batches; ++m) {
      Batch b = data->next(step, m);
      b.inputs = b.inputs.to(device);
      b.targets = b.targets.to(device);
      std::optional<sharding::NoSyncGuard> local =
          m + 1 < c.train.micro_batches ? model->no_sync() : std::nullopt;
      at::Tensor loss;
      {
        std::optional<trace::Scope> span;
        if (tracing) span.emplace("forward " + std::to_string(m), "compute");
        amp::AutocastGuard ac(
            device, autocast ? std::optional<c10::ScalarType>(compute) : std::nullopt, autocast);
        loss = model->loss(b) / static_cast<double>(c.train.micro_batches);
        if (nan_from && nan_from->step >= 1 && step + 1 >= nan_from->step &&
            rank == nan_from->rank) {
          loss = loss * std::numeric_limits<double>::quiet_NaN();
        }
      }
      {
        std::optional<trace::Scope> span;
        if (tracing) span.emplace("backward " + std::to_string(m), "compute");
        scaler.scale(loss).backward();
      }
      loss_sum += loss.item<double>();
    }
    std::optional<trace::Scope> optimizer_span;
    if (tracing) optimizer_span.emplace("optimizer", "compute");
    scaler.unscale_(*opt);
    double grad_norm = model->clip_grad_norm(c.train.clip_grad_norm);
    const double scale_used = scaler.get_scale();
    bool stepped = scaler.step(*opt);
    scaler.update();
    optimizer_span.reset();
    if (tracing) {
      trace::complete("step " + std::to_string(step + 1), "step", trace::kMain, step_start_us,
                      trace::now_us());
      trace::set_recording(false);
    }
    if (!sc.enabled) {
      // Without loss scaling nothing skips a step whose loss is inf/NaN: the parameters are
      // now corrupt on every rank. Every rank takes the same decision.
      double bad = std::isfinite(loss_sum) ? 0.0 : 1.0;
      if (comm && world > 1) {
        at::Tensor t = at::full({1}, bad, at::TensorOptions(at::kDouble).device(comm->device()));
        comm->all_reduce(t, comm::ReduceOp::kMax).wait();
        bad = t.item<double>();
      }
      nonfinite_run = bad > 0 ? nonfinite_run + 1 : 0;
      if (nonfinite_run >= c.train.max_nonfinite_steps) {
        const auto& unit = monitor.first_nonfinite_unit();
        DTRAIN_FAIL(Error, "step ", step + 1, ": the loss is not finite (this rank's: ", loss_sum,
                    ") for ", nonfinite_run, " consecutive step(s) (train.max_nonfinite_steps: ",
                    c.train.max_nonfinite_steps, "); stopping. ",
                    unit ? "The first unit with an inf/NaN: " + *unit + ". "
                         : std::string("logging.numerics: true names the first unit with an "
                                       "inf/NaN. "),
                    "Try a lower train.lr, train.clip_grad_norm, or fp32 for the unstable part.");
      }
    }
    monitor.record_scale(step, scaler.get_scale());
    if (!stepped) {
      ++result.skipped_steps;
      if (tty) std::fprintf(stderr, "\r\033[K");
      logging::warn("step ", step + 1, ": inf/NaN gradients, step skipped; loss scale ", scale_used,
                    " -> ", scaler.get_scale());
      if (c.logging.numerics) logging::warn(monitor.report());
    }
    if (sc.enabled) collapse.after_step(step, stepped, scaler.get_scale(), monitor);
    double step_time = std::chrono::duration<double>(Clock::now() - t0).count();
    window_loss += loss_sum;
    window_time += step_time;
    ++window_steps;
    const bool last = step + 1 == c.train.steps;
    std::optional<double> val_loss;
    if (c.train.eval_every > 0 && ((step + 1) % c.train.eval_every == 0 || last)) {
      val_loss = validation_loss(*model, *data, comm.get(), device, autocast, compute);
    }
    if ((step + 1) % c.logging.every_steps == 0 || last || step == first_step || val_loss) {
      double loss = mean_over_ranks(comm.get(), window_loss / window_steps);
      if (!first_logged) {
        result.first_loss = loss;
        first_logged = true;
      }
      result.last_loss = loss;
      double avg_time = window_time / window_steps;
      double tokens_per_s = world * c.train.batch_size * data->items_per_sample() / avg_time;
      const sharding::ReducerStats* rs = model->stats();
      if (tty) std::fprintf(stderr, "\r\033[K");  // the bar gives way to the line
      logging::info("step ", step + 1, "/", c.train.steps, " loss ", logging::fixed(loss, 4),
                    val_loss ? " val_loss " + logging::fixed(*val_loss, 4) : std::string(),
                    " scale ", scaler.get_scale(), " grad_norm ", logging::fixed(grad_norm, 3),
                    " skipped ", result.skipped_steps, " lr ", lr, " tokens/s ",
                    logging::fixed(tokens_per_s, 0), " step ", logging::fixed(avg_time * 1000, 1),
                    " ms",
                    rs ? " comm hidden " + logging::fixed(100 * rs->hidden_fraction(), 0) + "%"
                       : std::string(),
                    " peak_rss ", logging::fixed(peak_rss_mb(), 0), " MB",
                    tty ? "" : "  " + progress_bar(step + 1, c.train.steps));
      if (metrics) {
        std::string line =
            "{\"step\":" + std::to_string(step + 1) + json_number(",\"loss\":", loss) +
            json_number(",\"scale\":", scaler.get_scale()) +
            json_number(",\"grad_norm\":", grad_norm, "%.6g") +
            ",\"skipped\":" + std::to_string(result.skipped_steps) +
            json_number(",\"lr\":", lr, "%.6g") +
            json_number(",\"tokens_per_s\":", tokens_per_s, "%.1f") +
            json_number(",\"step_time_s\":", avg_time, "%.6f") +
            json_number(",\"comm_hidden\":", rs ? rs->hidden_fraction() : 1.0, "%.4f") +
            json_number(",\"peak_rss_mb\":", peak_rss_mb(), "%.1f") +
            (val_loss ? json_number(",\"val_loss\":", *val_loss) : "") + "}\n";
        metrics << line << std::flush;
      }
      window_loss = window_time = 0;
      window_steps = 0;
    }
    if (tty) std::fprintf(stderr, "\r%s ", progress_bar(step + 1, c.train.steps).c_str());
    const bool due = c.checkpoint.every_steps > 0 && (step + 1) % c.checkpoint.every_steps == 0;
    if (checkpointer.enabled() && (due || last)) {
      auto t = Clock::now();
      const std::string path = checkpointer.save(
          parts,
          TrainerProgress{step + 1, result.skipped_steps, lr, collapse.skips(), nonfinite_run});
      if (tty) std::fprintf(stderr, "\r\033[K");
      logging::info("checkpoint ", path, " written in ",
                    logging::fixed(std::chrono::duration<double>(Clock::now() - t).count(), 2),
                    " s");
    }
    if (kill_at && step + 1 == kill_at->step && rank == kill_at->rank) {
      logging::warn("DTRAIN_TEST_KILL_AT_STEP: rank ", rank, " kills itself after step ", step);
      std::raise(SIGKILL);
    }
  }
  if (tty) std::fprintf(stderr, "\n");
  if (trace_on) write_trace(c, comm.get(), rank, world);
  result.steps = c.train.steps;
  check_parameters_agree(*model, comm.get());
  if (c.model.type == "transformer" && c.model.vocab_size >= 256 && first_step < c.train.steps) {
    const std::string text = sample_text(*model, device, c.model.seq_len, 48);
    logging::info("sample: \"", text, "\"");
  }
  result.final_scale = scaler.get_scale();
  // Each rank's peak beside the estimate it started with (rank 0 prints the table).
  {
    at::Tensor mine = at::tensor(
        {peak_rss_mb() * 1024 * 1024, TrackedCpuMemory::installed()
                                          ? static_cast<double>(TrackedCpuMemory::peak_bytes())
                                          : -1.0},
        at::kDouble);
    at::Tensor all = mine;
    if (comm && world > 1) {
      all = at::empty({2 * world}, at::TensorOptions(at::kDouble).device(comm->device()));
      comm->all_gather(mine.to(comm->device()), all).wait();
      all = all.cpu();
    }
    std::ostringstream os;
    for (int r = 0; r < world; ++r) {
      os << (r ? "; " : "") << "rank " << r << " RSS " << format_bytes(all[2 * r].item<double>());
      const double tensors = all[2 * r + 1].item<double>();
      if (tensors >= 0) os << " (tensors " << format_bytes(tensors) << ")";
    }
    logging::info("peak memory per rank: ", os.str(),
                  c.model.type == "custom"
                      ? std::string()
                      : "; estimated " + format_bytes(estimate_memory(c, world).peak()));
  }
  logging::info("done: ", result.steps, " steps, loss ", logging::fixed(result.first_loss, 4),
                " -> ", logging::fixed(result.last_loss, 4), ", ", result.skipped_steps,
                " skipped");
  return result;
}

}  // namespace dtrain::framework
