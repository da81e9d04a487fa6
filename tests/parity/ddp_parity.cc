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
//
// With --buffers, a small net with BatchNorm and a bf16 buffer instead, accumulating over
// micro-batches under no_sync, with a forward under no_grad after each step: every rank's
// buffers after every forward, which shows when DDP broadcasts rank 0's (as PyTorch: only in a
// forward after one that synchronized gradients, or the first).
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

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

using Named = std::vector<std::pair<std::string, at::Tensor>>;

Named named_parameters(const TransformerLM& model) {
  Named out;
  for (const auto& item : model->named_parameters()) out.emplace_back(item.key(), item.value());
  return out;
}

// x * s whose backward gives x its gradient and s none (an undefined tensor), as a custom
// Function may: DDP's hook still fires for s. ddp_reference.py has the same Function.
struct ScaleWithoutItsGradient : torch::autograd::Function<ScaleWithoutItsGradient> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& s) {
    ctx->save_for_backward({s});
    return x * s;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    return {g[0] * ctx->get_saved_variables()[0], at::Tensor()};
  }
};

// --buffers: buffers that every forward changes from its input, in each dtype a model holds
// (BatchNorm's fp32 statistics and int64 count, a bf16 running sum), for when DDP broadcasts
// rank 0's. bench/reference/ddp_reference.py has the same module.
struct BufferNetImpl : torch::nn::Module {
  BufferNetImpl()
      : fc1(register_module("fc1", torch::nn::Linear(8, 16))),
        bn(register_module("bn", torch::nn::BatchNorm1d(16))),
        fc2(register_module("fc2", torch::nn::Linear(16, 4))),
        extra(register_module("extra", torch::nn::Linear(16, 16))),
        gate(register_parameter("gate", at::ones({16}))),
        seen(register_buffer("seen", at::zeros({16}, at::kBFloat16))) {
    fc2->bias.requires_grad_(false);  // frozen: DDP leaves it out
  }
  at::Tensor forward(const at::Tensor& x, bool use_extra) {
    at::Tensor h = ScaleWithoutItsGradient::apply(bn(fc1(x)), gate);
    if (use_extra) h = h + extra(h);
    {
      at::NoGradGuard no_grad;
      seen.add_(h.detach().sum(0).to(at::kBFloat16));
    }
    return fc2(at::relu(h));
  }
  torch::nn::Linear fc1;
  torch::nn::BatchNorm1d bn;
  torch::nn::Linear fc2;
  torch::nn::Linear extra;
  at::Tensor gate;
  at::Tensor seen;
};
TORCH_MODULE(BufferNet);

// Forward k's inputs and targets on `rank`: the draws of ddp_reference.py's buffer_batch().
std::pair<at::Tensor, at::Tensor> buffer_batch(int64_t k, int world, int rank) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(2000 + k * world + rank);
  at::Tensor x = at::randn({8, 8}, gen);
  at::Tensor y = at::randn({8, 4}, gen);
  return {x, y};
}

// Steps of three forwards and backwards, the first two under no_sync, then SGD, then a forward
// under no_grad; SGD with weight decay, so that a parameter given a zero gradient moves where
// one given none does not. fc2.bias is frozen; `gate` never has a gradient (with find_unused
// PyTorch leaves it none, without it DDP gives it zeros). With find_unused, `extra` takes part only
// in each step's first forward (under no_sync; PyTorch still averages its gradient), else in every
// one. Every rank writes its buffers after each forward (DIR/buffers_rank<r>.pt,
// "<forward>.<name>"); rank 0 the initial weights and buffers (DIR/init.pt) and the final weights
// (DIR/final.pt).
void run_buffers(const dtrain::parity::Args& args,
                 const std::shared_ptr<dtrain::comm::Communicator>& world, bool find_unused) {
  const int rank = world->rank(), size = world->size();
  at::manual_seed(7);
  BufferNet net;
  dtrain::sharding::DistributedDataParallel<BufferNet> ddp(
      net, world, dtrain::sharding::DDPOptions().find_unused_parameters(find_unused));
  Named init, record;
  for (const auto& item : net->named_parameters()) init.emplace_back(item.key(), item.value());
  for (const auto& item : net->named_buffers()) init.emplace_back(item.key(), item.value());
  if (rank == 0) dtrain::parity::save(init, args.out_dir + "/init.pt");
  torch::optim::SGD opt(ddp.parameters(), torch::optim::SGDOptions(0.1).weight_decay(0.01));
  int64_t k = 0;
  auto keep = [&] {
    for (const auto& item : net->named_buffers())
      record.emplace_back(std::to_string(k) + "." + item.key(), item.value().clone());
    ++k;
  };
  constexpr int kMicro = 3;
  for (int64_t s = 0; s < args.steps; ++s) {
    opt.zero_grad(true);
    for (int m = 0; m < kMicro; ++m) {
      auto [x, y] = buffer_batch(k, size, rank);
      std::optional<dtrain::sharding::NoSyncGuard> guard;
      if (m < kMicro - 1) guard.emplace(ddp.no_sync());
      at::mse_loss(ddp(x, !find_unused || m == 0), y).backward();
      keep();
    }
    opt.step();
    at::NoGradGuard no_grad;
    ddp(buffer_batch(k, size, rank).first, true);
    keep();
  }
  dtrain::parity::save(record, args.out_dir + "/buffers_rank" + std::to_string(rank) + ".pt");
  if (rank == 0) {
    Named weights;
    for (const auto& item : net->named_parameters()) weights.emplace_back(item.key(), item.value());
    dtrain::parity::save(weights, args.out_dir + "/final.pt");
  }
  world->barrier().wait();
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
  bool buffers = false;
  app.add_flag("--buffers", buffers,
               "a small net whose buffers every forward changes, accumulating under no_sync "
               "with a no_grad forward after each step: each rank's buffers after each forward");
  dtrain::cli::parse(app, argc, argv);

  auto world = dtrain::comm::create_world();
  if (buffers) {
    run_buffers(args, world, find_unused);
    return 0;
  }
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
  dtrain::sharding::DDPOptions options;
  options.reduce_dtype(policy.effective_reduce_dtype())
      .grad_scaler(policy.needs_grad_scaler() ? &scaler : nullptr)
      .find_unused_parameters(find_unused);
  if (bucket_mb > 0) options.bucket_cap_mb(bucket_mb);  // the first bucket's too, as PyTorch's
  dtrain::sharding::DistributedDataParallel<TransformerLM> ddp(model, world, options);
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
