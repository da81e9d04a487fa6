// Example (c): a user's own autograd op made autocast-safe with dtrain::amp::CustomOpRegion,
// trained inside a model under DDP with bf16 autocast.
//
// The op is RMSNorm with a hand-written backward (a torch::autograd::Function). Its sum of
// squares loses too much in bf16, so it must run in fp32 whatever autocast says. In Python:
//   class RMSNormFn(torch.autograd.Function):
//       @staticmethod
//       @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
//       def forward(ctx, x, w): ...
// In dtrain, the call site opens a CustomOpRegion: autocast is off inside it, and
// region.cast() converts the floating inputs to fp32 when autocast was on (and leaves them
// alone when it was off, as custom_fwd does).
// Run at 2 ranks:  dtrain-launch --nproc-per-node 2 -- ./custom_op_autocast [steps]
// Before training, rank 0 checks the op: fp32 output under bf16 autocast, and a backward
// that matches autograd's through the same formula in fp64. Exits 1 on any failed check or
// if the loss did not fall.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <dtrain/amp/autocast.h>
#include <dtrain/comm/factory.h>
#include <dtrain/core/error.h>
#include <dtrain/core/logging.h>
#include <dtrain/sharding/ddp.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <cstdio>
#include <cstdlib>
#include <exception>

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// y = x / sqrt(mean(x^2) + eps) * w over the last dimension, with its own backward.
struct RMSNormFn : public torch::autograd::Function<RMSNormFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            double eps) {
    at::Tensor inv = at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps);
    ctx->save_for_backward({x, w, inv});
    return x * inv * w;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1], &inv = saved[2];
    at::Tensor g = grad[0].to(x.scalar_type());
    at::Tensor gw = g * w;
    at::Tensor dx = inv * (gw - x * inv.pow(2) * (gw * x).mean(-1, true));
    at::Tensor dw = (g * x * inv).reshape({-1, x.size(-1)}).sum(0);
    return {dx, dw, at::Tensor()};
  }
};

// The call site: autocast-safe. Inside the region autocast is off; inputs become fp32 when
// the caller ran under autocast. The casts are outside the Function, so autograd carries the
// gradients back to the bf16 inputs' dtype.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w) {
  dtrain::amp::CustomOpRegion region(x.device().type(), at::kFloat);
  return RMSNormFn::apply(region.cast(x), region.cast(w), 1e-6);
}

class NetImpl : public torch::nn::Module {
 public:
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(32, 64));
    norm_weight = register_parameter("norm_weight", at::ones({64}));
    fc2 = register_module("fc2", torch::nn::Linear(64, 8));
  }
  at::Tensor forward(const at::Tensor& x) {
    return fc2->forward(at::relu(rms_norm(fc1->forward(x), norm_weight)));
  }

  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  at::Tensor norm_weight;
};
TORCH_MODULE(Net);

// The op's checks; returns whether they passed.
bool check_op() {
  bool ok = true;
  {
    dtrain::amp::AutocastGuard autocast(c10::kCPU, at::kBFloat16);
    at::Tensor h = at::linear(at::randn({4, 16}), at::randn({16, 16}));  // bf16 under autocast
    at::Tensor y = rms_norm(h, at::ones({16}));
    std::printf("under bf16 autocast: op input %s, output %s\n", c10::toString(h.scalar_type()),
                c10::toString(y.scalar_type()));
    ok = ok && h.scalar_type() == at::kBFloat16 && y.scalar_type() == at::kFloat;
  }
  // Its backward against autograd through the same formula, in fp64.
  at::Tensor x = at::randn({3, 5, 16}, at::kDouble).requires_grad_(true);
  at::Tensor w = at::randn({16}, at::kDouble).requires_grad_(true);
  at::Tensor g = at::randn({3, 5, 16}, at::kDouble);
  auto custom = torch::autograd::grad({rms_norm(x, w)}, {x, w}, {g});
  at::Tensor ref_y = x * at::rsqrt(x.pow(2).mean(-1, true) + 1e-6) * w;
  auto ref = torch::autograd::grad({ref_y}, {x, w}, {g});
  const double dx = (custom[0] - ref[0]).abs().max().item<double>();
  const double dw = (custom[1] - ref[1]).abs().max().item<double>();
  std::printf("backward vs autograd (fp64): max |dx| diff %.2e, max |dw| diff %.2e\n", dx, dw);
  return ok && dx < 1e-10 && dw < 1e-10;
}

}  // namespace

int main(int argc, char** argv) try {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 40;
  auto comm = dtrain::comm::create_world();
  dtrain::logging::configure(comm->rank());
  at::manual_seed(0);
  if (comm->rank() == 0 && !check_op()) {
    std::fprintf(stderr, "custom_op_autocast: the op's checks failed\n");
    return 1;
  }

  dtrain::sharding::DistributedDataParallel<Net> model(Net(), comm);
  torch::optim::AdamW opt(model.module()->parameters(), torch::optim::AdamWOptions(3e-3));
  // The targets: a fixed random teacher's classes, the same on every rank.
  auto teacher_gen = at::make_generator<at::CPUGeneratorImpl>(7);
  at::Tensor teacher = at::randn({32, 8}, teacher_gen, at::kFloat);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3000 + comm->rank());
  double first = 0, last = 0;
  for (int step = 0; step < steps; ++step) {
    at::Tensor x = at::randn({64, 32}, gen, at::kFloat);
    at::Tensor y = x.matmul(teacher).argmax(1);
    opt.zero_grad();
    at::Tensor loss;
    {
      dtrain::amp::AutocastGuard autocast(c10::kCPU, at::kBFloat16);
      loss = at::cross_entropy_loss(model(x).to(at::kFloat), y);
    }
    loss.backward();
    opt.step();
    at::Tensor mean = loss.detach().clone();
    comm->all_reduce(mean, dtrain::comm::ReduceOp::kAvg).wait();
    if (step == 0) first = mean.item<double>();
    last = mean.item<double>();
    if (comm->rank() == 0 && (step % 10 == 0 || step + 1 == steps)) {
      std::printf("step %d loss %.4f\n", step + 1, last);
    }
  }
  comm->barrier().wait();
  if (comm->rank() == 0) {
    std::printf("custom_op_autocast: %d ranks, loss %.4f -> %.4f\n", comm->size(), first, last);
  }
  return last < first * 0.7 ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "custom_op_autocast: %s\n", dtrain::message_of(e).c_str());
  return 1;
}
