// NCCL on one GPU (world size 1): every collective and dtype on CUDA tensors. Tagged gpu;
// skipped, visibly, where the build has no NCCL backend or there is no CUDA device.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "comm/factory.h"

namespace dtrain::comm {
namespace {

TEST(Nccl, WorldOfOneRunsEveryCollectiveOnCudaTensors) {
  if (!has_nccl_backend()) {
    GTEST_SKIP() << "this build has no NCCL backend (CMake -DDTRAIN_WITH_CUDA=ON, Bazel "
                    "--config=cuda): NCCL not exercised";
  }
  if (!at::hasCUDA()) {
    GTEST_SKIP() << "no CUDA device (or a CPU-only LibTorch): NCCL not exercised";
  }
  CommOptions o;
  o.backend = Backend::kNccl;
  o.device = c10::kCUDA;
  o.rendezvous.rank = 0;
  o.rendezvous.world_size = 1;
  auto comm = create_world(o);
  ASSERT_EQ(comm->backend(), "nccl");
  for (auto t :
       {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kInt, at::kLong, at::kByte}) {
    SCOPED_TRACE(c10::toString(t));
    auto opts = at::TensorOptions().dtype(t).device(at::kCUDA);
    at::Tensor x = at::arange(37, opts);
    at::Tensor want = x.clone();
    comm->all_reduce(x).wait();
    EXPECT_TRUE(at::equal(x, want));
    comm->broadcast(x, 0).wait();
    EXPECT_TRUE(at::equal(x, want));
    at::Tensor out = at::zeros({37}, opts);
    comm->reduce_scatter(x, out, ReduceOp::kMax).wait();
    EXPECT_TRUE(at::equal(out, want));
    at::Tensor gathered = at::zeros({37}, opts);
    comm->all_gather(x, gathered).wait();
    EXPECT_TRUE(at::equal(gathered, want));
  }
  at::Tensor f = at::full({1 << 20}, 3.0, at::TensorOptions().device(at::kCUDA));
  comm->all_reduce(f, ReduceOp::kAvg).wait();
  EXPECT_EQ(f.sum().item<double>(), 3.0 * (1 << 20));
  comm->barrier().wait();
}

}  // namespace
}  // namespace dtrain::comm
