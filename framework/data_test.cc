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
  ByteCorpusSource src("/usr/share/common-licenses/GPL-3", 16, 4, 2, 1, 7);
  Batch b = src.next(0, 0);
  EXPECT_EQ(b.inputs.sizes(), (std::vector<int64_t>{4, 16}));
  EXPECT_TRUE(at::equal(b.inputs.narrow(1, 1, 15), b.targets.narrow(1, 0, 15)));
  EXPECT_LT(b.inputs.max().item<int64_t>(), 256);
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
