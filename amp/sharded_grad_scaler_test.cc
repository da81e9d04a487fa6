// Multi-rank: every rank holds a different shard of parameters; found-inf agrees everywhere.
#include "amp/sharded_grad_scaler.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include <limits>

#include "tests/multirank.h"

namespace dtrain::amp {
namespace {

using dtrain::testing::world;
using dtrain::testing::world_ptr;
using Test = dtrain::testing::MultiRankTest;

// Every rank's scale, gathered.
std::vector<double> all_scales(const GradScaler& s) {
  at::Tensor mine = at::full({1}, s.get_scale(), at::kDouble);
  at::Tensor all = at::zeros({world().size()}, at::kDouble);
  world().all_gather(mine, all).wait();
  std::vector<double> out(all.data_ptr<double>(), all.data_ptr<double>() + world().size());
  return out;
}

TEST_F(Test, InfOnOneRankMakesEveryRankSkipTheSameStep) {
  const int rank = world().rank();
  at::Tensor shard = at::full({5}, double(rank + 1)).requires_grad_();
  torch::optim::SGD opt{std::vector<at::Tensor>{shard}, torch::optim::SGDOptions(0.1)};
  ShardedGradScaler s(world_ptr(), GradScalerOptions().init_scale(1024.0).growth_interval(2));
  const int bad_rank = world().size() - 1;
  for (int step = 0; step < 6; ++step) {
    opt.zero_grad();
    s.scale((shard * shard).sum()).backward();
    if (step == 3 && rank == bad_rank) {
      shard.mutable_grad()[2].fill_(std::numeric_limits<float>::infinity());
    }
    at::Tensor before = shard.detach().clone();
    bool stepped = s.step(opt);
    EXPECT_EQ(stepped, step != 3) << "step " << step;
    EXPECT_EQ(at::equal(before, shard.detach()), step == 3) << "step " << step;
    s.update();
    auto scales = all_scales(s);
    for (double v : scales)
      EXPECT_EQ(v, scales[0]) << "scales differ across ranks at step " << step;
  }
  // 1024 -> 2048 (after 2 clean) -> 1024 (inf at 3) -> ... -> 2048 (2 clean: 4, 5)
  EXPECT_EQ(s.get_scale(), 2048.0);
}

TEST_F(Test, ARankWithoutGradientsStillTakesPartAndSkips) {
  const int rank = world().rank();
  at::Tensor used = at::ones({3}).requires_grad_();
  at::Tensor idle = at::ones({3}).requires_grad_();
  // Rank 0's optimizer owns only a parameter that receives no gradient.
  torch::optim::SGD opt{std::vector<at::Tensor>{rank == 0 ? idle : used},
                        torch::optim::SGDOptions(0.1)};
  ShardedGradScaler s(world_ptr(), GradScalerOptions().init_scale(64.0));
  s.scale((used * 2).sum()).backward();
  if (rank == 1) used.mutable_grad()[0].fill_(std::numeric_limits<float>::quiet_NaN());
  EXPECT_FALSE(s.step(opt));
  s.update();
  EXPECT_EQ(s.get_scale(), 32.0);
  auto scales = all_scales(s);
  for (double v : scales) EXPECT_EQ(v, 32.0);
}

TEST_F(Test, AcceptsFp16GradientsAndKeepsTheOutputDtype) {
  at::Tensor w = at::ones({4}, at::kHalf).requires_grad_();
  torch::optim::SGD opt{std::vector<at::Tensor>{w}, torch::optim::SGDOptions(0.5)};
  ShardedGradScaler s(world_ptr(), GradScalerOptions().init_scale(8.0));
  at::Tensor scaled = s.scale((w * 3).sum());
  EXPECT_EQ(scaled.scalar_type(), at::kHalf);
  scaled.backward();
  EXPECT_TRUE(s.step(opt));
  s.update();
  EXPECT_EQ(w[0].item<float>(), 1.0f - 0.5f * 3.0f);
}

TEST_F(Test, DisabledShardedScalerIssuesNoCollectives) {
  at::Tensor w = at::ones({2}).requires_grad_();
  torch::optim::SGD opt{std::vector<at::Tensor>{w}, torch::optim::SGDOptions(0.5)};
  ShardedGradScaler s(world_ptr(), GradScalerOptions().enabled(false));
  s.scale(w.sum()).backward();
  // Only some ranks step: would hang if a disabled scaler communicated.
  if (world().rank() == 0) {
    EXPECT_TRUE(s.step(opt));
  }
  s.update();
}

}  // namespace
}  // namespace dtrain::amp

int main(int argc, char** argv) { return dtrain::testing::multirank_main(argc, argv); }
