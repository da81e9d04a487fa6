// The exit codes dtrain's processes end with, beyond 0 (success), 1 (an error the message
// explains) and 2 (bad usage): what a job script or scheduler can act on.
#pragma once

namespace dtrain::cli {

// The exit code of a rank that stops only because another rank failed (a peer closed its
// connection mid-collective, or a start-up check failed elsewhere).
inline constexpr int kConsequenceExitCode = 3;

// The exit code of a run that stopped on SIGTERM or SIGUSR1 after saving a checkpoint
// (framework/preemption.h): EX_TEMPFAIL of sysexits.h, "a temporary failure; retry". dtrain-launch
// ends with it too, and never restarts the ranks for it: requeue the job, which resumes.
inline constexpr int kRequeueExitCode = 75;

}  // namespace dtrain::cli
