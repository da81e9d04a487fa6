// Preemption: SIGTERM (what Slurm and Kubernetes send before they kill a job) and SIGUSR1
// (Slurm's --signal warning), and SIGINT when checkpoint.on_interrupt says so, ask the run to
// save and stop instead of dying. The handler only sets a flag (and asks the flight recorder
// for a dump, the rank going on); the trainer acts at a step boundary, where every rank must
// act at the same one:
//
//   StopAgreement::poll   at each step boundary, collective: each rank's flag is all-reduced
//                         (max) without waiting, and the result of the previous boundary's
//                         all-reduce is read. So every rank learns of a signal that reached any
//                         of them at the same boundary, one step after it arrived, and no step
//                         waits on the agreement (on a GPU the result comes back through
//                         pinned memory, read a whole step after it was asked for).
//
// Then the trainer saves a checkpoint within checkpoint.on_signal seconds and the process exits
// with kRequeueExitCode, which dtrain-launch passes on, and a job script can requeue on.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <optional>

#include "comm/communicator.h"
#include "core/exit_codes.h"

namespace dtrain::framework {

using cli::kRequeueExitCode;  // 75 (core/exit_codes.h)

namespace preemption {

// Takes SIGTERM and SIGUSR1 (and SIGINT with `interrupt`) from here on. Idempotent.
void install(bool interrupt);
// The first signal received since install(), or 0.
int received();
// "SIGTERM", "SIGUSR1", "SIGINT".
const char* signal_name(int sig);
// Forgets a received signal (tests).
void reset_for_testing();

}  // namespace preemption

class StopAgreement {
 public:
  explicit StopAgreement(std::shared_ptr<comm::Communicator> comm);
  ~StopAgreement();
  StopAgreement(const StopAgreement&) = delete;
  StopAgreement& operator=(const StopAgreement&) = delete;

  // Collective, at every step boundary. The signal some rank had received at the previous
  // boundary (the largest signal number), or nothing: the same answer on every rank.
  std::optional<int> poll();
  // Waits for the all-reduce still in flight (before the ranks stop: every rank issued it).
  void drain();

 private:
  std::shared_ptr<comm::Communicator> comm_;
  at::Tensor flag_;  // on the communicator's device
  at::Tensor host_;  // the result, pinned on a GPU
  struct Pending;
  std::unique_ptr<Pending> pending_;
};

}  // namespace dtrain::framework
