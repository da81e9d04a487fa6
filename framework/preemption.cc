#include "framework/preemption.h"

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <signal.h>

#include <atomic>
#include <cstring>

#include "comm/flight_recorder.h"

namespace dtrain::framework {
namespace preemption {
namespace {

std::atomic<int> g_received{0};

void on_signal(int sig) {
  int expected = 0;
  g_received.compare_exchange_strong(expected, sig);
  comm::flight::dump_on_signal(sig);  // async-signal-safe: a byte into a pipe
}

}  // namespace

void install(bool interrupt) {
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  ::sigaction(SIGTERM, &sa, nullptr);
  ::sigaction(SIGUSR1, &sa, nullptr);
  if (interrupt) ::sigaction(SIGINT, &sa, nullptr);
}

int received() { return g_received.load(); }

const char* signal_name(int sig) {
  switch (sig) {
    case SIGTERM:
      return "SIGTERM";
    case SIGUSR1:
      return "SIGUSR1";
    case SIGINT:
      return "SIGINT";
    default:
      return "a signal";
  }
}

void reset_for_testing() { g_received = 0; }

}  // namespace preemption

struct StopAgreement::Pending {
  comm::Work work;
  std::optional<c10::Event> copied;  // GPU: the result's copy into host_
};

StopAgreement::StopAgreement(std::shared_ptr<comm::Communicator> comm) : comm_(std::move(comm)) {
  if (!comm_ || comm_->size() == 1) return;
  const c10::Device device = comm_->device();
  flag_ = at::zeros({1}, at::TensorOptions(at::kLong).device(device));
  host_ = at::zeros({1}, at::TensorOptions(at::kLong).pinned_memory(device.is_cuda()));
}

StopAgreement::~StopAgreement() = default;

std::optional<int> StopAgreement::poll() {
  const int mine = preemption::received();
  if (!flag_.defined()) {  // one process: nothing to agree on
    if (mine != 0) return mine;
    return std::nullopt;
  }
  int64_t agreed = 0;
  if (pending_) {
    pending_->work.wait();
    if (pending_->copied) {
      pending_->copied->synchronize();  // recorded a whole step ago: done by now
      agreed = *host_.data_ptr<int64_t>();
    } else {
      agreed = *flag_.data_ptr<int64_t>();
    }
    pending_.reset();
  }
  // This boundary's flags, read at the next one.
  flag_.fill_(mine);
  auto next =
      std::make_unique<Pending>(Pending{comm_->all_reduce(flag_, comm::ReduceOp::kMax), {}});
  if (flag_.is_cuda()) {
    next->work.wait();  // the current stream waits for the all-reduce
    host_.copy_(flag_, /*non_blocking=*/true);
    c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
    next->copied.emplace(c10::DeviceType::CUDA);
    next->copied->record(impl.getStream(flag_.device()));
  }
  pending_ = std::move(next);
  if (agreed != 0) return static_cast<int>(agreed);
  return std::nullopt;
}

void StopAgreement::drain() {
  if (!pending_) return;
  pending_->work.wait();
  if (pending_->copied) pending_->copied->synchronize();
  pending_.reset();
}

}  // namespace dtrain::framework
