// After one timeout a rank fails everything else at once and exits within timeout + 5 s.
// Run with DTRAIN_COMM_TIMEOUT_S=2 on 2+ ranks. Rank 0 skips collective #2; the others have
// eight all-reduces in flight behind it, as a backward pass with eight buckets would:
//   - the first wait raises TimeoutError after the timeout, the other seven fail at once
//     (CommError naming the earlier failure), not one timeout each;
//   - the process then exits: an exit handler registered first (so it runs after every
//     communicator, worker and MPI runtime is torn down) fails the process if more than
//     timeout + 5 s passed since the first wait began.
// Rank 0 never joins under Gloo (a peer that hung) and also checks from outside that the
// others' processes are gone within the bound; under MPI it joins late, since MPI_Finalize
// waits for every rank (a rank whose peer hung for good skips MPI_Finalize after a 2 s grace,
// and mpirun then ends the job).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "comm/communicator.h"
#include "core/error.h"
#include "tests/multirank.h"

namespace dtrain::comm {
namespace {

using dtrain::testing::world;
using Clock = std::chrono::steady_clock;

std::atomic<int64_t> g_first_wait_ns{0};  // steady clock, 0 until a rank starts waiting
double g_limit_s = 0;

void check_exit_time() {
  const int64_t t0 = g_first_wait_ns.load();
  if (t0 == 0) return;
  const double elapsed =
      (Clock::now().time_since_epoch().count() - t0) / 1e9;  // steady_clock counts ns
  std::fprintf(stderr, "timeout_exit_test: exiting %.2f s after the first wait (limit %.1f s)\n",
               elapsed, g_limit_s);
  if (elapsed > g_limit_s) _exit(3);
}

TEST(CommTimeout, AfterOneTimeoutEveryPendingOpFailsAtOnceAndTheRankExits) {
  const auto timeout = world().timeout();
  ASSERT_LE(timeout.count(), 10000) << "run with DTRAIN_COMM_TIMEOUT_S=2";
  const double timeout_s = timeout.count() / 1000.0;
  g_limit_s = timeout_s + 5.0;
  at::Tensor pids = at::empty({world().size()}, at::kLong);
  world().all_gather(at::full({1}, static_cast<int64_t>(::getpid()), at::kLong), pids).wait();

  if (world().rank() == 0) {
    const bool mpi = world().backend() == "mpi";
    auto t0 = Clock::now();
    if (mpi) {
      // MPI_Finalize needs every rank: join late so the others' blocked call returns, and
      // finalize with them (their exit handlers check the time).
      std::this_thread::sleep_for(timeout + std::chrono::milliseconds(1500));
      at::Tensor x = at::ones({1000});
      world().all_reduce(x).wait();
      return;
    }
    // Every other rank's process must be gone within timeout + 5 s (+1 s for start skew).
    for (int r = 1; r < world().size(); ++r) {
      const pid_t pid = static_cast<pid_t>(pids[r].item<int64_t>());
      while (::kill(pid, 0) == 0 &&
             std::chrono::duration<double>(Clock::now() - t0).count() < g_limit_s + 10) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      const double gone = std::chrono::duration<double>(Clock::now() - t0).count();
      EXPECT_LT(gone, g_limit_s + 1.0) << "rank " << r << " (pid " << pid << ") still ran " << gone
                                       << " s after the skipped collective";
    }
    return;
  }

  std::vector<at::Tensor> buckets;
  std::vector<Work> works;
  for (int k = 0; k < 8; ++k) {
    buckets.push_back(at::ones({1000}));
    works.push_back(world().all_reduce(buckets.back()));
  }
  auto t0 = Clock::now();
  g_first_wait_ns = t0.time_since_epoch().count();
  EXPECT_THROW(works[0].wait(), TimeoutError);
  const double first = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_GE(first, timeout_s - 0.1);
  for (int k = 1; k < 8; ++k) {
    try {
      works[k].wait();
      ADD_FAILURE() << "bucket " << k << " completed after its communicator broke";
    } catch (const TimeoutError& e) {
      ADD_FAILURE() << "bucket " << k << " waited out its own timeout: " << e.what();
    } catch (const CommError& e) {
      EXPECT_NE(std::string(e.what()).find("abandoned"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("all_reduce #2"), std::string::npos) << e.what();
    }
  }
  const double all = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_LT(all - first, 0.5) << "the seven waits after the timeout took " << all - first << " s";
}

}  // namespace
}  // namespace dtrain::comm

int main(int argc, char** argv) {
  std::atexit(dtrain::comm::check_exit_time);  // first registered: runs after all teardown
  return dtrain::testing::multirank_main(argc, argv, /*final_barrier=*/false);
}
