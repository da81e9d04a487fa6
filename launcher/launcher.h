// dtrain-launch: a torchrun-like launcher for one node of a job.
//
// It spawns --nproc-per-node ranks with torchrun's variables (RANK WORLD_SIZE LOCAL_RANK
// LOCAL_WORLD_SIZE GROUP_RANK MASTER_ADDR MASTER_PORT TORCHELASTIC_RESTART_COUNT ...),
// prefixes every output line with "[rank k] ", forwards SIGINT/SIGTERM/SIGHUP to the ranks,
// and when a rank fails it terminates the others (SIGTERM, then SIGKILL after the grace
// period) and exits with the failing rank's code (128 + signal for a rank killed by one).
// With --max-restarts K the whole group is restarted up to K times (the trainer resumes from
// its last checkpoint). With --nnodes > 1 the nodes' launchers act as one (launcher/agent.h):
// a rank failing on any node stops every node's ranks, and every node restarts together at
// the next attempt, --max-restarts counted job-wide; a lost node ends the job on every node,
// naming it. With --nnodes MIN:MAX (elastic, as torchrun's) the job starts with the nodes
// that joined, restarts without a lost node while MIN remain, and restarts to take in a node
// that joins later, up to MAX. Each rank runs in its own process group, so a rank's children are
// ended with it, and dies with the launcher (PR_SET_PDEATHSIG); a guardian process
// (core/guardian.h) ends the ranks' children too when the launcher itself is SIGKILLed. A
// stopped rank is reported and, when the group ends, continued so that it receives SIGTERM.
// Node 0 checks its --master-addr and --master-port before starting a rank.
//
// When its stderr is a terminal, the ranks get DTRAIN_TTY=1 and a line a rank redraws with
// '\r' (rank 0's progress bar) is shown as it comes. An error line that several ranks print
// alike is printed once, and how many ranks printed it is said when the group has ended. It
// refuses to start under mpirun, or as one of several tasks of an srun step on one node.
//
// Choices where torchrun is silent or differs: --master-port 0 picks a free port (single
// node only); OMP_NUM_THREADS defaults to 1 when more than one rank shares the node, as
// torchrun does; --backend sets DTRAIN_BACKEND, which replaces a config's `auto` only.
// Programs run by argv (execvp), never through a shell.
#pragma once

#include <string>
#include <vector>

namespace dtrain::launcher {

struct LaunchOptions {
  int nproc_per_node = 1;
  int nnodes = 1;     // --nnodes N, or the MAX of --nnodes MIN:MAX
  int min_nodes = 0;  // --nnodes MIN:MAX's MIN (0: --nnodes N)
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  int max_restarts = 0;
  // Multi-node jobs (launcher/agent.h): node 0's launcher listens for the others on
  // --master-addr at agent_port (0: master_port + 1); a node waits up to join_timeout_s
  // for node 0.
  int agent_port = 0;
  double join_timeout_s = 600;
  // Elastic jobs (--nnodes MIN:MAX with MIN < MAX): once MIN nodes have joined, node 0 waits
  // this long for more before it starts the job's first attempt.
  double elastic_wait_s = 10;
  std::string backend;  // empty: leave DTRAIN_BACKEND alone
  double grace_period_s = 10.0;
  // After this launcher gets SIGTERM: the ranks' time to save and stop before SIGKILL.
  double preempt_timeout_s = 180.0;
  // The rendezvous refuses ranks whose run id or DTRAIN_JOB_TOKEN differ (comm/rendezvous.h).
  // With --nnodes 1 both default to fresh random values per launch (a token from the
  // environment is kept); a multi-node job passes the same --run-id (and token) to every node.
  std::string run_id;
  std::string job_token;
  std::vector<std::string> command;  // program and its arguments
  std::string print_and_exit;        // --help or --version: print this, exit 0

  bool elastic() const { return min_nodes > 0 && min_nodes < nnodes; }
  // "N", or "MIN:MAX" for an elastic job: what every node must be given alike.
  std::string nnodes_text() const {
    return min_nodes > 0 && min_nodes != nnodes
               ? std::to_string(min_nodes) + ":" + std::to_string(nnodes)
               : std::to_string(nnodes);
  }
};

std::string usage();

// Parses argv (without argv[0]) with CLI11; throws UsageError with the usage line on bad
// input. For --help and --version it returns only print_and_exit.
LaunchOptions parse_args(const std::vector<std::string>& args);

// Runs the job; returns the launcher's exit code.
int run(const LaunchOptions& options);

}  // namespace dtrain::launcher
