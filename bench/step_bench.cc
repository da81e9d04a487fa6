// step_bench: median training-step time and peak memory of a TransformerLM under dtrain's
// DDP or FSDP, or one process with no communication at all (the local step: what the same
// model and per-rank batch cost without data parallelism). Paired with PyTorch's DDP and
// fully_shard on the same model (bench/reference/*.py) by bench/run_ddp_bench.sh and
// bench/run_fsdp_bench.sh, which print the tables.
//
//   dtrain-launch --nproc-per-node 2 -- step_bench --strategy fsdp --precision bf16
//
// Step = zero_grad -> forward -> cross-entropy (fp32) -> backward (gradients reduced) ->
// AdamW step; DDP and local steps compute under autocast in bf16 (or fp16), FSDP in bf16
// parameters. fp16 (DDP and local) adds the GradScaler (--scaler adds it to any precision),
// by default as the trainer has it (--scaler in-ddp: DDP unscales and checks the gradients as
// it writes reduced buckets back, DDPOptions::grad_scaler; the fused AdamW then steps with the
// flag and no scale); --scaler verdict: DDP only checks them (DDPOptions::check_finite) and
// the kernel unscales; own-check: the scaler checks them itself. `scaler_s` is the scaler's
// own time: scale(), step() less the optimizer's step inside it, and update();
// `write_back_s` is DDP's write-back of reduced buckets (with what the scaler mode adds to
// it), to set against a run without a scaler.
// Memory: the process's RSS high-water mark, and the bytes CPU tensors held at the peak
// (framework/memory.h), each the largest over ranks. The steady state (parameters,
// gradients, optimizer state between steps) is reported too, so a table can set the peak
// against (params + grads + optimizer state) / N + activations + gathered units.
// Prints one JSON line on rank 0.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <sys/resource.h>
#include <torch/optim/adamw.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "amp/autocast.h"
#include "amp/grad_scaler.h"
#include "comm/factory.h"
#include "core/cli.h"
#include "framework/memory.h"
#include "framework/models/transformer_lm.h"
#include "optim/fused.h"
#include "sharding/ddp.h"
#include "sharding/fsdp.h"

using Clock = std::chrono::steady_clock;
using dtrain::framework::TrackedCpuMemory;
using dtrain::framework::TransformerLM;
using dtrain::framework::TransformerLMOptions;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

double seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// The fused AdamW, timing its own steps (the part of scaler.step that is the optimizer's).
class TimedAdamW : public dtrain::optim::AdamW {
 public:
  using dtrain::optim::AdamW::AdamW;
  at::Tensor step(LossClosure closure = nullptr) override {
    auto t0 = Clock::now();
    at::Tensor out = dtrain::optim::AdamW::step(std::move(closure));
    last_s = seconds(t0, Clock::now());
    return out;
  }
  double last_s = 0;
};

// The largest value over ranks (or this one's, without a communicator).
double max_over_ranks(dtrain::comm::Communicator* comm, double v) {
  if (comm == nullptr) return v;
  at::Tensor t = at::full({1}, v, at::kDouble);
  comm->all_reduce(t, dtrain::comm::ReduceOp::kMax).wait();
  return t.item<double>();
}

}  // namespace

int main(int argc, char** argv) {
  TrackedCpuMemory::install();  // before any tensor
  CLI::App app{"step_bench: TransformerLM step time and memory under dtrain's DDP or FSDP"};
  dtrain::cli::setup(app, "step_bench");
  std::string strategy = "ddp", sharding = "full_shard", precision = "fp32",
              layout = "per_parameter";
  std::string optimizer = "fused", scaler_mode;
  int64_t steps = 8, warmup = 2, d_model = 512, layers = 6, heads = 8, d_ff = 2048, seq = 64,
          batch = 4, vocab = 256, limit = 2, hybrid_group = 0;
  double bucket_cap_mb = 25;
  bool forward_prefetch = false, one_queue = false, local_ab = false, in_backward = false;
  app.add_option("--strategy", strategy, "ddp, fsdp, or local (one process, no communication)")
      ->check(CLI::IsMember({"ddp", "fsdp", "local"}));
  app.add_option("--sharding", sharding, "FSDP: full_shard, shard_grad_op, no_shard")
      ->check(CLI::IsMember({"full_shard", "shard_grad_op", "no_shard", "hybrid_shard"}));
  app.add_option("--precision", precision, "fp32, bf16, or fp16 (DDP and local: with a GradScaler)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  app.add_option("--scaler", scaler_mode,
                 "in-ddp (a GradScaler; DDP unscales and checks the gradients in its "
                 "write-back, DDPOptions::grad_scaler: the trainer's way), verdict (DDP checks "
                 "them, DDPOptions::check_finite, and hands the scaler its verdict; the kernel "
                 "unscales), own-check (the scaler checks them itself), or off; default: in-ddp "
                 "for fp16, else off; ab: in-ddp and off in alternate steps of one process, "
                 "each reported apart (ab_* fields), so the machine's drift between runs does "
                 "not enter the difference. Any precision takes one, to measure its cost beside "
                 "a step whose compute is fast on a CPU")
      ->check(CLI::IsMember({"in-ddp", "verdict", "own-check", "off", "ab"}));
  app.add_option("--optimizer", optimizer,
                 "AdamW's implementation: fused (dtrain::optim, ATen's fused kernel, what the "
                 "trainer uses) or libtorch (torch::optim::AdamW's per-parameter loop)")
      ->check(CLI::IsMember({"fused", "libtorch"}));
  app.add_option("--steps", steps, "timed steps");
  app.add_option("--warmup", warmup, "untimed steps first");
  app.add_option("--d-model", d_model);
  app.add_option("--layers", layers);
  app.add_option("--heads", heads);
  app.add_option("--d-ff", d_ff);
  app.add_option("--seq", seq);
  app.add_option("--batch", batch, "sequences per rank");
  app.add_option("--bucket-cap-mb", bucket_cap_mb, "DDP");
  app.add_option("--limit-all-gathers", limit, "FSDP");
  app.add_option("--hybrid-group-size", hybrid_group,
                 "FSDP hybrid_shard: ranks per shard group (0: one node)");
  app.add_option("--shard-layout", layout, "FSDP: per_parameter or flat")
      ->check(CLI::IsMember({"per_parameter", "flat"}));
  app.add_flag("--forward-prefetch", forward_prefetch, "FSDP");
  app.add_flag("--one-queue", one_queue, "FSDP: reduce-scatters on the gathers' communicator");
  app.add_flag("--optimizer-in-backward", in_backward,
               "FSDP, fused AdamW: each unit steps as its gradients are reduced "
               "(FSDPState::set_step_in_backward); the optimizer's time is then inside backward");
  app.add_flag("--local-ab", local_ab,
               "DDP: every other step under no_sync(), without communication, reported apart "
               "(ab_sync_*, ab_local_*): the step beside the same processes' local step, "
               "on a machine loaded alike");
  dtrain::cli::parse(app, argc, argv);

  const char* threads = std::getenv("OMP_NUM_THREADS");
  at::set_num_threads(std::max(1, std::atoi(threads ? threads : "1")));
  std::shared_ptr<dtrain::comm::Communicator> comm;
  if (strategy != "local") comm = dtrain::comm::create_world();
  const int rank = comm ? comm->rank() : 0;
  at::manual_seed(0);
  auto opts = TransformerLMOptions()
                  .vocab_size(vocab)
                  .seq_len(seq)
                  .d_model(d_model)
                  .n_layers(layers)
                  .n_heads(heads)
                  .d_ff(d_ff);
  const bool bf16 = precision == "bf16", fp16 = precision == "fp16";
  if (fp16 && strategy == "fsdp") {
    std::fprintf(stderr, "step_bench: --precision fp16 is for ddp and local\n");
    return 2;
  }
  if (scaler_mode.empty()) scaler_mode = fp16 ? "in-ddp" : "off";
  if (in_backward && (strategy != "fsdp" || optimizer != "fused")) {
    std::fprintf(stderr, "step_bench: --optimizer-in-backward is for fsdp with the fused AdamW\n");
    return 2;
  }
  if (scaler_mode != "off" && strategy == "fsdp") {
    std::fprintf(stderr, "step_bench: --scaler is for ddp and local\n");
    return 2;
  }
  const std::optional<c10::ScalarType> low = bf16   ? std::optional<c10::ScalarType>(at::kBFloat16)
                                             : fp16 ? std::optional<c10::ScalarType>(at::kHalf)
                                                    : std::nullopt;
  const bool ab = scaler_mode == "ab";
  if ((ab || local_ab) && strategy != "ddp") {
    std::fprintf(stderr, "step_bench: --scaler ab and --local-ab are for ddp\n");
    return 2;
  }
  if (ab && local_ab) {
    std::fprintf(stderr, "step_bench: --scaler ab and --local-ab alternate steps each: one\n");
    return 2;
  }
  dtrain::amp::GradScaler scaler(dtrain::amp::GradScalerOptions().enabled(scaler_mode != "off"));
  dtrain::amp::GradScaler no_scaler(dtrain::amp::GradScalerOptions().enabled(false));
  std::unique_ptr<dtrain::sharding::DistributedDataParallel<TransformerLM>> ddp;
  std::unique_ptr<dtrain::sharding::FullyShardedDataParallel<TransformerLM>> fsdp;
  TransformerLM local{nullptr};
  std::vector<at::Tensor> params;
  if (strategy == "ddp") {
    ddp = std::make_unique<dtrain::sharding::DistributedDataParallel<TransformerLM>>(
        TransformerLM(opts), comm,
        dtrain::sharding::DDPOptions()
            .bucket_cap_mb(bucket_cap_mb)
            .reduce_dtype(low)
            .check_finite(scaler_mode == "verdict")
            .grad_scaler(scaler_mode == "in-ddp" || ab ? &scaler : nullptr));
    params = ddp->parameters();
  } else if (strategy == "fsdp") {
    fsdp = std::make_unique<dtrain::sharding::FullyShardedDataParallel<TransformerLM>>(
        TransformerLM(opts), comm,
        dtrain::sharding::FSDPOptions()
            .sharding_strategy(dtrain::sharding::parse_sharding_strategy(sharding))
            .mixed_precision(dtrain::amp::MixedPrecisionPolicy::preset(precision))
            .limit_all_gathers(limit)
            .hybrid_group_size(hybrid_group)
            .shard_layout(layout == "flat" ? dtrain::sharding::ShardLayout::kFlat
                                           : dtrain::sharding::ShardLayout::kPerParameter)
            .forward_prefetch(forward_prefetch)
            .separate_reduce_group(!one_queue));
    params = fsdp->parameters();
  } else {
    local = TransformerLM(opts);
    params = local->parameters();
  }
  std::unique_ptr<torch::optim::Optimizer> opt_ptr;
  TimedAdamW* timed = nullptr;
  if (optimizer == "fused") {
    auto o = std::make_unique<TimedAdamW>(params, torch::optim::AdamWOptions(1e-4));
    timed = o.get();
    opt_ptr = std::move(o);
  } else {
    opt_ptr = std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-4));
  }
  torch::optim::Optimizer& opt = *opt_ptr;
  double in_backward_adamw_s = 0;  // --optimizer-in-backward: this step's unit steps, summed
  if (in_backward) {
    fsdp->state().set_step_in_backward(
        [timed, &in_backward_adamw_s](const std::vector<at::Tensor>& ps) {
          timed->step_only(ps);
          in_backward_adamw_s += timed->last_s;
        });
  }
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1234 + rank);
  std::vector<double> step_s, forward_s, backward_s, comm_s, exposed_s, opt_s, scaler_s,
      write_back_s, adamw_s, check_s;
  std::vector<bool> scaled_step;  // --scaler ab: whether each timed step had the scaler
  double steady_mb = 0, peak_tracked_mb = 0;
  for (int64_t s = 0; s < warmup + steps; ++s) {
    at::Tensor x = at::randint(0, vocab, {batch, seq}, gen);
    at::Tensor y = at::randint(0, vocab, {batch, seq}, gen);
    if (comm) comm->barrier().wait();
    const double steady = TrackedCpuMemory::current_bytes() / 1e6;
    TrackedCpuMemory::reset_peak();
    in_backward_adamw_s = 0;
    // --scaler ab: even steps as the trainer runs fp16 (in-ddp), odd steps without a scaler.
    const bool with_scaler = ab ? s % 2 == 0 : scaler.is_enabled();
    // --local-ab: odd steps without communication.
    std::optional<dtrain::sharding::NoSyncGuard> local_step;
    if (local_ab && s % 2 == 1) local_step.emplace(ddp->no_sync());
    dtrain::amp::GradScaler& sc = with_scaler ? scaler : no_scaler;
    if (ab) ddp->reducer().set_grad_scaler(with_scaler ? &scaler : nullptr);
    auto t0 = Clock::now();
    // The local run keeps its gradients allocated, so its peak above the steady state is the
    // activations alone (the theory FSDP's memory is set against).
    opt.zero_grad(/*set_to_none=*/strategy != "local");
    at::Tensor loss;
    {
      // DDP and local steps compute under autocast; FSDP's parameters are bf16 already.
      dtrain::amp::AutocastGuard autocast(at::kCPU, low.value_or(at::kBFloat16),
                                          low.has_value() && !fsdp);
      at::Tensor logits = ddp ? (*ddp)(x) : fsdp ? (*fsdp)(x) : local->forward(x);
      loss = at::cross_entropy_loss(logits.to(at::kFloat).reshape({-1, vocab}), y.reshape(-1));
    }
    auto tb = Clock::now();
    at::Tensor scaled = sc.scale(loss);
    double in_scaler = seconds(tb, Clock::now());
    scaled.backward();
    auto te = Clock::now();
    if (sc.is_enabled()) {
      if (ddp && ddp->found_inf().defined()) {
        sc.step(opt, ddp->found_inf());
      } else {
        sc.step(opt);
      }
      sc.update();
      in_scaler += seconds(te, Clock::now()) - (timed ? timed->last_s : 0.0);
    } else if (!in_backward) {
      opt.step();
    }
    auto t1 = Clock::now();
    if (s < warmup) continue;
    step_s.push_back(seconds(t0, t1));
    forward_s.push_back(seconds(t0, tb));
    backward_s.push_back(seconds(tb, te));
    opt_s.push_back(seconds(te, t1));
    scaler_s.push_back(sc.is_enabled() ? in_scaler : 0.0);
    scaled_step.push_back(local_ab ? !local_step.has_value() : with_scaler);
    adamw_s.push_back(in_backward ? in_backward_adamw_s : timed ? timed->last_s : 0.0);
    if (ddp || fsdp) {
      const auto& st = ddp ? ddp->last_stats() : fsdp->last_stats();
      comm_s.push_back(st.comm_seconds);
      exposed_s.push_back(st.exposed_seconds);
      write_back_s.push_back(st.write_back_seconds);
      check_s.push_back(st.finite_check_seconds);
    }
    steady_mb = std::max(steady_mb, steady);
    peak_tracked_mb = std::max(peak_tracked_mb, TrackedCpuMemory::peak_bytes() / 1e6);
  }
  rusage r{};
  getrusage(RUSAGE_SELF, &r);
  const double peak_rss_mb = max_over_ranks(comm.get(), r.ru_maxrss / 1024.0);
  peak_tracked_mb = max_over_ranks(comm.get(), peak_tracked_mb);
  steady_mb = max_over_ranks(comm.get(), steady_mb);
  // --scaler ab: the medians of the steps with the scaler and of those without, apart.
  std::string ab_fields;
  if (ab || local_ab) {
    auto half = [&](const std::vector<double>& v, bool with) {
      std::vector<double> out;
      for (size_t i = 0; i < v.size(); ++i) {
        if (scaled_step[i] == with) out.push_back(v[i]);
      }
      return median(out);
    };
    for (bool with : {true, false}) {
      const std::string tag = local_ab ? (with ? "sync" : "local") : (with ? "on" : "off");
      char buf[256];
      std::snprintf(buf, sizeof buf,
                    ",\"ab_%s_step_s\":%.5f,\"ab_%s_scaler_s\":%.5f,\"ab_%s_write_back_s\":%.5f,"
                    "\"ab_%s_adamw_s\":%.5f,\"ab_%s_forward_s\":%.5f,\"ab_%s_backward_s\":%.5f",
                    tag.c_str(), half(step_s, with), tag.c_str(), half(scaler_s, with), tag.c_str(),
                    half(write_back_s, with), tag.c_str(), half(adamw_s, with), tag.c_str(),
                    half(forward_s, with), tag.c_str(), half(backward_s, with));
      ab_fields += buf;
    }
  }
  if (rank == 0) {
    const double c = median(comm_s), e = median(exposed_s);
    std::printf(
        "{\"impl\":\"dtrain\",\"optimizer\":\"%s%s\",\"strategy\":\"%s\",\"sharding\":\"%s\","
        "\"precision\":\"%s\","
        "\"backend\":\"%s\",\"world\":%d,\"params\":%lld,\"median_step_s\":%.4f,"
        "\"median_forward_s\":%.4f,\"median_backward_s\":%.4f,\"median_optimizer_s\":%.4f,\"comm_"
        "s\":%.4f,"
        "\"exposed_s\":%.4f,\"hidden\":%.3f,\"peak_rss_mb\":%.1f,\"peak_tracked_mb\":%.1f,"
        "\"steady_tracked_mb\":%.1f,\"scaler\":\"%s\",\"median_scaler_s\":%.5f,\"median_write_back_"
        "s\":%.5f,\"median_adamw_s\":%.5f,"
        "\"median_finite_check_s\":%.5f%s}\n",
        optimizer.c_str(), in_backward ? " in backward" : "", strategy.c_str(),
        strategy == "fsdp" ? sharding.c_str() : "", precision.c_str(),
        comm ? comm->backend().c_str() : "none", comm ? comm->size() : 1,
        static_cast<long long>(dtrain::framework::transformer_lm_parameter_count(opts)),
        median(step_s), median(forward_s), median(backward_s), median(opt_s), c, e,
        c > 0 ? std::max(0.0, 1 - e / c) : 1.0, peak_rss_mb, peak_tracked_mb, steady_mb,
        scaler.is_enabled() ? scaler_mode.c_str() : "off", median(scaler_s), median(write_back_s),
        median(adamw_s), median(check_s), ab_fields.c_str());
  }
  if (comm) comm->barrier().wait();
  return 0;
}
