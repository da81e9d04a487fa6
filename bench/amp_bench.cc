// amp_bench: what mixed precision buys on one device. The same TransformerLM trains a few
// steps in fp32, bf16 and fp16 (autocast + GradScaler for fp16, as the trainer does), and a
// table gives the mean step time, the speedup over fp32, tokens/s, achieved TFLOP/s and the
// model FLOP utilisation, and on CUDA the peak allocated memory.
//
//   amp_bench --device cuda --d-model 1024 --layers 12 --heads 16 --seq 1024 --batch 8
//
// The step is the trainer's: ATen's fused AdamW (dtrain::optim::AdamW; --optimizer torch for
// LibTorch's per-parameter one), the GradScaler's verdict left on the device
// (step_deferred), and nothing read back to the host inside the timed steps: the device is
// synchronized once before and once after each block of --steps, and the losses are read at
// the end. The step time is the mean of the fastest of --repeats blocks: on an H200 the 152M
// model's 16-bit step (24 ms) measured 24-32 ms from one 10-step block to the next with the same
// code, and a single block failed the baseline check on noise.
//
// FLOPs per step follow the PaLM appendix: 6 x (non-embedding parameters) per token for the
// matrix products, plus 12 x layers x d_model x seq per token for attention; MFU divides the
// achieved rate by --peak-tflops (default: the H200/H100 SXM dense bf16/fp16 rate, 989; the
// fp32 row by --peak-fp32-tflops, 67, since LibTorch leaves TF32 off by default).
//
// --trace-dir DIR writes one more step of each precision as a Chrome trace (Kineto, the
// profiler behind torch.profiler; CUDA kernels too on a GPU): DIR/amp_bench_<precision>.json.
// --save-baseline FILE writes each precision's step time; --baseline FILE compares with such a
// file and exits 3 when a precision's step is more than --tolerance slower (default 10%), so a
// change that slows the step is named.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/cuda.h>
#include <torch/optim/adamw.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "amp/autocast.h"
#include "amp/grad_scaler.h"
#include "core/cli.h"
#include "framework/models/transformer_lm.h"
#include "optim/fused.h"

#ifdef DTRAIN_TORCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

using Clock = std::chrono::steady_clock;
using dtrain::framework::TransformerLM;
using dtrain::framework::TransformerLMOptions;

namespace {

struct Row {
  std::string precision;
  double step_s = 0;
  double peak_gb = -1;
  double first_loss = 0, last_loss = 0;
};

void synchronize(const c10::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

double peak_gb(const c10::Device& device) {
#ifdef DTRAIN_TORCH_CUDA
  if (device.is_cuda()) {
    auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    return static_cast<double>(stats.allocated_bytes[0].peak) / 1e9;
  }
#endif
  (void)device;
  return -1;
}

void reset_peak(const c10::Device& device) {
#ifdef DTRAIN_TORCH_CUDA
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
#endif
  (void)device;
}

// "precision step_ms" lines, as --save-baseline writes them.
std::map<std::string, double> read_baseline(const std::string& path) {
  std::map<std::string, double> out;
  std::ifstream f(path);
  std::string precision;
  double ms = 0;
  while (f >> precision >> ms) out[precision] = ms;
  return out;
}

// One step's work, as the trainer does it; nothing read back to the host.
struct Step {
  TransformerLM& model;
  torch::optim::Optimizer& opt;
  dtrain::amp::GradScaler& scaler;
  const at::Tensor& tokens;
  const at::Tensor& targets;
  c10::Device device;
  c10::ScalarType dtype;
  bool low;
  int64_t vocab;

  at::Tensor operator()() const {
    opt.zero_grad(true);
    at::Tensor loss;
    {
      dtrain::amp::AutocastGuard autocast(device.type(), dtype, low);
      at::Tensor logits = model->forward(tokens);
      loss = at::cross_entropy_loss(logits.reshape({-1, vocab}), targets.reshape(-1));
    }
    scaler.scale(loss).backward();
    scaler.step_deferred(opt);
    scaler.update();
    return loss.detach();
  }
};

// One more step under the Kineto profiler, saved as a Chrome trace.
void trace_step(const Step& step, const std::string& precision, const std::string& path) {
  namespace prof = torch::profiler::impl;
  std::set<prof::ActivityType> activities{prof::ActivityType::CPU};
  if (step.device.is_cuda()) activities.insert(prof::ActivityType::CUDA);
  const prof::ProfilerConfig config(prof::ProfilerState::KINETO, /*report_input_shapes=*/true);
  torch::autograd::profiler::prepareProfiler(config, activities);
  torch::autograd::profiler::enableProfiler(config, activities);
  step();
  synchronize(step.device);
  torch::autograd::profiler::disableProfiler()->save(path);
  if (!std::ifstream(path)) throw std::runtime_error("cannot write " + path);
  std::printf("amp_bench: trace of one %s step: %s\n", precision.c_str(), path.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"amp_bench: TransformerLM step time in fp32, bf16 and fp16 on one device"};
  dtrain::cli::setup(app, "amp_bench");
  std::string device_name = "cpu";
  int64_t d_model = 256, layers = 4, heads = 4, seq = 128, batch = 8, vocab = 256, steps = 10,
          warmup = 3, repeats = 3;
  double peak_tflops = 989.0, peak_fp32_tflops = 67.0;
  std::vector<std::string> precisions{"fp32", "bf16", "fp16"};
  app.add_option("--device", device_name, "cpu or cuda[:N]");
  app.add_option("--d-model", d_model, "model width");
  app.add_option("--layers", layers, "transformer blocks");
  app.add_option("--heads", heads, "attention heads");
  app.add_option("--seq", seq, "tokens per sequence");
  app.add_option("--batch", batch, "sequences per step");
  app.add_option("--vocab", vocab, "vocabulary size");
  app.add_option("--steps", steps, "timed steps per precision")->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "untimed steps first (at least one is taken)");
  app.add_option("--repeats", repeats, "timed blocks of --steps; the fastest block counts")
      ->check(CLI::PositiveNumber);
  app.add_option("--precisions", precisions, "subset of fp32 bf16 fp16");
  app.add_option("--peak-tflops", peak_tflops, "dense bf16/fp16 peak for MFU");
  app.add_option("--peak-fp32-tflops", peak_fp32_tflops, "fp32 peak for the fp32 row's MFU");
  std::string optimizer = "fused", trace_dir, baseline, save_baseline;
  double tolerance = 0.10;
  app.add_option("--optimizer", optimizer, "fused (ATen's fused AdamW, as the trainer) or torch")
      ->check(CLI::IsMember({"fused", "torch"}));
  app.add_option("--trace-dir", trace_dir, "write one step per precision as a Chrome trace here");
  app.add_option("--baseline", baseline, "compare step times with this --save-baseline file");
  app.add_option("--tolerance", tolerance, "with --baseline: allowed slowdown (0.10: 10%)");
  app.add_option("--save-baseline", save_baseline, "write each precision's step time here");
  dtrain::cli::parse(app, argc, argv);

  c10::Device device(device_name);
  if (device.is_cuda() && !device.has_index()) device = c10::Device(c10::kCUDA, 0);
  if (device.is_cuda() && !torch::cuda::is_available()) {
    std::fprintf(stderr, "amp_bench: --device %s, but no CUDA device is visible\n",
                 device_name.c_str());
    return 2;
  }
  auto options = TransformerLMOptions()
                     .vocab_size(vocab)
                     .seq_len(seq)
                     .d_model(d_model)
                     .n_layers(layers)
                     .n_heads(heads)
                     .d_ff(4 * d_model);
  const int64_t params = dtrain::framework::transformer_lm_parameter_count(options);
  const int64_t embedding = (vocab + seq) * d_model;
  const double tokens = static_cast<double>(batch * seq);
  const double flops =
      tokens * (6.0 * static_cast<double>(params - embedding) + 12.0 * layers * d_model * seq);
  std::printf(
      "amp_bench: TransformerLM %.1fM parameters (d_model %lld, %lld layers, seq %lld), "
      "batch %lld, %s; %.2f TFLOP per step\n",
      params / 1e6, static_cast<long long>(d_model), static_cast<long long>(layers),
      static_cast<long long>(seq), static_cast<long long>(batch), device_name.c_str(),
      flops / 1e12);

  auto gen = at::make_generator<at::CPUGeneratorImpl>(42);
  at::Tensor tokens_in = at::randint(0, vocab, {batch, seq}, gen).to(device);
  at::Tensor targets = at::randint(0, vocab, {batch, seq}, gen).to(device);
  std::vector<Row> rows;
  for (const auto& precision : precisions) {
    const bool low = precision != "fp32";
    const c10::ScalarType dtype = precision == "fp16" ? at::kHalf : at::kBFloat16;
    at::manual_seed(1);
    TransformerLM model(options);
    model->to(device);
    std::unique_ptr<torch::optim::Optimizer> opt;
    if (optimizer == "fused") {
      opt = std::make_unique<dtrain::optim::AdamW>(model->parameters(),
                                                   torch::optim::AdamWOptions(1e-4));
    } else {
      opt = std::make_unique<torch::optim::AdamW>(model->parameters(),
                                                  torch::optim::AdamWOptions(1e-4));
    }
    dtrain::amp::GradScaler scaler(dtrain::amp::GradScalerOptions().enabled(precision == "fp16"));
    const Step step{model, *opt, scaler, tokens_in, targets, device, dtype, low, vocab};
    Row row;
    row.precision = precision;
    reset_peak(device);
    at::Tensor first = step();
    for (int64_t s = 1; s < warmup; ++s) step();
    synchronize(device);
    at::Tensor last = first;
    row.step_s = std::numeric_limits<double>::infinity();
    for (int64_t r = 0; r < repeats; ++r) {
      const auto t0 = Clock::now();
      for (int64_t s = 0; s < steps; ++s) last = step();
      synchronize(device);
      row.step_s =
          std::min(row.step_s, std::chrono::duration<double>(Clock::now() - t0).count() / steps);
    }
    row.first_loss = first.item<double>();
    row.last_loss = last.item<double>();
    row.peak_gb = peak_gb(device);
    if (!trace_dir.empty()) {
      try {  // a profiler that cannot start (no CUPTI, say) costs the trace, not the figures
        trace_step(step, precision, trace_dir + "/amp_bench_" + precision + ".json");
      } catch (const std::exception& e) {
        std::fprintf(stderr, "amp_bench: no trace of the %s step: %s\n", precision.c_str(),
                     e.what());
      }
    }
    rows.push_back(row);
  }

  const double fp32_time = rows.front().precision == "fp32" ? rows.front().step_s : 0;
  std::printf(
      "\n| precision | step (ms) | speedup vs fp32 | tokens/s | TFLOP/s | MFU | peak "
      "memory (GB) | loss first -> last |\n|---|---|---|---|---|---|---|---|\n");
  for (const auto& r : rows) {
    const double tflops = flops / r.step_s / 1e12;
    const double peak = r.precision == "fp32" ? peak_fp32_tflops : peak_tflops;
    std::printf(
        "| %s | %.1f | %s | %.0f | %.1f | %.1f%% | %s | %.3f -> %.3f |\n", r.precision.c_str(),
        r.step_s * 1e3,
        fp32_time > 0 ? (std::to_string(fp32_time / r.step_s).substr(0, 4) + "x").c_str() : "-",
        tokens / r.step_s, tflops, 100.0 * tflops / peak,
        r.peak_gb >= 0 ? std::to_string(r.peak_gb).substr(0, 5).c_str() : "-", r.first_loss,
        r.last_loss);
  }
  std::printf("\nMFU: against %.0f TFLOP/s (dense bf16/fp16) and %.0f TFLOP/s for fp32.\n",
              peak_tflops, peak_fp32_tflops);
  if (!save_baseline.empty()) {
    std::ofstream f(save_baseline);
    for (const auto& r : rows) f << r.precision << " " << r.step_s * 1e3 << "\n";
    std::printf("amp_bench: step times written to %s\n", save_baseline.c_str());
  }
  int rc = 0;
  if (!baseline.empty()) {
    const auto before = read_baseline(baseline);
    for (const auto& r : rows) {
      auto it = before.find(r.precision);
      if (it == before.end()) {
        std::printf("%s: no baseline in %s\n", r.precision.c_str(), baseline.c_str());
        continue;
      }
      const double ratio = r.step_s * 1e3 / it->second;
      const bool slower = ratio > 1.0 + tolerance;
      std::printf("%s: %.1f ms against the baseline's %.1f ms (%.2fx)%s\n", r.precision.c_str(),
                  r.step_s * 1e3, it->second, ratio,
                  slower ? ": SLOWER than the baseline allows" : "");
      if (slower) rc = 3;
    }
  }
  return rc;
}
