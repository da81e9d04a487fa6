// A step timeline in Chrome's trace-event format (logging.trace), which Perfetto and
// chrome://tracing open.
//
// The trainer turns recording on for the steps it was asked to trace; while it is on, dtrain
// records complete events ("ph":"X") on named tracks:
//   - "main": each step, its forwards and backwards per micro-batch, the optimizer step, and
//     under FSDP each unit's forward (they nest);
//   - "backward units" (FSDP): each unit's backward, from its pre-backward hook (or the end of
//     the previous unit's, whichever is later) to the moment its last gradient was ready;
//   - one track per communicator worker: each collective from the start to the end of its
//     execution, named by what issued it ("ddp bucket 3", "fsdp unit block1") with dtype,
//     elements, bytes and the time it waited in the queue; a flow arrow ("ph":"s"/"f") runs
//     from where it was enqueued on "main" to where it started.
// Timestamps are microseconds since configure(), which the trainer calls on every rank right
// after a barrier, so ranks line up to well under a millisecond. Each rank's events carry
// pid = rank; the trainer gathers them to rank 0, which writes one file.
//
// Off (the default), every hook is one relaxed atomic load.
#pragma once

#include <cstdint>
#include <string>

namespace dtrain::trace {

// Whether events are being recorded now.
bool enabled();
// Microseconds since configure() on the steady clock.
int64_t now_us();
int64_t to_us(int64_t steady_clock_ns);

// Starts a trace for this rank (the time origin) and forgets earlier events.
void configure(int rank);
void set_recording(bool on);

// A track's id by name ("main", "backward units", ...), registered on first use.
int track(const std::string& name);
constexpr int kMain = 0;  // track("main")

// A complete event on `track`. `args_json`: the members of the event's "args" object without
// braces ("\"bytes\":4096,\"queued_us\":12"), or empty.
void complete(const std::string& name, const char* category, int track, int64_t start_us,
              int64_t end_us, const std::string& args_json = "");
// A flow arrow from (from_track, from_us) to (to_track, to_us).
void flow(int64_t id, int from_track, int64_t from_us, int to_track, int64_t to_us);

// What issued the collectives submitted on this thread while the label lives.
class Label {
 public:
  explicit Label(std::string label);
  ~Label();
  Label(const Label&) = delete;
  Label& operator=(const Label&) = delete;

 private:
  std::string previous_;
};
const std::string& current_label();

// A complete event on `track` from construction to destruction (nothing when not recording
// at construction).
class Scope {
 public:
  Scope(std::string name, const char* category, int track = kMain);
  ~Scope();
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  std::string name_;
  const char* category_;
  int track_;
  int64_t start_ = -1;
};

// This rank's events and track names as the body of a JSON array (comma-separated objects,
// no brackets), then forgets them.
std::string take_events_json();

}  // namespace dtrain::trace
