// Harness for tests that run as N real processes (under mpirun or dtrain-launch).
//
// Every rank runs the same tests in the same order. After each test the ranks exchange
// their failure flags, so a test fails on every rank when it failed on any rank, and each
// rank's process exits non-zero, which fails the mpirun/launcher command and the test.
// Ranks other than 0 print only failures, so the log reads like one process's.
#pragma once

#include <gtest/gtest.h>

#include <c10/core/Device.h>

#include <memory>

#include "comm/communicator.h"

namespace dtrain::testing {

// The world communicator the harness created (backend from DTRAIN_BACKEND / auto).
comm::Communicator& world();
std::shared_ptr<comm::Communicator> world_ptr();

// The device tests put their tensors on: this rank's GPU under nccl, or with
// DTRAIN_TEST_DEVICE=cuda (MPI and Gloo then stage CUDA tensors through the host); else the
// CPU. DTRAIN_TEST_DEVICE=cuda without a CUDA device fails the test run rather than
// silently testing the CPU.
at::Device device();

class MultiRankTest : public ::testing::Test {
 protected:
  void TearDown() override;
};

// main() for a multi-rank test binary. The final barrier keeps a fast rank from tearing
// down its connections while a peer still reads; tests that leave the ranks out of step on
// purpose pass final_barrier=false.
int multirank_main(int argc, char** argv, bool final_barrier = true);

}  // namespace dtrain::testing
