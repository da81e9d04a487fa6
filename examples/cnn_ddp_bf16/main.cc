// Example (a): a user's own CNN and training loop under dtrain's DDP with bf16 autocast.
//
// What a PyTorch user writes as
//   dist.init_process_group(); model = DDP(Net()); opt = AdamW(model.parameters())
//   with torch.autocast("cpu", torch.bfloat16): loss = F.cross_entropy(model(x), y)
//   loss.backward(); opt.step()
// Run at 2 ranks:  dtrain-launch --nproc-per-node 2 -- ./cnn_ddp_bf16 [steps]
//            or:   mpirun -np 2 ./cnn_ddp_bf16 [steps]
// The task: 16x16 RGB images of noise with one bright 8x8 quadrant; the label is which
// quadrant (4 classes). Each rank draws its own images. Exits 1 if the loss did not fall.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <dtrain/amp/autocast.h>
#include <dtrain/comm/factory.h>
#include <dtrain/core/error.h>
#include <dtrain/core/logging.h>
#include <dtrain/sharding/ddp.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <cstdio>
#include <cstdlib>
#include <exception>

namespace {

class NetImpl : public torch::nn::Module {
 public:
  NetImpl() {
    conv1 =
        register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 16, 3).padding(1)));
    conv2 =
        register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 32, 3).padding(1)));
    fc = register_module("fc", torch::nn::Linear(32 * 4 * 4, 4));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = at::max_pool2d(at::relu(conv1->forward(x)), {2, 2});  // 8x8
    h = at::max_pool2d(at::relu(conv2->forward(h)), {2, 2});             // 4x4
    return fc->forward(h.flatten(1));
  }

  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Net);

// A batch of images with one bright quadrant, and that quadrant's index as the label.
std::pair<at::Tensor, at::Tensor> batch(at::Generator& gen, int64_t n) {
  at::Tensor images = at::randn({n, 3, 16, 16}, gen, at::kFloat);
  at::Tensor labels = at::randint(0, 4, {n}, gen, at::kLong);
  auto acc = labels.accessor<int64_t, 1>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = acc[i] / 2 * 8, c = acc[i] % 2 * 8;
    images[i].narrow(1, r, 8).narrow(2, c, 8).add_(0.3);
  }
  return {images, labels};
}

}  // namespace

int main(int argc, char** argv) try {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 40;
  // The rank, world size and rendezvous come from dtrain-launch, mpirun or srun.
  auto comm = dtrain::comm::create_world();
  dtrain::logging::configure(comm->rank());

  at::manual_seed(0);  // DDP broadcasts rank 0's parameters anyway
  dtrain::sharding::DistributedDataParallel<Net> model(
      Net(), comm, dtrain::sharding::DDPOptions().bucket_cap_mb(1).reduce_dtype(at::kBFloat16));
  torch::optim::AdamW opt(model.module()->parameters(), torch::optim::AdamWOptions(3e-3));

  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + comm->rank());  // own data
  double first = 0, last = 0;
  for (int step = 0; step < steps; ++step) {
    auto [x, y] = batch(gen, 32);
    opt.zero_grad();
    at::Tensor loss;
    {
      // torch.autocast("cpu", torch.bfloat16): convolutions and linears in bf16.
      dtrain::amp::AutocastGuard autocast(c10::kCPU, at::kBFloat16);
      at::Tensor logits = model(x);
      loss = at::cross_entropy_loss(logits.to(at::kFloat), y);
    }
    loss.backward();  // gradients all-reduced in bf16 buckets, overlapped with backward
    opt.step();
    // The loss averaged over ranks, for the log.
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
    std::printf("cnn_ddp_bf16: %d ranks, loss %.4f -> %.4f\n", comm->size(), first, last);
  }
  return last < first * 0.7 ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "cnn_ddp_bf16: %s\n", dtrain::message_of(e).c_str());
  return 1;
}
