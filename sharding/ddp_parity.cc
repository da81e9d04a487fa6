// dtrain's side of the DDP-against-PyTorch comparison, bit for bit (sharding/ddp_parity_test.sh
// runs it beside bench/reference/ddp_reference.py --init, PyTorch's DDP, on the same machine).
//
//   dtrain-launch --nproc-per-node 2 -- ddp_parity --precision bf16 --steps 12 --out DIR
//
// The pieces a user's DDP run is made of, as dtrain ships them: the TransformerLM (at::linear
// everywhere), DistributedDataParallel with the precision preset's reduce dtype (bf16 and
// fp16 buckets for those presets), the forward and the loss under autocast in the preset's
// dtype, dtrain::optim::AdamW (the fused kernel) and, for fp16, the GradScaler handing its
// scale and DDP's found-inf flag (DDPOptions::check_finite) to the kernel. PyTorch's side: DDP with
// bf16_compress_hook / fp16_compress_hook, torch.autocast, AdamW(fused=True) and
// torch.amp.GradScaler.
//
// Rank 0 writes the initial weights (DIR/init.pt, a dict PyTorch's torch.load reads), the
// weights after the last step (DIR/final.pt) and, per step, the loss averaged over ranks and
// the scale (DIR/dtrain.json). The data of step s on rank r is torch.randint(0, vocab, (B, T))
// from a CPU generator seeded 1000 + s * world + r: the same draws in C++ and Python.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/serialize.h>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "amp/autocast.h"
#include "amp/grad_scaler.h"
#include "amp/policy.h"
#include "comm/factory.h"
#include "core/cli.h"
#include "framework/models/transformer_lm.h"
#include "optim/fused.h"
#include "sharding/ddp.h"

using dtrain::framework::TransformerLM;
using dtrain::framework::TransformerLMOptions;

namespace {

void save_parameters(const TransformerLM& model, const std::string& path) {
  c10::impl::GenericDict dict(c10::StringType::get(), c10::TensorType::get());
  for (const auto& item : model->named_parameters()) dict.insert(item.key(), item.value());
  std::vector<char> bytes = torch::pickle_save(c10::IValue(dict));
  std::ofstream f(path, std::ios::binary);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ddp_parity: a dtrain DDP run's losses and weights, for comparison with PyTorch"};
  dtrain::cli::setup(app, "ddp_parity");
  std::string precision = "fp32", out_dir;
  int64_t steps = 12, vocab = 64, seq = 16, d_model = 32, layers = 2, heads = 4, batch = 4;
  // fp16: a scale high enough to overflow early and a short growth interval, so the run
  // skips steps and grows the scale within a few steps.
  double init_scale = 16777216.0;
  int64_t growth_interval = 4;
  app.add_option("--precision", precision, "fp32, bf16 or fp16")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  app.add_option("--steps", steps, "optimizer steps");
  app.add_option("--out", out_dir, "folder for init.pt, final.pt and dtrain.json")->required();
  app.add_option("--init-scale", init_scale, "fp16: the GradScaler's initial scale");
  app.add_option("--growth-interval", growth_interval, "fp16: the GradScaler's growth interval");
  dtrain::cli::parse(app, argc, argv);

  auto world = dtrain::comm::create_world();
  const int rank = world->rank(), size = world->size();
  at::manual_seed(42);
  TransformerLM model(TransformerLMOptions()
                          .vocab_size(vocab)
                          .seq_len(seq)
                          .d_model(d_model)
                          .n_layers(layers)
                          .n_heads(heads)
                          .d_ff(2 * d_model)
                          .tie_weights(true));
  const auto policy = dtrain::amp::MixedPrecisionPolicy::preset(precision);
  // DDP broadcasts rank 0's weights: the start both sides train from.
  dtrain::sharding::DistributedDataParallel<TransformerLM> ddp(
      model, world,
      dtrain::sharding::DDPOptions()
          .reduce_dtype(policy.effective_reduce_dtype())
          .check_finite(policy.needs_grad_scaler()));
  if (rank == 0) save_parameters(model, out_dir + "/init.pt");

  dtrain::optim::AdamW opt(ddp.parameters(), torch::optim::AdamWOptions(1e-3));
  dtrain::amp::GradScaler scaler(dtrain::amp::GradScalerOptions()
                                     .init_scale(init_scale)
                                     .growth_interval(growth_interval)
                                     .enabled(policy.needs_grad_scaler()));
  const bool autocast = policy.is_low_precision();
  std::vector<double> losses, scales;
  int64_t skipped = 0;
  for (int64_t s = 0; s < steps; ++s) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + s * size + rank);
    at::Tensor x = at::randint(0, vocab, {batch, seq}, gen);
    at::Tensor y = at::randint(0, vocab, {batch, seq}, gen);
    opt.zero_grad(true);
    at::Tensor loss;
    {
      dtrain::amp::AutocastGuard ac(
          c10::kCPU, autocast ? std::optional<c10::ScalarType>(policy.param_dtype) : std::nullopt,
          autocast);
      at::Tensor logits = ddp(x).to(at::kFloat);
      loss = at::cross_entropy_loss(logits.reshape({-1, vocab}), y.reshape(-1));
    }
    scaler.scale(loss).backward();
    // fp16: DDP's inf/NaN verdict from its write-back, so the scaler does not check again.
    if (!(scaler.is_enabled() ? scaler.step(opt, ddp.found_inf()) : scaler.step(opt))) ++skipped;
    scaler.update();
    at::Tensor mean = loss.detach().reshape({1}).to(at::kDouble);
    world->all_reduce(mean, dtrain::comm::ReduceOp::kSum).wait();
    losses.push_back(mean.item<double>() / size);
    scales.push_back(scaler.is_enabled() ? scaler.get_scale() : 1.0);
  }
  if (rank == 0) {
    save_parameters(model, out_dir + "/final.pt");
    std::FILE* f = std::fopen((out_dir + "/dtrain.json").c_str(), "w");
    std::fprintf(f, "{\"impl\": \"dtrain\", \"precision\": \"%s\", \"loss\": [", precision.c_str());
    for (size_t i = 0; i < losses.size(); ++i) std::fprintf(f, "%s%.17g", i ? ", " : "", losses[i]);
    std::fprintf(f, "], \"scale\": [");
    for (size_t i = 0; i < scales.size(); ++i) std::fprintf(f, "%s%.17g", i ? ", " : "", scales[i]);
    std::fprintf(f, "], \"skipped\": %lld}\n", static_cast<long long>(skipped));
    std::fclose(f);
  }
  world->barrier().wait();
  return 0;
}
