// dtrain's side of the DDP-against-PyTorch comparison, bit for bit (tests/parity/ddp_parity_test.sh
// runs it beside bench/reference/ddp_reference.py --init, PyTorch's DDP, on the same machine).
//
//   dtrain-launch --nproc-per-node 2 -- ddp_parity --precision bf16 --steps 12 --out DIR
//
// The pieces a user's DDP run is made of, as dtrain ships them: the TransformerLM (at::linear
// everywhere), DistributedDataParallel with the precision preset's reduce dtype (bf16 and
// fp16 buckets for those presets), the forward and the loss under autocast in the preset's
// dtype, dtrain::optim::AdamW (the fused kernel) and, for fp16, the GradScaler with DDP
// unscaling and judging the gradients as it writes them back (DDPOptions::grad_scaler), so
// the kernel steps with the flag and no scale. PyTorch's side: DDP with
// bf16_compress_hook / fp16_compress_hook, torch.autocast, AdamW(fused=True) and
// torch.amp.GradScaler.
//
// Rank 0 writes the initial weights (DIR/init.pt, a dict PyTorch's torch.load reads), the
// weights after the last step (DIR/final.pt) and, per step, the loss averaged over ranks and
// the scale (DIR/dtrain.json). The data of step s on rank r is torch.randint(0, vocab, (B, T))
// from a CPU generator seeded 1000 + s * world + r: the same draws in C++ and Python.
#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "amp/autocast.h"
#include "amp/grad_scaler.h"
#include "amp/policy.h"
#include "comm/factory.h"
#include "core/cli.h"
#include "framework/models/transformer_lm.h"
#include "optim/fused.h"
#include "sharding/ddp.h"
#include "tests/parity/parity_run.h"

using dtrain::framework::TransformerLM;

namespace {

std::vector<std::pair<std::string, at::Tensor>> named_parameters(const TransformerLM& model) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : model->named_parameters()) out.emplace_back(item.key(), item.value());
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ddp_parity: a dtrain DDP run's losses and weights, for comparison with PyTorch"};
  dtrain::cli::setup(app, "ddp_parity");
  dtrain::parity::Args args;
  args.steps = 12;
  dtrain::parity::add_options(app, args, "folder for init.pt, final.pt and dtrain.json");
  double bucket_mb = 0;
  bool find_unused = false;
  app.add_option("--bucket-mb", bucket_mb,
                 "every bucket's size limit, the first's too (PyTorch's bucket_cap_mb); "
                 "0: the defaults (25, the first 1)");
  app.add_flag("--find-unused", find_unused, "find_unused_parameters");
  dtrain::cli::parse(app, argc, argv);

  auto world = dtrain::comm::create_world();
  const int rank = world->rank(), size = world->size();
  TransformerLM model = dtrain::parity::make_model(args);
  const auto policy = dtrain::amp::MixedPrecisionPolicy::preset(args.precision);
  dtrain::amp::GradScaler scaler(dtrain::amp::GradScalerOptions()
                                     .init_scale(args.init_scale)
                                     .growth_interval(args.growth_interval)
                                     .enabled(policy.needs_grad_scaler()));
  // DDP broadcasts rank 0's weights: the start both sides train from. fp16: DDP unscales
  // and judges the gradients as it writes them back (DDPOptions::grad_scaler), as the
  // trainer has it.
  dtrain::sharding::DistributedDataParallel<TransformerLM> ddp(model, world, [&] {
    auto o = dtrain::sharding::DDPOptions()
                 .reduce_dtype(policy.effective_reduce_dtype())
                 .grad_scaler(policy.needs_grad_scaler() ? &scaler : nullptr)
                 .find_unused_parameters(find_unused);
    if (bucket_mb > 0) o.bucket_cap_mb(bucket_mb).first_bucket_mb(bucket_mb);
    return o;
  }());
  if (rank == 0) dtrain::parity::save(named_parameters(model), args.out_dir + "/init.pt");

  dtrain::optim::AdamW opt(ddp.parameters(), torch::optim::AdamWOptions(1e-3));
  const bool autocast = policy.is_low_precision();
  std::vector<double> losses, scales;
  int64_t skipped = 0;
  for (int64_t s = 0; s < args.steps; ++s) {
    auto [x, y] = dtrain::parity::batch(args, s, size, rank);
    opt.zero_grad(true);
    at::Tensor loss;
    {
      dtrain::amp::AutocastGuard ac(
          c10::kCPU, autocast ? std::optional<c10::ScalarType>(policy.param_dtype) : std::nullopt,
          autocast);
      at::Tensor logits = ddp(x).to(at::kFloat);
      loss = at::cross_entropy_loss(logits.reshape({-1, args.vocab}), y.reshape(-1));
    }
    scaler.scale(loss).backward();
    if (!scaler.step(opt)) ++skipped;
    scaler.update();
    at::Tensor mean = loss.detach().reshape({1}).to(at::kDouble);
    world->all_reduce(mean, dtrain::comm::ReduceOp::kSum).wait();
    losses.push_back(mean.item<double>() / size);
    scales.push_back(scaler.is_enabled() ? scaler.get_scale() : 1.0);
  }
  if (rank == 0) {
    dtrain::parity::save(named_parameters(model), args.out_dir + "/final.pt");
    dtrain::parity::write_trajectory(args, losses, scales, skipped);
  }
  world->barrier().wait();
  return 0;
}
