// The job's launchers, one per node, as one: what torchrun's elastic agents agree on through
// their rendezvous, dtrain-launch's agree on over one TCP connection from each node to node
// 0's launcher, the coordinator, at --master-addr:--agent-port (default --master-port + 1).
//
// - Join: node k (k > 0) connects, retrying until --join-timeout, and says hello with its
//   node rank, --nproc-per-node, --max-restarts, run id and a digest of DTRAIN_JOB_TOKEN. The
//   coordinator refuses a hello that differs from its own, or comes after the first attempt
//   has ended, naming what differs. Node k starts its ranks once welcomed; node 0 starts at
//   once.
// - A rank fails on any node: that node's launcher reports it, and the coordinator tells
//   every other node to stop its ranks, naming the rank. Each node reports how its attempt
//   ended; once all have, the coordinator decides for the job: every node restarts at the
//   next attempt number (TORCHELASTIC_RESTART_COUNT), while --max-restarts allows, counted
//   job-wide; otherwise every launcher exits with the failed rank's code.
// - A node is lost when its connection closes (its launcher was killed, or its host went
//   down) or stays silent (TCP keepalive: about 15 s). The coordinator then stops every node
//   with a message naming the lost one, and a node that loses the coordinator stops its own
//   ranks. No restart follows: the lost node's launcher is gone, and it is what would meet
//   the others again.
// - A launcher interrupted by a signal (Ctrl-C, scancel) stops the job without a restart.
// - Elastic jobs (--nnodes MIN:MAX, MIN < MAX; torchrun's elastic agent). Node 0 starts the
//   first attempt once MAX nodes have joined, or MIN and --elastic-wait seconds have passed,
//   sending each node "start <attempt> <slot> <nodes> ...": its place, which numbers its ranks
//   (slot x nproc ...) and the attempt's world size. A lost node stops the attempt as a
//   failure does, and the job restarts without it while MIN nodes remain and --max-restarts
//   allows. A node that joins while an attempt runs (a new one, or a lost one started again)
//   stops it gracefully ("resize": SIGTERM with --preempt-timeout, so the trainer saves a
//   checkpoint, checkpoint.on_signal) and the job restarts with it; such a restart is not
//   counted against --max-restarts. Node 0 hosts the job (the store and the agent): losing
//   it ends the job, as losing torchrun's rendezvous host does. Each node keeps its
//   --node-rank as its name; its slot is its place among the attempt's nodes, in that order.
//
// Every message is one text line. A wait for the coordinator's verdict is bounded only by
// the other nodes' ranks, which are bounded by their collectives' timeouts, and by the
// keepalive that notices a silent node.
#pragma once

#include <poll.h>

#include <memory>
#include <string>
#include <vector>

#include "launcher/launcher.h"

namespace dtrain::launcher {

// How one node's attempt ended.
struct NodeEnd {
  enum Kind { kOk, kFailed, kStopped, kInterrupted, kLost };
  Kind kind = kOk;
  int rank = -1;  // kFailed: the rank that failed first on that node
  int code = 0;   // its exit code; kInterrupted: the launcher's
};

// What the agent saw while the ranks run.
struct AgentEvent {
  enum Kind { kNone, kStop, kLost, kResize };  // kResize: stop to restart with more nodes
  Kind kind = kNone;
  std::string why;  // for the launcher's line: "rank 3 on node 1 exited with code 1"
};

// The job's verdict once an attempt has ended on every node (or, from begin(), the first
// attempt this node runs).
struct Verdict {
  bool restart = false;
  int attempt = 0;      // restart: the attempt's number
  int slot = 0;         // restart: this node's place in it (its ranks are slot x nproc ...)
  int nodes = 0;        // restart: how many nodes it has
  int restarts = 0;     // restart: --max-restarts used so far, job-wide
  bool counted = true;  // restart: counted against --max-restarts (elastic: not for a join)
  int code = 0;         // otherwise: the launcher's exit code
  std::string why;      // why the job ends (code != 0), or (elastic) why it restarts
};

class JobAgent {
 public:
  virtual ~JobAgent() = default;

  // Node 0 listens and returns at once; node k connects and is welcomed, or throws
  // (UsageError for a refused hello, Error when node 0 cannot be reached). `signal_fd`
  // becoming readable (the launcher was signalled) ends a wait to join.
  static std::unique_ptr<JobAgent> open(const LaunchOptions& o, int signal_fd);

  // The first attempt this node runs: at once in a fixed-size job (attempt 0, its
  // --node-rank of --nnodes); in an elastic one once node 0 starts an attempt with it, or the
  // job's end (restart false) when it ends first.
  virtual Verdict begin() = 0;

  // The sockets to poll while the ranks run; `handle` reads what they have.
  virtual void add_fds(std::vector<pollfd>& fds) const = 0;
  virtual AgentEvent handle(const std::vector<pollfd>& fds) = 0;

  // A rank of this node failed first (once per attempt).
  virtual void report_failure(int attempt, int rank, int code) = 0;

  // This node's attempt has ended: waits for the job's verdict.
  virtual Verdict finish(int attempt, const NodeEnd& mine) = 0;
};

}  // namespace dtrain::launcher
