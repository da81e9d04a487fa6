// Run with DTRAIN_COMM_TIMEOUT_S=2 on 2+ ranks: rank 0 skips a collective, the others must
// raise TimeoutError within timeout + 5 s naming the op; then rank 0 joins late so every
// rank can exit cleanly.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>

#include "comm/communicator.h"
#include "core/error.h"
#include "tests/multirank.h"

namespace dtrain::comm {
namespace {

using dtrain::testing::world;

// A wait that timed out took the timeout: not less, and not more than 5 s over it.
void expect_waited_the_timeout(std::chrono::steady_clock::time_point t0,
                               std::chrono::milliseconds timeout) {
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(waited, timeout.count() / 1000.0 + 5.0);
  EXPECT_GE(waited, timeout.count() / 1000.0 - 0.1);
}

// Collectives the world issued in the tests before (they run in this file's order).
int64_t world_issued = 0;

// First, on a communicator of ranks 0 and 1 (the world stays in step for the next test): a
// receive whose send comes late times out the same way, naming the op and both ranks.
TEST(CommTimeout, ALateSendTimesOutItsReceiveNamingTheOpAndRanks) {
  const auto timeout = world().timeout();
  ASSERT_LE(timeout.count(), 10000) << "run with DTRAIN_COMM_TIMEOUT_S=2";
  auto pair = world().split(world().rank() < 2 ? 0 : -1, world().rank());
  if (world().rank() == 0) {
    std::this_thread::sleep_for(timeout + std::chrono::milliseconds(1500));
    try {  // late: the receiver gave up; where the transport waits for it, this times out too
      pair->send(at::ones({2, 3}), 1, 4).wait();
    } catch (const TimeoutError&) {
    }
  } else if (world().rank() == 1) {
    at::Tensor x = at::zeros({2, 3});
    auto t0 = std::chrono::steady_clock::now();
    try {
      pair->recv(x, 0, 4).wait();
      FAIL() << "no TimeoutError";
    } catch (const TimeoutError& e) {
      expect_waited_the_timeout(t0, timeout);
      std::string what = e.what();
      EXPECT_NE(what.find("recv #1 (fp32, 6 elements) on ranks [1,0]"), std::string::npos) << what;
    }
    EXPECT_TRUE(pair->is_broken());
  }
  world().barrier().wait(std::chrono::seconds(30));
  world_issued += 2;  // the split's all-gather and the barrier; point-to-point is not counted
}

TEST(CommTimeout, SkippedCollectiveRaisesTimeoutNamingTheOpAndRanks) {
  const auto timeout = world().timeout();
  ASSERT_LE(timeout.count(), 10000) << "run with DTRAIN_COMM_TIMEOUT_S=2";
  at::Tensor warmup = at::ones({8});
  world().all_reduce(warmup).wait();  // collective #1: everyone
  at::Tensor x = at::ones({1000}, at::kBFloat16);
  if (world().rank() == 0) {
    // Skip collective #2 for longer than the others' timeout, then join it late.
    std::this_thread::sleep_for(timeout + std::chrono::milliseconds(1500));
    world().all_reduce(x).wait();
    EXPECT_FALSE(world().is_broken());
    return;
  }
  auto t0 = std::chrono::steady_clock::now();
  Work w = world().all_reduce(x);
  try {
    w.wait();
    FAIL() << "no TimeoutError";
  } catch (const TimeoutError& e) {
    expect_waited_the_timeout(t0, timeout);
    std::string what = e.what();
    EXPECT_NE(what.find("all_reduce #" + std::to_string(world_issued + 2)), std::string::npos)
        << what;
    EXPECT_NE(what.find("bf16, 1000 elements"), std::string::npos) << what;
    EXPECT_NE(what.find("on ranks [0,1"), std::string::npos) << what;
    EXPECT_NE(what.find("on rank " + std::to_string(world().rank())), std::string::npos) << what;
  }
  // The ranks are out of step now: the communicator refuses further work at once.
  EXPECT_TRUE(world().is_broken());
  at::Tensor y = at::ones({4});
  try {
    world().all_reduce(y);
    FAIL() << "a broken communicator accepted a collective";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("unusable"), std::string::npos) << e.what();
  }
  // The timed-out op stays failed: waiting again rethrows at once.
  auto t1 = std::chrono::steady_clock::now();
  EXPECT_THROW(w.wait(), TimeoutError);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count(), 0.5);
  // Rank 0 joins late, which releases the backend's blocked call (MPI can then finalize).
  std::this_thread::sleep_for(std::chrono::seconds(3));
}

}  // namespace
}  // namespace dtrain::comm

int main(int argc, char** argv) {
  return dtrain::testing::multirank_main(argc, argv, /*final_barrier=*/false);
}
