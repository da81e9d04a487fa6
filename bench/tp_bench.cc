// tp_bench: a Llama's training step under dtrain's tensor parallelism on a 2-D mesh (FSDP over
// the data-parallel ranks x tp, with or without sequence parallelism), or FSDP alone (--tp 1):
// median step time, the bytes CPU tensors hold (steady state and peak), and one step's
// collectives from the flight recorder, for bench/run_tp_bench.sh to set beside PyTorch's
// parallelize_module + fully_shard on the same shape (bench/reference/tp_reference.py) and
// against Megatron's formulas.
//
//   dtrain-launch --nproc-per-node 4 -- tp_bench --tp 2 --sp --flight-out DIR
//
// Step = zero_grad -> forward -> vocabulary-parallel cross-entropy -> backward (FSDP's
// reduce-scatters; under sequence parallelism the norms' gradients summed over the tp group)
// -> fused AdamW. fp32. Each data-parallel rank draws its own tokens; a tp group shares them.
// Prints one JSON line on rank 0; with --flight-out, each rank writes the flight recorder's
// ring after the run to DIR/flight_rank<k>.json, and the JSON line gives the wall-clock
// window (microseconds) of the first timed step and the tp group of rank 0.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <sys/resource.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "comm/factory.h"
#include "comm/flight_recorder.h"
#include "comm/work.h"
#include "core/cli.h"
#include "core/error.h"
#include "framework/memory.h"
#include "framework/models/llama.h"
#include "optim/fused.h"
#include "sharding/fsdp.h"
#include "sharding/mesh.h"
#include "sharding/tensor_parallel_plan.h"

namespace {

using Clock = std::chrono::steady_clock;
using dtrain::framework::LlamaForCausalLM;
using dtrain::framework::LlamaOptions;
using dtrain::framework::TrackedCpuMemory;

double seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

int64_t wall_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

double max_over(dtrain::comm::Communicator& comm, double v) {
  at::Tensor t = at::full({1}, v, at::kDouble);
  comm.all_reduce(t, dtrain::comm::ReduceOp::kMax).wait();
  return t.item<double>();
}

}  // namespace

int main(int argc, char** argv) {
  TrackedCpuMemory::install();  // before any tensor
  CLI::App app{"tp_bench: a Llama step under tensor parallelism x FSDP"};
  dtrain::cli::setup(app, "tp_bench");
  int tp_degree = 2;
  bool sp = false, keep_gathered = false;
  int64_t steps = 6, warmup = 2, hidden = 256, layers = 4, heads = 8, kv_heads = 4, ffn = 768,
          vocab = 2048, seq = 128, batch = 2;
  std::string flight_out;
  bool probe_comm = false;
  int local_of = 0;
  app.add_option("--tp", tp_degree, "tensor-parallel degree (1: FSDP alone)");
  app.add_flag("--sp", sp, "sequence parallelism");
  app.add_flag("--keep-gathered", keep_gathered,
               "sequence parallelism holding the gathered sequence for backward (PyTorch's "
               "SequenceParallel), not all-gathering it again there (Megatron's)");
  app.add_option("--steps", steps, "timed steps");
  app.add_option("--warmup", warmup, "untimed steps first");
  app.add_option("--hidden", hidden, "hidden size");
  app.add_option("--layers", layers, "decoder layers");
  app.add_option("--heads", heads, "attention heads");
  app.add_option("--kv-heads", kv_heads, "key/value heads");
  app.add_option("--ffn", ffn, "intermediate size");
  app.add_option("--vocab", vocab, "vocabulary");
  app.add_option("--seq", seq, "sequence length");
  app.add_option("--batch", batch, "sequences per data-parallel rank");
  app.add_option("--flight-out", flight_out, "write each rank's flight recorder ring here");
  app.add_option("--local-of", local_of,
                 "each rank computes alone what a rank of tp N does, without collectives (the "
                 "heads, KV heads, intermediate size and vocabulary / N), the ranks side by "
                 "side sharing the cores as a real run's do: the scaling model's compute "
                 "profile");
  app.add_flag("--probe-comm", probe_comm,
               "after the steps, time the tp group's all-reduce and the data-parallel group's "
               "all-gather and reduce-scatter at four sizes");
  dtrain::cli::parse(app, argc, argv);
  {
    auto world = dtrain::comm::create_world();
    DTRAIN_CHECK_AS(dtrain::UsageError, world->size() % tp_degree == 0, "--tp ", tp_degree,
                    " does not divide the world of ", world->size());
    if (local_of > 0) tp_degree = 1;
    const int64_t cut = std::max(1, local_of);
    dtrain::sharding::DeviceMesh mesh(world, {1, world->size() / tp_degree, tp_degree, 1});
    at::manual_seed(0);
    LlamaForCausalLM model(LlamaOptions()
                               .vocab_size(vocab / cut)
                               .hidden_size(hidden)
                               .intermediate_size(ffn / cut)
                               .num_hidden_layers(layers)
                               .num_attention_heads(heads / cut)
                               .num_key_value_heads(kv_heads / cut)
                               .head_dim(hidden / heads)
                               .max_position_embeddings(seq)
                               .tie_word_embeddings(false));
    auto tp = std::make_shared<dtrain::sharding::TensorParallelism>(mesh.tp(), sp, !keep_gathered);
    model->parallelize(tp);
    std::unique_ptr<dtrain::sharding::FullyShardedDataParallel<LlamaForCausalLM>> fsdp;
    if (local_of == 0 && mesh.dp() != nullptr && mesh.dp()->size() > 1) {
      fsdp = std::make_unique<dtrain::sharding::FullyShardedDataParallel<LlamaForCausalLM>>(
          model, mesh.dp(),
          dtrain::sharding::FSDPOptions().sync_module_states(false).auto_wrap(
              dtrain::sharding::AutoWrapPolicy().module_types({"LlamaDecoderLayer"})));
    }
    // The parameters the optimizer steps, and (under sequence parallelism) the gradients of
    // the replicated ones (the norms), summed over the tp group after backward.
    std::vector<at::Tensor> params;
    std::vector<std::string> replicated;
    if (fsdp) {
      for (const auto& [name, master] : fsdp->state().all_parameters()) {
        params.push_back(master);
        if (!tp->sliced(name)) replicated.push_back(name);
      }
    } else {
      for (const auto& p : model->named_parameters()) {
        params.push_back(p.value());
        if (!tp->sliced(p.key())) replicated.push_back(p.key());
      }
    }
    dtrain::optim::AdamW opt(params, torch::optim::AdamWOptions(1e-4));
    int64_t local_elements = 0;
    for (const auto& p : params) local_elements += p.numel();
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1234 + mesh.dp_rank());
    std::vector<double> times, forward_s, backward_s, wait_s;
    double steady_mb = 0, peak_mb = 0, pooled_mb = 0;
    int64_t window_start = 0, window_end = 0;
    for (int64_t s = 0; s < warmup + steps; ++s) {
      at::Tensor tokens = at::randint(0, vocab / cut, {batch, seq + 1}, gen);
      world->barrier().wait();
      const double steady = TrackedCpuMemory::current_bytes() / 1e6;
      const double pooled = fsdp ? fsdp->state().pooled_bytes() / 1e6 : 0;
      TrackedCpuMemory::reset_peak();
      const int64_t w0 = wall_us();
      const auto t0 = Clock::now();
      const double waited0 = dtrain::comm::host_wait_seconds();
      opt.zero_grad();
      at::Tensor input = tokens.narrow(1, 0, seq), target = tokens.narrow(1, 1, seq);
      at::Tensor logits = fsdp ? (*fsdp)(input) : model(input);
      at::Tensor loss = tp->loss(logits.reshape({-1, logits.size(-1)}), target.reshape({-1}),
                                 model->head_weight());
      const auto tf = Clock::now();
      loss.backward();
      if (tp->sequence_parallel()) {
        std::vector<at::Tensor> grads;
        if (fsdp) {
          for (const auto& [name, master] : fsdp->state().all_parameters()) {
            if (!tp->sliced(name)) grads.push_back(master.grad());
          }
        } else {
          for (const auto& name : replicated)
            grads.push_back(model->named_parameters()[name].grad());
        }
        tp->sync_replicated_grads(grads);
      }
      const auto tb = Clock::now();
      opt.step();
      const auto t1 = Clock::now();
      if (s == warmup) {
        window_start = w0;
        window_end = wall_us();
      }
      if (s >= warmup) {
        times.push_back(seconds(t0, t1));
        forward_s.push_back(seconds(t0, tf));
        backward_s.push_back(seconds(tf, tb));
        wait_s.push_back(dtrain::comm::host_wait_seconds() - waited0);
        steady_mb = std::max(steady_mb, steady);
        pooled_mb = std::max(pooled_mb, pooled);
        peak_mb = std::max(peak_mb, TrackedCpuMemory::peak_bytes() / 1e6);
      }
    }
    auto median_of = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    // A step pays every collective's time, the slow ones too: probes report the mean.
    auto mean_of = [](const std::vector<double>& v) {
      double sum = 0;
      for (double x : v) sum += x;
      return sum / static_cast<double>(v.size());
    };
    const double median = median_of(times);
    const double fwd = max_over(*world, median_of(forward_s));
    const double bwd = max_over(*world, median_of(backward_s));
    const double waited = max_over(*world, median_of(wait_s));
    // The collectives' times on this mesh, every rank issuing them at once as in a step: the
    // tp group's all-reduce and the data-parallel group's all-gather and reduce-scatter, at
    // sizes around the step's (median of 5 after 1), for the scaling model's alpha-beta.
    std::string probes;
    if (probe_comm) {
      const at::Tensor work_a = at::randn({batch * seq, hidden}), work_b = at::randn({hidden, ffn});
      auto probe = [&](const char* what, const std::shared_ptr<dtrain::comm::Communicator>& g,
                       int kind) {
        if (g == nullptr || g->size() == 1) return;
        std::string points;
        for (int64_t n : {int64_t{1} << 12, int64_t{1} << 14, int64_t{1} << 16, int64_t{1} << 18}) {
          std::vector<double> t;
          for (int rep = 0; rep < 12; ++rep) {
            at::Tensor a = at::ones({n}),
                       out = at::empty({kind == 1 ? n * g->size() : n / g->size()});
            world->barrier().wait();
            // As in a step: each rank computes (a layer's matrix product), then joins the
            // collective; its time counts from the end of this rank's compute, so it holds
            // what the shared cores add (the peer's lateness, waking the I/O thread).
            at::mm(work_a, work_b);
            const auto c0 = Clock::now();
            if (kind == 0) g->all_reduce(a).wait();
            if (kind == 1) g->all_gather(a, out).wait();
            if (kind == 2) g->reduce_scatter(a, out).wait();
            if (rep > 0) t.push_back(seconds(c0, Clock::now()));
          }
          // bytes: the full tensor's (an all-gather's output, a reduce-scatter's input).
          const int64_t full = kind == 1 ? n * g->size() : n;
          points += std::string(points.empty() ? "" : ",") + "[" + std::to_string(full * 4) + "," +
                    std::to_string(max_over(*world, mean_of(t))) + "]";
        }
        probes += std::string(",\"") + what + "\":[" + points + "]";
      };
      probe("tp_all_reduce", mesh.tp(), 0);
      probe("dp_all_gather", mesh.dp(), 1);
      probe("dp_reduce_scatter", mesh.dp(), 2);
    }
    rusage r{};
    getrusage(RUSAGE_SELF, &r);
    const double rss_mb = max_over(*world, r.ru_maxrss / 1024.0);
    steady_mb = max_over(*world, steady_mb);
    peak_mb = max_over(*world, peak_mb);
    pooled_mb = max_over(*world, pooled_mb);
    const double step_s = max_over(*world, median);
    if (!flight_out.empty()) {
      std::ofstream(flight_out + "/flight_rank" + std::to_string(world->rank()) + ".json")
          << dtrain::comm::flight::to_json("tp_bench");
    }
    if (world->rank() == 0) {
      std::printf(
          "{\"impl\":\"dtrain\",\"local_of\":%d,\"tp\":%d,\"sp\":%s,\"regather\":%s,\"dp\":%d,"
          "\"world\":%d,"
          "\"layers\":%lld,"
          "\"hidden\":%lld,\"heads\":%lld,\"kv_heads\":%lld,\"ffn\":%lld,\"vocab\":%lld,"
          "\"seq\":%lld,\"batch\":%lld,\"median_step_s\":%.5f,\"steady_mb\":%.3f,\"pooled_mb\":%."
          "3f,"
          "\"peak_mb\":%.3f,\"peak_rss_mb\":%.1f,\"local_elements\":%lld,"
          "\"window_us\":[%lld,%lld],\"forward_s\":%.5f,\"backward_s\":%.5f,\"wait_s\":%.5f%s}\n",
          local_of, tp_degree, sp ? "true" : "false", keep_gathered ? "false" : "true",
          mesh.dp_size(), world->size(), static_cast<long long>(layers),
          static_cast<long long>(hidden), static_cast<long long>(heads),
          static_cast<long long>(kv_heads), static_cast<long long>(ffn),
          static_cast<long long>(vocab), static_cast<long long>(seq), static_cast<long long>(batch),
          step_s, steady_mb, pooled_mb, peak_mb, rss_mb, static_cast<long long>(local_elements),
          static_cast<long long>(window_start), static_cast<long long>(window_end), fwd, bwd,
          waited, probes.c_str());
      std::fflush(stdout);
    }
    world->barrier().wait();
  }
  return 0;
}
