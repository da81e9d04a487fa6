// dtrain's side of the FSDP-against-PyTorch comparison (tests/parity/fsdp_parity_test.sh runs it
// beside bench/reference/fsdp_reference.py, PyTorch's fully_shard, on the same machine).
//
//   dtrain-launch --nproc-per-node 2 -- fsdp_parity --precision bf16 --steps 20 --out DIR
//
// Trains the TransformerLM FULL_SHARD (every block a unit, the rest the root) with AdamW and,
// for fp16, the ShardedGradScaler. --fused: dtrain's fused AdamW (ATen's kernel, Python's
// AdamW(fused=True)); --clip C: clip_grad_norm_(C) after unscaling, as PyTorch's recipe. Rank 0
// writes the initial weights (DIR/init.pt, a dict PyTorch's torch.load reads) and, per step, the
// loss averaged over ranks and the scale (DIR/dtrain.json). The data of step s on rank r is
// torch.randint(0, vocab, (B, T)) from a CPU generator seeded 1000 + s * world + r: the same draws
// in C++ and Python.
#include <ATen/ATen.h>
#include <torch/optim/adamw.h>

#include <memory>
#include <string>
#include <vector>

#include "amp/sharded_grad_scaler.h"
#include "comm/factory.h"
#include "core/cli.h"
#include "framework/models/transformer_lm.h"
#include "optim/fused.h"
#include "sharding/fsdp.h"
#include "tests/parity/parity_run.h"

using dtrain::framework::TransformerLM;

int main(int argc, char** argv) {
  CLI::App app{"fsdp_parity: dtrain FSDP's loss trajectory, for comparison with PyTorch"};
  dtrain::cli::setup(app, "fsdp_parity");
  dtrain::parity::Args args;
  dtrain::parity::add_options(app, args, "folder for init.pt and dtrain.json");
  bool fused = false, flat = false;
  double clip = 0;
  app.add_flag("--fused", fused, "dtrain's fused AdamW (Python's AdamW(fused=True))");
  app.add_flag("--flat", flat,
               "FSDP1's flat shard layout instead of fully_shard's per-parameter one");
  app.add_option("--clip", clip, "clip the gradients' total norm to this (0: off)");
  dtrain::cli::parse(app, argc, argv);

  auto world = dtrain::comm::create_world();
  const int rank = world->rank(), size = world->size();
  TransformerLM model = dtrain::parity::make_model(args);
  const auto policy = dtrain::amp::MixedPrecisionPolicy::preset(args.precision);
  dtrain::sharding::FullyShardedDataParallel<TransformerLM> fsdp(
      model, world,
      dtrain::sharding::FSDPOptions().mixed_precision(policy).shard_layout(
          flat ? dtrain::sharding::ShardLayout::kFlat
               : dtrain::sharding::ShardLayout::kPerParameter));

  // The start both sides train from (rank 0's values, which FSDP gave every rank). Gathering
  // them is a collective: every rank takes part, rank 0 writes.
  const auto full = fsdp.state().full_parameters();
  if (rank == 0) dtrain::parity::save(full, args.out_dir + "/init.pt");

  std::unique_ptr<torch::optim::Optimizer> optimizer;
  if (fused) {
    optimizer =
        std::make_unique<dtrain::optim::AdamW>(fsdp.parameters(), torch::optim::AdamWOptions(1e-3));
  } else {
    optimizer =
        std::make_unique<torch::optim::AdamW>(fsdp.parameters(), torch::optim::AdamWOptions(1e-3));
  }
  torch::optim::Optimizer& opt = *optimizer;
  dtrain::amp::ShardedGradScaler scaler(world, dtrain::amp::GradScalerOptions()
                                                   .init_scale(args.init_scale)
                                                   .growth_interval(args.growth_interval)
                                                   .enabled(args.precision == "fp16"));
  std::vector<double> losses, scales;
  int64_t skipped = 0;
  for (int64_t s = 0; s < args.steps; ++s) {
    auto [x, y] = dtrain::parity::batch(args, s, size, rank);
    opt.zero_grad(true);
    at::Tensor logits = fsdp(x).to(at::kFloat);
    at::Tensor loss = at::cross_entropy_loss(logits.reshape({-1, args.vocab}), y.reshape(-1));
    scaler.scale(loss).backward();
    if (clip > 0) {
      scaler.unscale_(opt);
      fsdp.clip_grad_norm_(clip);
    }
    if (!scaler.step(opt)) ++skipped;
    scaler.update();
    at::Tensor mean = loss.detach().reshape({1}).to(at::kDouble);
    world->all_reduce(mean, dtrain::comm::ReduceOp::kAvg).wait();
    losses.push_back(mean.item<double>());
    scales.push_back(scaler.is_enabled() ? scaler.get_scale() : 1.0);
  }
  if (rank == 0) dtrain::parity::write_trajectory(args, losses, scales, skipped);
  world->barrier().wait();
  return 0;
}
