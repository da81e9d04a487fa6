// The flight recorder: the last collectives this process issued, on every communicator, with
// their timing and state, for the post-mortem of a hung or failed job (PyTorch's NCCL flight
// recorder does the same for NCCL). Each rank keeps a ring of the last N collectives
// (DTRAIN_FLIGHT_ENTRIES, default 2048; 0 turns it off): communicator, sequence number, op,
// dtype, element count, the ranks, and when it was issued, started and ended (wall clock,
// microseconds) and how (issued, started, completed, failed, timed out).
//
// dump() writes it as JSON (flight_rank<k>.json in the folder set by set_dump_dir). dtrain-train
// dumps on a collective's timeout or failure, on SIGTERM (what dtrain-launch sends when
// another rank failed), on an abort, and on SIGUSR2 (on demand; the rank goes on). scripts/flight
// reads every rank's dump and names the rank that fell behind and the first collective where ranks
// disagree or one is missing (docs/reliability.md).
//
// Cost: a few relaxed stores at issue, start and end of each collective, no lock: the issuing
// thread, the backend's thread and a dump never wait for each other (measured in
// flight_recorder_test). Times are the steady clock's readings the Work takes anyway (the
// `now_ns` overloads), shown in a dump as wall-clock microseconds.
#pragma once

#include <cstdint>
#include <string>

#include "comm/work.h"

namespace dtrain::comm::flight {

enum class State { kIssued, kStarted, kCompleted, kFailed, kTimedOut };

// Records a collective at issue; returns its ticket (-1 when the recorder is off). `now_ns`:
// the steady clock's time since its epoch, in nanoseconds; without it the recorder reads it.
int64_t issued(const CollectiveInfo& info, int64_t now_ns);
int64_t issued(const CollectiveInfo& info);
void started(int64_t ticket, int64_t now_ns);
void started(int64_t ticket);
void ended(int64_t ticket, State state, int64_t now_ns);
void ended(int64_t ticket, State state);

// Where dump() writes, and this process's rank (for the file name and the JSON).
void set_dump_dir(const std::string& dir, int rank);

// The ring as JSON: {"rank":k,"reason":...,"dumped_us":...,"entries":[...]}, oldest first.
std::string to_json(const std::string& reason);

// Writes to_json(reason) to <dir>/flight_rank<k>.json (atomically: a temporary name, then a
// rename). Returns the path, or "" when no folder is set, the recorder is off, or the write
// failed. Not async-signal-safe: signal handlers go through install_signal_dumps().
std::string dump(const std::string& reason);

// SIGUSR2 dumps and the rank goes on; SIGTERM dumps, then ends the process as SIGTERM would
// have; SIGABRT (an uncaught exception in a backend's thread, say) dumps within 2 s if it
// can, then aborts. A thread of this process does the dumping (the handlers only write to a
// pipe). (SIGUSR1 is Slurm's warning before a preemption: framework/preemption.h.)
void install_signal_dumps();

// For another signal handler (async-signal-safe): dump, naming `sig`, and go on. A no-op
// before install_signal_dumps().
void dump_on_signal(int sig);

}  // namespace dtrain::comm::flight
