// dtrain's side of the FSDP-against-PyTorch comparison (sharding/fsdp_parity_test.sh runs it
// beside bench/reference/fsdp_reference.py, PyTorch's fully_shard, on the same machine).
//
//   dtrain-launch --nproc-per-node 2 -- fsdp_parity --precision bf16 --steps 20 --out DIR
//
// Trains the TransformerLM FULL_SHARD (every block a unit, the rest the root) with AdamW and,
// for fp16, the ShardedGradScaler. Rank 0 writes the initial weights (DIR/init.pt, a dict
// PyTorch's torch.load reads) and, per step, the loss averaged over ranks and the scale
// (DIR/dtrain.json). The data of step s on rank r is torch.randint(0, vocab, (B, T)) from a
// CPU generator seeded 1000 + s * world + r: the same draws in C++ and Python.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/optim/adamw.h>
#include <torch/serialize.h>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "amp/sharded_grad_scaler.h"
#include "comm/factory.h"
#include "core/cli.h"
#include "framework/models/transformer_lm.h"
#include "sharding/fsdp.h"

using dtrain::framework::TransformerLM;
using dtrain::framework::TransformerLMOptions;

int main(int argc, char** argv) {
  CLI::App app{"fsdp_parity: dtrain FSDP's loss trajectory, for comparison with PyTorch"};
  dtrain::cli::setup(app, "fsdp_parity");
  std::string precision = "fp32", out_dir;
  int64_t steps = 20, vocab = 64, seq = 16, d_model = 32, layers = 2, heads = 4, batch = 4;
  // fp16: a scale high enough to overflow early and a short growth interval, so the
  // trajectory backs off and grows several times in 20 steps.
  double init_scale = 16777216.0;
  int64_t growth_interval = 4;
  app.add_option("--precision", precision, "fp32, bf16 or fp16")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  app.add_option("--steps", steps, "optimizer steps");
  app.add_option("--out", out_dir, "folder for init.pt and dtrain.json")->required();
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
  dtrain::sharding::FullyShardedDataParallel<TransformerLM> fsdp(
      model, world, dtrain::sharding::FSDPOptions().mixed_precision(policy));

  // The start both sides train from (rank 0's values, which FSDP gave every rank).
  auto full = fsdp.state().full_parameters();
  if (rank == 0) {
    c10::impl::GenericDict dict(c10::StringType::get(), c10::TensorType::get());
    for (const auto& [name, t] : full) dict.insert(name, t);
    std::vector<char> bytes = torch::pickle_save(c10::IValue(dict));
    std::ofstream f(out_dir + "/init.pt", std::ios::binary);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }

  torch::optim::AdamW opt(fsdp.parameters(), torch::optim::AdamWOptions(1e-3));
  dtrain::amp::ShardedGradScaler scaler(world, dtrain::amp::GradScalerOptions()
                                                   .init_scale(init_scale)
                                                   .growth_interval(growth_interval)
                                                   .enabled(precision == "fp16"));
  std::vector<double> losses, scales;
  int64_t skipped = 0;
  for (int64_t s = 0; s < steps; ++s) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + s * size + rank);
    at::Tensor x = at::randint(0, vocab, {batch, seq}, gen);
    at::Tensor y = at::randint(0, vocab, {batch, seq}, gen);
    opt.zero_grad(true);
    at::Tensor logits = fsdp(x).to(at::kFloat);
    at::Tensor loss = at::cross_entropy_loss(logits.reshape({-1, vocab}), y.reshape(-1));
    scaler.scale(loss).backward();
    if (!scaler.step(opt)) ++skipped;
    scaler.update();
    at::Tensor mean = loss.detach().reshape({1}).to(at::kDouble);
    world->all_reduce(mean, dtrain::comm::ReduceOp::kAvg).wait();
    losses.push_back(mean.item<double>());
    scales.push_back(scaler.is_enabled() ? scaler.get_scale() : 1.0);
  }
  if (rank == 0) {
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
