// amp_bench: what mixed precision buys on one device. The same TransformerLM trains a few
// steps in fp32, bf16 and fp16 (autocast + GradScaler for fp16, as the trainer does), and a
// table gives the median step time, the speedup over fp32, tokens/s, achieved TFLOP/s and the
// model FLOP utilisation, and on CUDA the peak allocated memory.
//
//   amp_bench --device cuda --d-model 1024 --layers 12 --heads 16 --seq 1024 --batch 8
//
// FLOPs per step follow the PaLM appendix: 6 x (non-embedding parameters) per token for the
// matrix products, plus 12 x layers x d_model x seq per token for attention; MFU divides the
// achieved rate by --peak-tflops (default: the H200/H100 SXM dense bf16/fp16 rate, 989; the
// fp32 row by --peak-fp32-tflops, 67, since LibTorch leaves TF32 off by default).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/cuda.h>
#include <torch/optim/adamw.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "amp/autocast.h"
#include "amp/grad_scaler.h"
#include "core/cli.h"
#include "framework/models/transformer_lm.h"

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

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

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

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"amp_bench: TransformerLM step time in fp32, bf16 and fp16 on one device"};
  dtrain::cli::setup(app, "amp_bench");
  std::string device_name = "cpu";
  int64_t d_model = 256, layers = 4, heads = 4, seq = 128, batch = 8, vocab = 256, steps = 10,
          warmup = 3;
  double peak_tflops = 989.0, peak_fp32_tflops = 67.0;
  std::vector<std::string> precisions{"fp32", "bf16", "fp16"};
  app.add_option("--device", device_name, "cpu or cuda[:N]");
  app.add_option("--d-model", d_model, "model width");
  app.add_option("--layers", layers, "transformer blocks");
  app.add_option("--heads", heads, "attention heads");
  app.add_option("--seq", seq, "tokens per sequence");
  app.add_option("--batch", batch, "sequences per step");
  app.add_option("--vocab", vocab, "vocabulary size");
  app.add_option("--steps", steps, "timed steps per precision");
  app.add_option("--warmup", warmup, "untimed steps first");
  app.add_option("--precisions", precisions, "subset of fp32 bf16 fp16");
  app.add_option("--peak-tflops", peak_tflops, "dense bf16/fp16 peak for MFU");
  app.add_option("--peak-fp32-tflops", peak_fp32_tflops, "fp32 peak for the fp32 row's MFU");
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
    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-4));
    dtrain::amp::GradScaler scaler(dtrain::amp::GradScalerOptions().enabled(precision == "fp16"));
    Row row;
    row.precision = precision;
    std::vector<double> times;
    reset_peak(device);
    for (int64_t s = 0; s < warmup + steps; ++s) {
      synchronize(device);
      auto t0 = Clock::now();
      opt.zero_grad(true);
      at::Tensor loss;
      {
        dtrain::amp::AutocastGuard autocast(device.type(), dtype, low);
        at::Tensor logits = model->forward(tokens_in);
        loss = at::cross_entropy_loss(logits.reshape({-1, vocab}), targets.reshape(-1));
      }
      scaler.scale(loss).backward();
      scaler.step(opt);
      scaler.update();
      synchronize(device);
      if (s >= warmup) times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      const double l = loss.item<double>();
      if (s == 0) row.first_loss = l;
      row.last_loss = l;
    }
    row.step_s = median(times);
    row.peak_gb = peak_gb(device);
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
  return 0;
}
