// Fault injection for dtrain's own tests, in one place. Production code asks for a fault by
// name; each is the environment variable DTRAIN_TEST_<NAME>, and an unset one injects nothing.
// A value that does not parse throws UsageError naming the variable, so a test cannot arm a
// fault that silently never fires.
//
//   DTRAIN_TEST_KILL_AT_STEP=<step>:<rank>    framework/trainer.cc: SIGKILL after that step
//   DTRAIN_TEST_NAN_FROM_STEP=<step>:<rank>   framework/trainer.cc: NaN losses from that step
//   DTRAIN_TEST_STOP_AT_STEP=<step>:<rank>    framework/trainer.cc: SIGSTOP after that step
//   DTRAIN_TEST_SLOW_RANK=<ms>:<rank>         framework/trainer.cc: <ms> more compute per step
//   DTRAIN_TEST_BAD_BATCHES=<first>:<count>[:<factor>]
//                                             framework/trainer.cc: the batches of data steps
//                                             first.. (1-based) make every rank's loss <factor>
//                                             times larger (default 1000; "nan": NaN), a
//                                             loss spike the data caused
//   DTRAIN_TEST_SKIP_BATCHES=<first>:<count>  framework/trainer.cc: a run that never trains on
//                                             those data steps (what a spike's rollback skips)
//   DTRAIN_TEST_RECORD_SAMPLES=<file>         framework/data.cc: each micro-batch's sample ids
//                                             (corpus windows, token-file windows) appended
//                                             as "<data step> <micro> <ids...>" to
//                                             <file>.<attempt>.<rank> (the launcher's
//                                             restart count; the data-parallel rank)
//   DTRAIN_TEST_SKIP_COLLECTIVE=<seq>:<rank>  comm/communicator.cc: that rank never issues the
//                                             world communicator's collective #seq
//   DTRAIN_TEST_CRASH_BEFORE_RENAME=<name>    framework/checkpoint/atomic_file.cc: SIGKILL
//                                             before the rename that publishes that file
//   DTRAIN_TEST_CHILD="program args..."       framework/train_main.cc: a child process
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace dtrain::faults {

// A fault at a step of a rank: "<step>:<rank>", both integers.
struct StepRank {
  int64_t step = 0;
  int64_t rank = 0;
};

// Data steps first .. first + count - 1 (1-based), and a factor ("<first>:<count>[:<factor>]";
// the factor may be "nan"; absent: `default_factor`).
struct Range {
  int64_t first = 0;
  int64_t count = 0;
  double factor = 0;
};

// DTRAIN_TEST_<name>'s value; nullopt when unset or empty.
std::optional<std::string> text(const char* name);
// DTRAIN_TEST_<name> as "<step>:<rank>".
std::optional<StepRank> step_rank(const char* name);
// DTRAIN_TEST_<name> as "<first>:<count>[:<factor>]", first >= 1 and count >= 1.
std::optional<Range> range(const char* name, double default_factor);
// DTRAIN_TEST_<name> split at spaces (a command line); empty when unset.
std::vector<std::string> words(const char* name);

}  // namespace dtrain::faults
