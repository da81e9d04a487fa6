#include "framework/data.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <set>

namespace dtrain::framework {
namespace {

TEST(DistributedSampler, RanksPartitionEachEpochDeterministically) {
  const int64_t n = 10;
  std::multiset<int64_t> seen;
  for (int r = 0; r < 3; ++r) {
    DistributedSampler s(n, 3, r, 42);
    EXPECT_EQ(s.indices().size(), 4u);  // ceil(10 / 3), padded by wrapping
    for (int64_t i : s.indices()) seen.insert(i);
    DistributedSampler again(n, 3, r, 42);
    EXPECT_EQ(s.indices(), again.indices()) << "same seed and epoch, same order";
  }
  for (int64_t i = 0; i < n; ++i) EXPECT_GE(seen.count(i), 1u) << i;
  EXPECT_EQ(seen.size(), 12u);
  DistributedSampler a(n, 3, 0, 42), b(n, 3, 0, 42);
  b.set_epoch(1);
  EXPECT_NE(a.indices(), b.indices()) << "a new epoch reshuffles";
  DistributedSampler c(n, 3, 0, 43);
  EXPECT_NE(a.indices(), c.indices()) << "another seed reshuffles";
}

TEST(ByteCorpus, WindowsAreShiftedByOneAndComeFromTheFile) {
  ByteCorpusSource src("/usr/share/common-licenses/GPL-3", 16, 4, 1, 2, 1, 7);
  Batch b = src.next(0, 0);
  EXPECT_EQ(b.inputs.sizes(), (std::vector<int64_t>{4, 16}));
  EXPECT_TRUE(at::equal(b.inputs.narrow(1, 1, 15), b.targets.narrow(1, 0, 15)));
  EXPECT_LT(b.inputs.max().item<int64_t>(), 256);
}

// A resumed run continues with nothing but the step: every batch is a function of
// (step, micro), also across epoch boundaries, whatever came before.
TEST(ByteCorpus, BatchesDependOnTheStepAloneSoAResumeNeedsNoDataState) {
  const char* path = "/usr/share/common-licenses/GPL-3";
  ByteCorpusSource walked(path, 64, 8, 2, 2, 0, 7), fresh(path, 64, 8, 2, 2, 0, 7);
  // ~35k bytes / 64 = ~550 windows, ~270 per rank: step 20 (micro 2 x 8) is in epoch 1.
  for (int64_t step = 0; step < 20; ++step) {
    for (int64_t m = 0; m < 2; ++m) walked.next(step, m);
  }
  for (int64_t m = 0; m < 2; ++m) {
    EXPECT_TRUE(at::equal(walked.next(20, m).inputs, fresh.next(20, m).inputs)) << "micro " << m;
  }
  EXPECT_FALSE(at::equal(fresh.next(20, 0).inputs, fresh.next(3, 0).inputs));
}

// The validation set is the same at any world size, held out of training.
TEST(Validation, SharesCoverTheSameSetAtAnyWorldSize) {
  const char* path = "/usr/share/common-licenses/GPL-3";
  auto all_rows = [&](int world) {
    std::vector<at::Tensor> rows;
    for (int r = 0; r < world; ++r) {
      ByteCorpusSource src(path, 32, 4, 1, world, r, 7);
      rows.push_back(src.validation(r, world).inputs);
    }
    at::Tensor t = at::cat(rows);
    return std::get<0>(at::sort(t.select(1, 0) * 1000003 + t.select(1, 1)));
  };
  EXPECT_EQ(all_rows(1).size(0), 12);
  EXPECT_TRUE(at::equal(all_rows(1), all_rows(2)));
  EXPECT_TRUE(at::equal(all_rows(1), all_rows(3)));
  SyntheticLMSource lm(50, 8, 2, 0, 1);
  EXPECT_TRUE(at::equal(at::cat({lm.validation(0, 2).inputs, lm.validation(1, 2).inputs}).sum(),
                        lm.validation(0, 1).inputs.sum()));
}

TEST(SyntheticSources, AreReproducibleAndRankSpecific) {
  SyntheticLMSource a(50, 8, 2, 0, 1), b(50, 8, 2, 0, 1), c(50, 8, 2, 1, 1);
  EXPECT_TRUE(at::equal(a.next(3, 1).inputs, b.next(3, 1).inputs));
  EXPECT_FALSE(at::equal(a.next(3, 1).inputs, c.next(3, 1).inputs));
  SyntheticClassificationSource s(6, 3, 5, 0, 1);
  Batch x = s.next(0, 0);
  EXPECT_EQ(x.targets.max().item<int64_t>() < 3, true);
}

}  // namespace
}  // namespace dtrain::framework
