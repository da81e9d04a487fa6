#include "tests/multirank.h"

#include <ATen/detail/CUDAHooksInterface.h>
#include <ATen/ops/tensor.h>

#include <cstdlib>
#include <iostream>
#include <string>

#include "comm/factory.h"
#include "comm/rendezvous.h"
#include "core/error.h"
#include "core/logging.h"

namespace dtrain::testing {
namespace {

std::shared_ptr<comm::Communicator> g_world;
at::Device g_device = at::kCPU;

at::Device pick_device(const comm::Communicator& world) {
  const char* wanted = std::getenv("DTRAIN_TEST_DEVICE");
  const bool cuda = world.device_type() == c10::kCUDA || (wanted && std::string(wanted) == "cuda");
  if (!cuda) return at::kCPU;
  if (world.device_type() == c10::kCUDA) return world.device();
  const int gpus = static_cast<int>(at::detail::getCUDAHooks().deviceCount());
  DTRAIN_CHECK_AS(UsageError, gpus > 0,
                  "DTRAIN_TEST_DEVICE=cuda, but this process sees no CUDA device (or this "
                  "LibTorch has no CUDA)");
  const int local = comm::detect_rank_info().local_rank;
  return at::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local % gpus));
}

// On ranks other than 0: print failures only, tagged with the rank.
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed()) {
      std::cerr << "[rank " << rank_ << "] " << (r.file_name() ? r.file_name() : "?") << ":"
                << r.line_number() << ": Failure\n"
                << r.message() << std::endl;
    }
  }

 private:
  int rank_;
};

}  // namespace

comm::Communicator& world() { return *g_world; }
std::shared_ptr<comm::Communicator> world_ptr() { return g_world; }
at::Device device() { return g_device; }

void MultiRankTest::TearDown() {
  if (!g_world || g_world->is_broken()) return;
  int local = HasFailure() ? 1 : 0;
  // On the communicator's own device: NCCL takes CUDA tensors only.
  at::Tensor flag = at::tensor({local}, at::kInt).to(g_world->device());
  g_world->all_reduce(flag, comm::ReduceOp::kMax).wait();
  if (flag.item<int>() > local) ADD_FAILURE() << "this test failed on another rank (see its log)";
}

int multirank_main(int argc, char** argv, bool final_barrier) {
  ::testing::InitGoogleTest(&argc, argv);
  comm::CommOptions options;
  const char* wanted = std::getenv("DTRAIN_TEST_DEVICE");
  if (wanted && std::string(wanted) == "cuda") options.device = c10::kCUDA;
  g_world = comm::create_world(options);
  logging::configure(g_world->rank());
  g_device = pick_device(*g_world);
  if (g_world->rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new FailurePrinter(g_world->rank()));
  }
  int rc = RUN_ALL_TESTS();
  if (final_barrier && !g_world->is_broken()) g_world->barrier().wait();
  g_world.reset();
  return rc;
}

}  // namespace dtrain::testing
