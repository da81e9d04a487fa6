// Collectives used inconsistently across ranks, under DTRAIN_COMM_CHECK=1 (run with it set on
// every rank, at 2+ ranks, on MPI and Gloo). Each mismatch ends on every rank in a CommError
// that names the collective and the rank that differs, with the process still in control, and
// leaves the communicator broken (no rank carries on with wrong data). Every case runs on a
// communicator of its own (split from the world before any case breaks one).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <functional>
#include <string>

#include "comm/communicator.h"
#include "core/error.h"
#include "tests/multirank.h"

namespace dtrain::comm {
namespace {

using dtrain::testing::world;

struct Misuse {
  const char* what;
  std::function<Work(Communicator&)> call;  // what this rank issues
  std::vector<std::string> needles;         // in the error on rank 0 (about rank 1)
};

std::shared_ptr<Communicator> fresh() { return world().split(0, world().rank()); }

TEST(CommCheck, MatchingCollectivesStillWork) {
  ASSERT_STREQ(std::getenv("DTRAIN_COMM_CHECK"), "1") << "run with DTRAIN_COMM_CHECK=1";
  const int n = world().size(), r = world().rank();
  at::Tensor x = at::full({1000}, r + 1.0);
  world().all_reduce(x).wait();
  EXPECT_TRUE(x.eq(n * (n + 1) / 2.0).all().item<bool>());
  at::Tensor flat = at::arange(4 * n, at::kFloat), shard = at::empty({4});
  world().reduce_scatter(flat, shard).wait();
  EXPECT_TRUE(shard.equal(at::arange(4 * r, 4 * r + 4, at::kFloat) * n));
  at::Tensor b = at::full({7}, static_cast<double>(r), at::kLong);
  world().broadcast(b, n - 1).wait();
  EXPECT_TRUE(b.eq(n - 1).all().item<bool>());
  world().barrier().wait();
  EXPECT_FALSE(world().is_broken());
}

TEST(CommCheck, EveryMismatchFailsOnEveryRankNamingTheCollectiveAndTheRank) {
  const int r = world().rank();
  const bool odd = r != 0;  // rank 0 against the rest
  std::vector<Misuse> cases{
      {"element count",
       [&](Communicator& c) { return c.all_reduce(at::ones({odd ? 1007 : 1000})); },
       {"all_reduce #", "This rank (0) issued all_reduce of 1000 fp32 elements, sum",
        "rank 1 issued all_reduce of 1007 fp32 elements, sum"}},
      {"dtype",
       [&](Communicator& c) {
         return c.all_reduce(at::ones({1000}, odd ? at::kFloat : at::kDouble));
       },
       {"This rank (0) issued all_reduce of 1000 fp64 elements",
        "rank 1 issued all_reduce of 1000 fp32 elements"}},
      {"same-size dtype (fp32 against int32)",
       [&](Communicator& c) { return c.all_reduce(at::ones({64}, odd ? at::kInt : at::kFloat)); },
       {"rank 1 issued all_reduce of 64 int32 elements"}},
      {"reduction (SUM against MAX)",
       [&](Communicator& c) {
         return c.all_reduce(at::ones({64}), odd ? ReduceOp::kMax : ReduceOp::kSum);
       },
       {"This rank (0) issued all_reduce of 64 fp32 elements, sum",
        "rank 1 issued all_reduce of 64 fp32 elements, max"}},
      {"broadcast root (every rank its own root)",
       [&](Communicator& c) { return c.broadcast(at::ones({16}), c.rank()); },
       {"broadcast #", "This rank (0) issued broadcast of 16 fp32 elements from root 0",
        "rank 1 issued broadcast of 16 fp32 elements from root 1"}},
      {"collective kind",
       [&](Communicator& c) {
         if (odd) return c.barrier();
         return c.all_reduce(at::ones({8}));
       },
       {"rank 1 issued barrier"}},
      {"zero elements on one rank",
       [&](Communicator& c) { return c.all_reduce(at::ones({odd ? 5 : 0})); },
       {"This rank (0) issued all_reduce of 0 fp32 elements", "rank 1 issued all_reduce of 5"}},
  };
  std::vector<std::shared_ptr<Communicator>> comms;
  for (size_t i = 0; i < cases.size(); ++i) comms.push_back(fresh());
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(cases[i].what);
    Communicator& c = *comms[i];
    try {
      Work w = cases[i].call(c);
      w.wait();
      ADD_FAILURE() << "rank " << r << " completed a mismatched collective";
    } catch (const TimeoutError& e) {
      ADD_FAILURE() << "a timeout instead of the check's error: " << e.what();
    } catch (const CommError& e) {
      std::string what = e.what();
      EXPECT_NE(what.find("DTRAIN_COMM_CHECK found that the ranks issued different collectives"),
                std::string::npos)
          << what;
      if (r == 0) {
        for (const auto& n : cases[i].needles)
          EXPECT_NE(what.find(n), std::string::npos) << n << "\n" << what;
      } else {
        EXPECT_NE(what.find("rank 0 issued"), std::string::npos) << what;
      }
    }
    EXPECT_TRUE(c.is_broken());
    EXPECT_THROW(c.all_reduce(at::ones({4})), CommError);
  }
  // The world is untouched: the cases ran on communicators of their own.
  at::Tensor x = at::ones({3});
  world().all_reduce(x).wait();
  EXPECT_TRUE(x.eq(world().size()).all().item<bool>());
}

// DTRAIN_COMM_CHECK unset: the check follows the process-wide default (on through the
// trainer's setup and first steps): on, a mismatch fails with the check's error; off, each
// collective is issued alone (no all-gather of the check's before it: one sequence number
// each). DTRAIN_COMM_CHECK=0 keeps it off whatever the default.
TEST(CommCheck, UnsetFollowsTheDefaultAndZeroKeepsItOff) {
  const bool odd = world().rank() != 0;
  ::unsetenv("DTRAIN_COMM_CHECK");
  auto follows = fresh(), follows_too = fresh();
  ::setenv("DTRAIN_COMM_CHECK", "0", 1);
  auto never = fresh();
  ::setenv("DTRAIN_COMM_CHECK", "1", 1);
  set_default_call_check(true);
  // Two matched collectives take four numbers (each after its check's all-gather) where the
  // check is on, two where it is off.
  for (auto* c : {follows.get(), never.get()}) {
    c->all_reduce(at::ones({8})).wait();
    Work w = c->all_reduce(at::ones({8}));
    w.wait();
    EXPECT_EQ(w.info().seq, c == never.get() ? 2 : 4);
  }
  try {
    follows_too->all_reduce(at::ones({odd ? 9 : 8})).wait();
    ADD_FAILURE() << "a mismatched collective completed under the default check";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("DTRAIN_COMM_CHECK found that the ranks issued"),
              std::string::npos)
        << e.what();
  }
  set_default_call_check(false);
  Work w = follows->all_reduce(at::ones({8}));
  w.wait();
  EXPECT_EQ(w.info().seq, 5) << "the default off: no check before it";
}

TEST(CommCheck, RefusesAValueOtherThan0Or1) {
  // Constructing a communicator reads it; a split constructs one.
  ::setenv("DTRAIN_COMM_CHECK", "yes", 1);
  try {
    fresh();
    ADD_FAILURE() << "DTRAIN_COMM_CHECK=yes accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("DTRAIN_COMM_CHECK must be 1"), std::string::npos);
  }
  ::setenv("DTRAIN_COMM_CHECK", "1", 1);
}

}  // namespace
}  // namespace dtrain::comm

int main(int argc, char** argv) { return dtrain::testing::multirank_main(argc, argv); }
