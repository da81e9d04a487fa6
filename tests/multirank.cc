#include "tests/multirank.h"

#include <ATen/ops/tensor.h>

#include <iostream>

#include "comm/factory.h"
#include "core/logging.h"

namespace dtrain::testing {
namespace {

std::shared_ptr<comm::Communicator> g_world;

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

void MultiRankTest::TearDown() {
  if (!g_world || g_world->is_broken()) return;
  int local = HasFailure() ? 1 : 0;
  at::Tensor flag = at::tensor({local}, at::kInt);
  g_world->all_reduce(flag, comm::ReduceOp::kMax).wait();
  if (flag.item<int>() > local) ADD_FAILURE() << "this test failed on another rank (see its log)";
}

int multirank_main(int argc, char** argv, bool final_barrier) {
  ::testing::InitGoogleTest(&argc, argv);
  g_world = comm::create_world();
  logging::configure(g_world->rank());
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
