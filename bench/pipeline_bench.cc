// The pipeline's schedules measured on a real run: per step, each rank's time in forwards and
// backwards against the step's wall time gives the measured bubble (idle fraction of ranks x
// step time), printed beside the schedule's theory and its simulation with the costs measured
// here; and each rank's peak of micro-batches held against the schedule's promise.
//
//   dtrain-launch --nproc-per-node 2 -- pipeline_bench --schedule 1f1b --micro-batches 8
//
// A Llama of --layers layers (hidden --hidden, sequence --seq, micro-batch --micro) split
// evenly into ranks x --stages-per-rank stages; --steps timed after one warm-up step.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "comm/factory.h"
#include "core/cli.h"
#include "core/trace.h"
#include "framework/config.h"
#include "framework/memory.h"
#include "framework/metrics.h"
#include "framework/models/llama.h"
#include "sharding/pipeline.h"

namespace pp = dtrain::sharding::pp;

int main(int argc, char** argv) {
  CLI::App app{"pipeline_bench: measured bubble and activations held, per schedule"};
  dtrain::cli::setup(app, "pipeline_bench");
  std::string schedule = "1f1b";
  int micro_batches = 8, per_rank = 1, steps = 5;
  int64_t layers = 8, hidden = 256, seq = 128, micro = 2;
  app.add_option("--schedule", schedule, "gpipe, 1f1b, interleaved_1f1b or zero_bubble");
  app.add_option("--micro-batches", micro_batches, "micro-batches per step");
  app.add_option("--stages-per-rank", per_rank, "stages per rank (interleaved_1f1b: 2 or more)");
  app.add_option("--steps", steps, "timed steps");
  app.add_option("--layers", layers, "decoder layers");
  app.add_option("--hidden", hidden, "hidden size");
  app.add_option("--seq", seq, "sequence length");
  app.add_option("--micro", micro, "sequences per micro-batch");
  std::string trace_path;
  app.add_option("--trace", trace_path,
                 "also record one more step's timeline (Chrome trace-event JSON; scripts/plot "
                 "draws it)");
  dtrain::cli::parse(app, argc, argv);
  at::set_num_threads(1);

  dtrain::framework::TrackedCpuMemory::install();
  auto world = dtrain::comm::create_world();
  const int rank = world->rank(), size = world->size();
  dtrain::framework::LlamaOptions o;
  o.vocab_size(512)
      .hidden_size(hidden)
      .intermediate_size(hidden * 8 / 3 / 64 * 64)
      .num_hidden_layers(layers)
      .num_attention_heads(hidden / 64)
      .num_key_value_heads(hidden / 64)
      .tie_word_embeddings(false);
  at::manual_seed(0);
  dtrain::framework::LlamaForCausalLM model(o);
  pp::Pipeline pipe(pp::make_schedule(pp::parse_schedule(schedule), size, micro_batches, per_rank),
                    world);
  const int S = pipe.schedule().stages;
  const auto ranges = pp::split_layers(layers, S);
  std::vector<at::Tensor> tokens, targets;
  for (int m = 0; m < micro_batches; ++m) {
    tokens.push_back(at::randint(512, {micro, seq}));
    targets.push_back(at::randint(512, {micro, seq}));
  }
  pp::Pipeline::Step step;
  step.forward = [&](int stage, int, const at::Tensor& x) {
    return model->forward_stage(x, ranges[stage].first, ranges[stage].second);
  };
  step.loss = [&](int m, const at::Tensor& logits) {
    return at::cross_entropy_loss(logits.reshape({-1, 512}),
                                  targets[static_cast<size_t>(m)].reshape({-1})) /
           micro_batches;
  };
  step.inputs = tokens;
  step.activation_shape = {micro, seq, hidden};
  double wall = 0, busy = 0, forward = 0, backward = 0;
  int64_t held_bytes = 0;  // the step's peak of tensor memory above its start
  int n_forward = 0, n_backward = 0;
  for (int s = 0; s <= steps; ++s) {
    model->zero_grad();
    world->barrier().wait();
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t before = dtrain::framework::TrackedCpuMemory::current_bytes();
    dtrain::framework::TrackedCpuMemory::reset_peak();
    pipe.run(step);
    held_bytes = std::max(held_bytes, dtrain::framework::TrackedCpuMemory::peak_bytes() - before);
    world->barrier().wait();
    const double w = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s == 0) continue;  // warm-up
    wall += w;
    for (const auto& span : pipe.spans()) {
      const double d = span.end - span.start;
      if (span.action.op == pp::Op::kForward) {
        forward += d;
        ++n_forward;
      } else if (span.action.gives_input_grad()) {
        backward += d;  // a whole backward, or its input half (zero_bubble)
        ++n_backward;
      } else if (span.action.op == pp::Op::kBackwardWeight) {
        backward += d;  // the weight half: one backward is I + W
      }
    }
  }
  if (!trace_path.empty()) {
    model->zero_grad();
    world->barrier().wait();
    dtrain::trace::configure(rank);
    dtrain::trace::set_recording(true);
    {
      dtrain::trace::Scope traced("step", "step");
      pipe.run(step);
    }
    dtrain::trace::set_recording(false);
    dtrain::framework::RunConfig c;
    c.source = "pipeline_bench --schedule " + schedule + " --micro-batches " +
               std::to_string(micro_batches) + " --stages-per-rank " + std::to_string(per_rank);
    c.logging.trace = trace_path;
    c.logging.trace_start = steps + 1;  // the step after the timed ones
    c.logging.trace_steps = 1;
    c.parallel.strategy = dtrain::framework::ParallelStrategy::kNone;  // pipeline alone
    dtrain::framework::write_trace(c, world.get(), rank, size);
  }
  busy = forward + backward;
  // Over the ranks: busy time, the slowest wall time, the mean forward and backward costs.
  at::Tensor sums = at::tensor(
      {busy, forward, backward, static_cast<double>(n_forward), static_cast<double>(n_backward)},
      at::kDouble);
  world->all_reduce(sums, dtrain::comm::ReduceOp::kSum).wait();
  at::Tensor slowest = at::tensor({wall}, at::kDouble);
  world->all_reduce(slowest, dtrain::comm::ReduceOp::kMax).wait();
  at::Tensor peaks = at::zeros({2, size}, at::kLong);
  peaks[0][rank] = pipe.peak_in_flight();
  peaks[1][rank] = held_bytes;
  world->all_reduce(peaks, dtrain::comm::ReduceOp::kSum).wait();
  if (rank == 0) {
    const double total_busy = sums[0].item<double>(), wall_max = slowest[0].item<double>();
    const double measured = 1.0 - total_busy / (size * wall_max);
    const double f = sums[1].item<double>() / sums[3].item<double>();
    const double b = sums[2].item<double>() / sums[4].item<double>();
    // The schedule on paper with the costs measured here (per stage, times stages per rank).
    const pp::Simulation sim = pp::simulate(pipe.schedule(), f * per_rank, b * per_rank);
    std::printf(
        "pipeline_bench %s pp=%d m=%d v=%d: step %.1f ms; bubble measured %.3f, simulated with "
        "these costs %.3f, theory %.3f; forward %.2f ms, backward %.2f ms per stage; peak "
        "micro-batches held per rank",
        schedule.c_str(), size, micro_batches, per_rank, 1e3 * wall_max / steps, measured,
        sim.bubble, pp::theoretical_bubble(pipe.schedule()), 1e3 * f, 1e3 * b);
    bool kept = true;
    for (int r = 0; r < size; ++r) {
      const int64_t peak = peaks[0][r].item<int64_t>();
      const int promise = pipe.schedule().promised_in_flight[static_cast<size_t>(r)];
      std::printf(" %lld/%d", static_cast<long long>(peak), promise);
      kept = kept && peak <= promise;
    }
    std::printf(" (held/promised)%s; peak tensor memory per rank above the step's start",
                kept ? "" : " OVER THE PROMISE");
    for (int r = 0; r < size; ++r) std::printf(" %.1f", peaks[1][r].item<int64_t>() / 1048576.0);
    std::printf(" MiB\n");
    if (!kept) return 1;
  }
  world->barrier().wait();
  return 0;
}
