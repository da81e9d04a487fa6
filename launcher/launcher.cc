#include "launcher/launcher.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <memory>
#include <vector>

#include "comm/backend.h"
#include "core/cli.h"
#include "core/error.h"
#include "core/guardian.h"
#include "core/net.h"
#include "launcher/agent.h"

namespace dtrain::launcher {
namespace {

using Clock = std::chrono::steady_clock;

// How long a rank that stopped because another failed waits to be named: the rank that
// failed first usually exits within this (its peers saw it go), and is named instead.
constexpr auto kConsequenceWait = std::chrono::seconds(2);

int g_signal_pipe[2] = {-1, -1};

void on_signal(int sig) {
  int saved = errno;
  unsigned char s = static_cast<unsigned char>(sig);
  [[maybe_unused]] ssize_t n = ::write(g_signal_pipe[1], &s, 1);
  errno = saved;
}

// The signals the launcher forwards; blocked around fork() so a just-forked rank never runs
// the launcher's handler.
sigset_t forwarded_signals() {
  sigset_t set;
  sigemptyset(&set);
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGUSR1}) sigaddset(&set, sig);
  return set;
}

// Node 0's store port on --master-addr (net::store_bind_address) at --master-port (0: a free
// port), reserved before any rank starts and until the launcher ends: a port in use, or an
// address that is not this machine's, is a usage error, and no other job can take the port
// between the check and rank 0's store, in any attempt. The socket is bound, not listening,
// so rank 0 (dtrain's or c10d's store, both SO_REUSEADDR) binds and listens there itself.
net::Listener store_listener(const LaunchOptions& o) {
  std::string why;
  const std::string bind = net::store_bind_address(o.master_addr, &why);
  if (bind != o.master_addr) {
    std::cerr << "[dtrain-launch] the store listens on " << bind << ":" << o.master_port << " ("
              << why << "); "
              << (o.job_token.empty() && std::getenv("DTRAIN_JOB_TOKEN") == nullptr
                      ? "set the same DTRAIN_JOB_TOKEN on every node, so that only this job's "
                        "ranks are admitted"
                      : "the job token admits only this job's ranks")
              << std::endl;
  }
  net::Listener l = net::reserve(bind, o.master_port);
  if (l.fd < 0 && l.error == EADDRINUSE) {
    DTRAIN_FAIL(UsageError, "--master-port ", o.master_port, " on ", o.master_addr,
                " is already in use (another job, or one that has not ended yet); choose "
                "another, or --master-port 0 for a free one");
  }
  DTRAIN_CHECK_AS(UsageError, l.fd >= 0, "--master-addr ", o.master_addr,
                  " cannot serve the rendezvous on this machine (", l.detail,
                  "): node 0 serves it, so use one of this machine's addresses (127.0.0.1 on "
                  "one node)");
  return l;
}

void write_all(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    ssize_t n = ::write(fd, s.data() + off, s.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    off += static_cast<size_t>(n);
  }
}

Guardian g_guardian;

struct Rank {
  int local_rank = 0;
  int global_rank = 0;
  pid_t pid = -1;
  bool exited = false;
  int exit_code = 0;
  int out_fd = -1, err_fd = -1;
  std::string out_buf, err_buf;
};

// Error lines that several ranks print alike: the first is forwarded, the others are counted
// and summed up once the group has ended ("said by 2 of 2 ranks"). A log line is
// "<date> <time> error <message>" (core/logging.h; the launcher adds the rank prefix).
class RepeatedErrors {
 public:
  // False when `line` repeats an error line another rank already printed (a rank's own
  // repeats are its own: forwarded).
  bool forward(const std::string& line, int rank) {
    const std::string message = error_message(line);
    if (message.empty()) return true;
    auto& ranks = said_[message];
    if (ranks.empty()) order_.push_back(message);
    const bool others = std::any_of(ranks.begin(), ranks.end(), [&](int r) { return r != rank; });
    if (std::find(ranks.begin(), ranks.end(), rank) == ranks.end()) ranks.push_back(rank);
    std::sort(ranks.begin(), ranks.end());
    return !others;
  }

  // One line per message that more than one rank printed.
  std::string summary(int world) const {
    std::string out;
    for (const auto& message : order_) {
      const auto& ranks = said_.at(message);
      if (ranks.size() < 2) continue;
      std::string list;
      for (int r : ranks) list += (list.empty() ? "" : ", ") + std::to_string(r);
      out += "[dtrain-launch] " + std::to_string(ranks.size()) + " of " + std::to_string(world) +
             " ranks (" + list + ") reported the same error, printed once above: " +
             (message.size() > 80 ? message.substr(0, 77) + "..." : message) + "\n";
    }
    return out;
  }

 private:
  static std::string error_message(const std::string& line) {
    // "YYYY-MM-DD HH:MM:SS.mmm error ..." possibly coloured: the level is the third word.
    size_t at = line.find(' ');
    if (at == std::string::npos) return {};
    at = line.find(' ', at + 1);
    if (at == std::string::npos) return {};
    const size_t level = line.find("error", at + 1);
    if (level == std::string::npos || level > at + 8) return {};
    const size_t text = line.find(' ', level);
    return text == std::string::npos ? std::string() : line.substr(text + 1);
  }

  std::map<std::string, std::vector<int>> said_;
  std::vector<std::string> order_;
};

// What the ranks print, forwarded line by line with "[rank k] " in front. Error lines that
// several ranks print alike are forwarded once (RepeatedErrors). On a terminal (the ranks see
// DTRAIN_TTY=1), a line a rank redraws with '\r' (rank 0's progress bar) is shown as it comes,
// and the next line of any rank takes its place.
class Forwarder {
 public:
  explicit Forwarder(bool terminal) : terminal_(terminal) {}

  // Forwards what `fd` has; false at its end (then `fd` is closed and -1). `buf` holds the
  // stream's partial line between calls.
  bool pump(int& fd, std::string& buf, int dest, int rank) {
    char chunk[65536];
    ssize_t n = ::read(fd, chunk, sizeof(chunk));
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) return true;
    std::string out;
    if (n <= 0) {
      if (!buf.empty()) line(buf, rank, out);
      buf.clear();
      write_all(dest, out);
      ::close(fd);
      fd = -1;
      return false;
    }
    buf.append(chunk, static_cast<size_t>(n));
    size_t start = 0, nl;
    while ((nl = buf.find('\n', start)) != std::string::npos) {
      line(buf.substr(start, nl - start), rank, out);
      start = nl + 1;
    }
    buf.erase(0, start);
    // A partial line that redraws itself ("\r[####      ] 5/300 "): shown now.
    // An erase alone ("\r\033[K") waits for the line it makes room for.
    const size_t cr = terminal_ ? buf.rfind('\r') : std::string::npos;
    if (cr != std::string::npos) {
      std::string shown = buf.substr(cr + 1);
      if (shown.rfind("\033[K", 0) == 0) shown.erase(0, 3);
      if (!shown.empty()) {
        out += "\r\033[K" + prefix(rank) + shown;
        live_ = true;
        buf.clear();
      }
    }
    write_all(dest, out);
    return true;
  }

  // After the group: ends a redrawn line, then sums up the repeated errors.
  void finish(int world) {
    if (live_) write_all(2, "\n");
    live_ = false;
    std::cerr << repeated_.summary(world) << std::flush;
  }

 private:
  static std::string prefix(int rank) { return "[rank " + std::to_string(rank) + "] "; }

  // One complete line, without its '\n'.
  void line(std::string text, int rank, std::string& out) {
    if (terminal_) {
      // What a terminal shows of it: the text after its last '\r' and erase.
      const size_t cr = text.rfind('\r');
      if (cr != std::string::npos) {
        text.erase(0, cr + 1);
        if (text.rfind("\033[K", 0) == 0) text.erase(0, 3);
        if (text.empty()) return;
      }
    }
    if (!repeated_.forward(text, rank)) return;
    if (live_) out += "\r\033[K";
    live_ = false;
    out += prefix(rank) + text + "\n";
  }

  const bool terminal_;
  bool live_ = false;  // a redrawn line is on the terminal, without its newline
  RepeatedErrors repeated_;
};

pid_t spawn(const LaunchOptions& o, Rank& r, int restart_count, int port) {
  // Close-on-exec, so no rank inherits another rank's pipe ends (dup2 below clears the flag on
  // this rank's own copies).
  int out[2], err[2];
  DTRAIN_CHECK(::pipe2(out, O_CLOEXEC) == 0 && ::pipe2(err, O_CLOEXEC) == 0,
               "dtrain-launch: pipe() failed: ", std::strerror(errno));
  std::map<std::string, std::string> env{
      {"RANK", std::to_string(r.global_rank)},
      {"WORLD_SIZE", std::to_string(o.nproc_per_node * o.nnodes)},
      {"LOCAL_RANK", std::to_string(r.local_rank)},
      {"LOCAL_WORLD_SIZE", std::to_string(o.nproc_per_node)},
      {"GROUP_RANK", std::to_string(o.node_rank)},
      {"GROUP_WORLD_SIZE", std::to_string(o.nnodes)},
      {"ROLE_RANK", std::to_string(r.global_rank)},
      {"ROLE_WORLD_SIZE", std::to_string(o.nproc_per_node * o.nnodes)},
      {"ROLE_NAME", "default"},
      {"MASTER_ADDR", o.master_addr},
      {"MASTER_PORT", std::to_string(port)},
      {"TORCHELASTIC_RESTART_COUNT", std::to_string(restart_count)},
      {"TORCHELASTIC_MAX_RESTARTS", std::to_string(o.max_restarts)},
      {"TORCHELASTIC_RUN_ID", o.run_id},
      {"DTRAIN_LAUNCHER", "1"},
  };
  // Rank 0 draws its progress bar when the launcher's output is a terminal (Forwarder).
  if (::isatty(STDERR_FILENO)) env["DTRAIN_TTY"] = "1";
  if (!o.backend.empty()) env["DTRAIN_BACKEND"] = o.backend;
  if (!o.job_token.empty()) env["DTRAIN_JOB_TOKEN"] = o.job_token;
  if (o.nproc_per_node > 1 && std::getenv("OMP_NUM_THREADS") == nullptr) {
    env["OMP_NUM_THREADS"] = "1";
  }
  pid_t launcher_pid = ::getpid();
  sigset_t block = forwarded_signals(), previous;
  ::sigprocmask(SIG_BLOCK, &block, &previous);
  pid_t pid = ::fork();
  if (pid != 0) ::sigprocmask(SIG_SETMASK, &previous, nullptr);
  DTRAIN_CHECK(pid >= 0, "dtrain-launch: fork() failed: ", std::strerror(errno));
  if (pid == 0) {
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != launcher_pid) ::_exit(127);
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGPIPE, SIGUSR1}) ::signal(sig, SIG_DFL);
    ::sigprocmask(SIG_SETMASK, &previous, nullptr);
    // Ranks run in their own process groups, outside the terminal's foreground group: a
    // read from the terminal would stop them (SIGTTIN). They get no stdin.
    int devnull = ::open("/dev/null", O_RDONLY);
    if (devnull >= 0) ::dup2(devnull, 0);
    ::dup2(out[1], 1);  // dup2 clears O_CLOEXEC on the copies
    ::dup2(err[1], 2);
    for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
    std::vector<char*> argv;
    for (const auto& a : o.command) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execvp(argv[0], argv.data());
    std::string msg =
        "dtrain-launch: cannot execute '" + o.command[0] + "': " + std::strerror(errno) + "\n";
    write_all(2, msg);
    ::_exit(127);
  }
  ::setpgid(pid, pid);  // also from the parent, so signals never miss a just-forked rank
  g_guardian.add(pid);
  ::close(out[1]);
  ::close(err[1]);
  r.out_fd = out[0];
  r.err_fd = err[0];
  r.pid = pid;
  return pid;
}

// Signals every live rank's process group. A stopped rank (SIGSTOP, a debugger) would hold
// any signal but SIGKILL pending, so SIGCONT follows.
void signal_all(std::vector<Rank>& ranks, int sig) {
  for (auto& r : ranks) {
    if (r.exited || r.pid <= 0) continue;
    ::kill(-r.pid, sig);
    if (sig != SIGKILL) ::kill(-r.pid, SIGCONT);
  }
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

// kStopped: another node's rank failed (launcher/agent.h); kLost: a node was lost.
// kRequeue: the ranks stopped on a signal with a checkpoint saved (cli::kRequeueExitCode).
enum class Outcome { kSuccess, kRankFailed, kInterrupted, kStopped, kLost, kRequeue };

struct Result {
  Outcome outcome = Outcome::kSuccess;
  int code = 0;
  int failed_rank = -1;
  bool interrupted = false;  // the launcher was signalled: never restart
};

// Runs one attempt of this node's group; `agent` (multi-node jobs) hears of the other nodes.
Result run_group(const LaunchOptions& o, int restart_count, int port, JobAgent* agent) {
  std::vector<Rank> ranks(static_cast<size_t>(o.nproc_per_node));
  for (int i = 0; i < o.nproc_per_node; ++i) {
    ranks[i].local_rank = i;
    ranks[i].global_rank = o.node_rank * o.nproc_per_node + i;
    spawn(o, ranks[i], restart_count, port);
  }
  Result result;
  Forwarder output(::isatty(STDERR_FILENO) != 0);
  bool terminating = false;
  Clock::time_point kill_at{};
  Clock::time_point drain_until{};
  Rank* consequence = nullptr;  // the first rank that stopped because another failed
  Clock::time_point consequence_until{};
  auto start_termination = [&](int sig, double grace_s) {
    if (!terminating) {
      terminating = true;
      kill_at = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(grace_s * 1000));
    }
    signal_all(ranks, sig);
  };
  // Reaps exited ranks; returns the one failure of this sweep to report. Of the ranks that
  // failed in one sweep, the one a signal killed is the likely cause (the others saw it die),
  // so it is the one reported; SIGPIPE, what a write to a dead peer gives, less, and a rank
  // that says it stopped because another failed (cli::kConsequenceExitCode) least of all: it
  // is named only when no other rank here fails within kConsequenceWait, nor another node
  // reports a failure in that time (the cause may be there).
  auto reap = [&]() -> Rank* {
    int status = 0;
    pid_t pid;
    Rank* first_failed = nullptr;
    while ((pid = ::waitpid(-1, &status, WNOHANG | WUNTRACED)) > 0) {
      for (auto& r : ranks) {
        if (r.pid != pid) continue;
        if (WIFSTOPPED(status)) {
          std::cerr << "[dtrain-launch] rank " << r.global_rank << " (pid " << r.pid
                    << ") was stopped by signal " << WSTOPSIG(status)
                    << "; the other ranks will time out in their next collective unless it "
                       "continues (SIGCONT)"
                    << std::endl;
          continue;
        }
        r.exited = true;
        r.exit_code = exit_code_of(status);
        ::kill(-r.pid, SIGKILL);  // leftovers in the rank's process group
        g_guardian.remove(r.pid);
        if (r.exit_code == cli::kRequeueExitCode &&
            (result.outcome == Outcome::kSuccess || result.outcome == Outcome::kInterrupted ||
             result.outcome == Outcome::kRequeue)) {
          // Stopped on a signal with its checkpoint saved: not a failure. Every rank stops at
          // the same step; one that has not within --preempt-timeout is ended.
          if (result.outcome != Outcome::kRequeue) {
            std::cerr << "[dtrain-launch] rank " << r.global_rank
                      << " stopped on a signal with a checkpoint saved (exit code "
                      << cli::kRequeueExitCode << "); the job can be requeued" << std::endl;
          }
          const bool interrupted = result.interrupted;
          result = {Outcome::kRequeue, cli::kRequeueExitCode, -1};
          result.interrupted = interrupted;
          if (!terminating) {
            terminating = true;
            kill_at = Clock::now() +
                      std::chrono::milliseconds(static_cast<int64_t>(o.preempt_timeout_s * 1000));
          }
          continue;
        }
        // A rank killed by SIGPIPE wrote to a dead peer's socket: a symptom, like a rank that
        // exited with an error, so any other signal in the same sweep is the one reported.
        auto weight = [](int code) {
          if (code == cli::kConsequenceExitCode) return -1;
          return code <= 128 ? 0 : code == 128 + SIGPIPE ? 1 : 2;
        };
        if (r.exit_code != 0 && result.outcome == Outcome::kSuccess &&
            (first_failed == nullptr || weight(r.exit_code) > weight(first_failed->exit_code))) {
          first_failed = &r;
        }
      }
    }
    return first_failed;
  };
  // Reports `r` as the job's failure: the other ranks here are ended, and the other nodes told.
  auto fail_with = [&](const Rank& r) {
    result = {Outcome::kRankFailed, r.exit_code, r.global_rank};
    std::cerr << "[dtrain-launch] rank " << r.global_rank << " (pid " << r.pid << ") "
              << (r.exit_code > 128 ? "was killed by signal " + std::to_string(r.exit_code - 128) +
                                          " (exit code " + std::to_string(r.exit_code) + ")"
                  : r.exit_code == cli::kConsequenceExitCode
                      ? "stopped because a rank elsewhere failed (exit code " +
                            std::to_string(r.exit_code) + ")"
                      : "exited with code " + std::to_string(r.exit_code))
              << "; terminating the other ranks" << std::endl;
    start_termination(SIGTERM, o.grace_period_s);
    consequence = nullptr;
    if (agent != nullptr) agent->report_failure(restart_count, r.global_rank, r.exit_code);
  };
  while (true) {
    Rank* first_failed = reap();
    if (first_failed != nullptr && first_failed->exit_code == cli::kConsequenceExitCode) {
      if (consequence == nullptr) {
        consequence = first_failed;
        consequence_until = Clock::now() + kConsequenceWait;
      }
      first_failed = nullptr;
    }
    const bool none_left =
        std::all_of(ranks.begin(), ranks.end(), [](const Rank& r) { return r.exited; });
    // With other nodes, every rank here having stopped as a consequence still waits for the
    // cause's node to say so (its launcher may take a poll interval to see its rank die).
    if (first_failed == nullptr && consequence != nullptr && result.outcome == Outcome::kSuccess &&
        (Clock::now() >= consequence_until || (none_left && agent == nullptr))) {
      first_failed = consequence;
    }
    if (first_failed != nullptr) fail_with(*first_failed);
    const bool undecided = consequence != nullptr && result.outcome == Outcome::kSuccess;
    bool all_exited = true;
    bool pipes_open = false;
    for (const auto& r : ranks) {
      all_exited = all_exited && r.exited;
      pipes_open = pipes_open || r.out_fd >= 0 || r.err_fd >= 0;
    }
    if (all_exited && !pipes_open && !undecided) break;
    if (all_exited) {
      // A descendant that left the rank's process group may hold the pipes; stop waiting
      // for its output shortly after the ranks themselves are gone.
      if (drain_until == Clock::time_point{}) drain_until = Clock::now() + std::chrono::seconds(2);
      if (Clock::now() >= drain_until) {
        for (auto& r : ranks) {
          for (int* fd : {&r.out_fd, &r.err_fd}) {
            if (*fd >= 0) ::close(*fd);
            *fd = -1;
          }
        }
        break;
      }
    }
    if (terminating && Clock::now() >= kill_at) {
      for (auto& r : ranks) {
        if (!r.exited) {
          std::cerr << "[dtrain-launch] rank " << r.global_rank << " (pid " << r.pid
                    << ") did not exit within " << o.grace_period_s
                    << " s of SIGTERM; sending SIGKILL" << std::endl;
        }
      }
      signal_all(ranks, SIGKILL);
      kill_at = Clock::now() + std::chrono::hours(1);
    }
    std::vector<pollfd> fds;
    std::vector<std::pair<Rank*, bool>> owners;  // (rank, is_stderr)
    fds.push_back({g_signal_pipe[0], POLLIN, 0});
    owners.push_back({nullptr, false});
    if (agent != nullptr) {
      agent->add_fds(fds);
      owners.resize(fds.size(), {nullptr, false});
    }
    for (auto& r : ranks) {
      if (r.out_fd >= 0) {
        fds.push_back({r.out_fd, POLLIN, 0});
        owners.push_back({&r, false});
      }
      if (r.err_fd >= 0) {
        fds.push_back({r.err_fd, POLLIN, 0});
        owners.push_back({&r, true});
      }
    }
    int n = ::poll(fds.data(), fds.size(), 50);
    if (agent != nullptr) {  // also on a timeout: a message may wait in the agent's buffer
      const AgentEvent e = agent->handle(fds);
      // Another node's failure, unless a rank here failed by itself meanwhile (its death not
      // reaped yet when the other node, told by its ranks, reported theirs): this node's is
      // then the cause to name.
      Rank* here =
          e.kind == AgentEvent::kStop && result.outcome == Outcome::kSuccess ? reap() : nullptr;
      if (here != nullptr && here->exit_code != cli::kConsequenceExitCode) {
        fail_with(*here);
      } else if (e.kind == AgentEvent::kStop && result.outcome == Outcome::kSuccess) {
        std::cerr << "[dtrain-launch] " << e.why << "; stopping this node's ranks" << std::endl;
        result = {Outcome::kStopped, 0, -1};
        start_termination(SIGTERM, o.grace_period_s);
      } else if (e.kind == AgentEvent::kResize && result.outcome == Outcome::kSuccess) {
        // The job grows: the ranks finish their step and save (checkpoint.on_signal) before
        // every node restarts with the new one.
        std::cerr << "[dtrain-launch] " << e.why << "; stopping this node's ranks (SIGTERM: "
                  << "they save a checkpoint first)" << std::endl;
        result = {Outcome::kStopped, 0, -1};
        start_termination(SIGTERM, std::max(o.grace_period_s, o.preempt_timeout_s));
      } else if (e.kind == AgentEvent::kLost) {
        std::cerr << "[dtrain-launch] " << e.why << "; stopping this node's ranks" << std::endl;
        if (result.outcome != Outcome::kInterrupted) result.outcome = Outcome::kLost;
        start_termination(SIGTERM, o.grace_period_s);
      }
    }
    if (n <= 0) continue;
    for (size_t i = 0; i < fds.size(); ++i) {
      if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      if (i > 0 && owners[i].first == nullptr) continue;  // the agent's
      if (i == 0) {
        unsigned char sig = 0;
        if (::read(g_signal_pipe[0], &sig, 1) == 1) {
          if (sig == SIGUSR1) {
            // Slurm's --signal warning: forwarded, and the ranks decide (with
            // checkpoint.on_signal they save and stop; otherwise they go on).
            std::cerr << "[dtrain-launch] received SIGUSR1; forwarding it to every rank"
                      << std::endl;
            signal_all(ranks, SIGUSR1);
            continue;
          }
          std::cerr << "[dtrain-launch] received signal " << int(sig)
                    << "; forwarding it to every rank" << std::endl;
          if (result.outcome != Outcome::kRankFailed && result.outcome != Outcome::kRequeue) {
            result = {Outcome::kInterrupted, 128 + sig, -1};
          }
          result.interrupted = true;
          // SIGTERM is a scheduler's notice: the ranks may save first (checkpoint.on_signal).
          start_termination(sig, sig == SIGTERM ? std::max(o.grace_period_s, o.preempt_timeout_s)
                                                : o.grace_period_s);
        }
        continue;
      }
      Rank& r = *owners[i].first;
      if (owners[i].second) {
        output.pump(r.err_fd, r.err_buf, 2, r.global_rank);
      } else {
        output.pump(r.out_fd, r.out_buf, 1, r.global_rank);
      }
    }
  }
  output.finish(o.nproc_per_node * o.nnodes);
  return result;
}

}  // namespace

std::string usage() {
  std::string backends;
  for (const auto& [b, name] : comm::kBackends) {
    backends += (backends.empty() ? "" : "|") + std::string(name);
  }
  return "usage: dtrain-launch [--nproc-per-node N] [--nnodes M|MIN:MAX --node-rank R] "
         "[--master-addr A] [--master-port P] [--max-restarts K] [--backend " +
         backends + "] [--grace-period S] [--version] [--] program [args...]";
}

// A day: longer than any rank needs to write a checkpoint and exit.
constexpr double kMaxGracePeriodS = 86400;

LaunchOptions parse_args(const std::vector<std::string>& args) {
  LaunchOptions o;
  CLI::App app{
      "dtrain-launch: starts --nproc-per-node ranks of a program on this node, as torchrun "
      "does,\nwith torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...), "
      "every\noutput line prefixed with [rank k], and the whole group ended when one rank "
      "fails.",
      "dtrain-launch"};
  app.footer("The program and its arguments follow the options (or --):\n  " + usage());
  app.set_version_flag("--version", cli::version_line("dtrain-launch"));
  app.prefix_command();  // the program starts at the first argument that is not an option
  // torchrun spells them with underscores too.
  app.add_option("--nproc-per-node,--nproc_per_node", o.nproc_per_node, "ranks on this node")
      ->check(CLI::Range(1, 65536));
  std::string nnodes = "1";
  app.add_option("--nnodes", nnodes,
                 "nodes in the job: N, or MIN:MAX for an elastic job (torchrun's form): it "
                 "starts with the nodes that joined (at least MIN), goes on without a lost node "
                 "while MIN remain, and takes in nodes that join later, up to MAX, each change "
                 "a restart from the last checkpoint");
  app.add_option("--elastic-wait", o.elastic_wait_s,
                 "with --nnodes MIN:MAX: once MIN nodes have joined, seconds node 0 waits for "
                 "more before it starts (default 10)");
  app.add_option("--node-rank,--node_rank", o.node_rank, "this node's index, 0 to nnodes-1");
  app.add_option("--master-addr,--master_addr", o.master_addr,
                 "host of node 0, where the rendezvous store listens");
  app.add_option("--master-port,--master_port", o.master_port,
                 "the store's TCP port; 0 picks a free one (one node only)");
  app.add_option("--max-restarts,--max_restarts", o.max_restarts,
                 "restart the whole group up to K times after a failure (with checkpoint.resume: "
                 "auto, it resumes)");
  app.add_option("--backend", o.backend,
                 "sets DTRAIN_BACKEND for the ranks: " + comm::backend_choices() +
                     " (replaces a config's auto only)");
  app.add_option("--run-id,--rdzv-id,--rdzv_id", o.run_id,
                 "the job's id (TORCHELASTIC_RUN_ID); the rendezvous refuses ranks of another "
                 "job. Default: a new random id with --nnodes 1; give the same one to every "
                 "node of a multi-node job");
  app.add_option("--agent-port", o.agent_port,
                 "with --nnodes > 1: where node 0's dtrain-launch meets the others' on "
                 "--master-addr (default --master-port + 1; the same on every node)");
  app.add_option("--join-timeout", o.join_timeout_s,
                 "with --nnodes > 1: seconds a node waits for node 0's dtrain-launch, and node "
                 "0 for the others (default 600)");
  app.add_option("--grace-period,--grace_period", o.grace_period_s,
                 "seconds between SIGTERM and SIGKILL when ending the group");
  app.add_option("--preempt-timeout", o.preempt_timeout_s,
                 "seconds the ranks get to save and stop after this launcher is sent SIGTERM "
                 "(a scheduler's notice; with checkpoint.on_signal they save a checkpoint), "
                 "before SIGKILL (default 180)");
  std::vector<std::string> reversed(args.rbegin(), args.rend());  // CLI11 parses from the back
  try {
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    o.print_and_exit = app.help();
    return o;
  } catch (const CLI::CallForVersion& e) {
    o.print_and_exit = e.what();
    return o;
  } catch (const CLI::ParseError& e) {
    DTRAIN_FAIL(UsageError, e.what(), "\n", usage(),
                "\n(dtrain-launch --help explains each option)");
  }
  {
    // "N" or "MIN:MAX", whole numbers only.
    auto whole = [](const std::string& t, int& out) {
      if (t.empty() || t.size() > 8 || t.find_first_not_of("0123456789") != std::string::npos) {
        return false;
      }
      out = std::stoi(t);
      return true;
    };
    const size_t colon = nnodes.find(':');
    const bool ok = colon == std::string::npos ? whole(nnodes, o.nnodes)
                                               : whole(nnodes.substr(0, colon), o.min_nodes) &&
                                                     whole(nnodes.substr(colon + 1), o.nnodes);
    DTRAIN_CHECK_AS(UsageError, ok && o.nnodes >= 1 && o.nnodes <= (1 << 20),
                    "--nnodes takes N or MIN:MAX (whole numbers from 1 to ", 1 << 20, "), got '",
                    nnodes, "'\n", usage());
    DTRAIN_CHECK_AS(UsageError,
                    colon == std::string::npos || (o.min_nodes >= 1 && o.min_nodes <= o.nnodes),
                    "--nnodes ", nnodes, ": MIN must be from 1 to MAX\n", usage());
  }
  o.command = app.remaining();
  if (!o.command.empty() && o.command.front() == "--") {
    o.command.erase(o.command.begin());
  } else if (!o.command.empty() && o.command.front().size() > 1 && o.command.front()[0] == '-') {
    // An option CLI11 does not know ends option parsing; a program is never spelt "-x"
    // (after --, it may be).
    DTRAIN_FAIL(UsageError, "unknown option ", o.command.front(), "\n", usage(),
                "\n(dtrain-launch --help explains each option)");
  }
  DTRAIN_CHECK_AS(UsageError, !o.command.empty(), "no program to launch\n", usage());
  DTRAIN_CHECK_AS(UsageError, o.nproc_per_node >= 1, "--nproc-per-node must be at least 1, got ",
                  o.nproc_per_node, "\n", usage());
  DTRAIN_CHECK_AS(UsageError, o.nnodes >= 1, "--nnodes must be at least 1, got ", o.nnodes, "\n",
                  usage());
  DTRAIN_CHECK_AS(UsageError, o.node_rank >= 0 && o.node_rank < o.nnodes, "--node-rank ",
                  o.node_rank, " must be in [0, --nnodes ", o.nnodes, ")\n", usage());
  DTRAIN_CHECK_AS(UsageError, o.master_port >= 0 && o.master_port < 65536, "--master-port ",
                  o.master_port, " is not a TCP port\n", usage());
  DTRAIN_CHECK_AS(UsageError, o.master_port != 0 || o.nnodes == 1,
                  "--master-port 0 (pick a free port) works only with --nnodes 1\n", usage());
  DTRAIN_CHECK_AS(UsageError, o.max_restarts >= 0, "--max-restarts must be >= 0\n", usage());
  DTRAIN_CHECK_AS(UsageError, o.agent_port >= 0 && o.agent_port < 65536, "--agent-port ",
                  o.agent_port, " is not a TCP port\n", usage());
  DTRAIN_CHECK_AS(
      UsageError,
      o.nnodes == 1 || (o.agent_port == 0 ? o.master_port < 65535 : o.agent_port != o.master_port),
      "--agent-port must differ from --master-port (node 0's launcher listens on "
      "one, rank 0's store on the other)\n",
      usage());
  DTRAIN_CHECK_AS(UsageError, o.elastic_wait_s >= 0 && o.elastic_wait_s <= kMaxGracePeriodS,
                  "--elastic-wait must be a number of seconds in [0, ", kMaxGracePeriodS, "], got ",
                  o.elastic_wait_s, "\n", usage());
  DTRAIN_CHECK_AS(UsageError, o.join_timeout_s > 0 && o.join_timeout_s <= kMaxGracePeriodS,
                  "--join-timeout must be a number of seconds in (0, ", kMaxGracePeriodS, "], got ",
                  o.join_timeout_s, "\n", usage());
  // The ranks' WORLD_SIZE and RANK are ints, and the grace period becomes a deadline on the
  // steady clock (nanoseconds in 64 bits): keep both representable (inf would be UB there).
  DTRAIN_CHECK_AS(UsageError, static_cast<int64_t>(o.nproc_per_node) * o.nnodes <= INT32_MAX,
                  "--nproc-per-node ", o.nproc_per_node, " times --nnodes ", o.nnodes,
                  " is more ranks than a job can have (", INT32_MAX, ")\n", usage());
  DTRAIN_CHECK_AS(UsageError, o.preempt_timeout_s >= 0 && o.preempt_timeout_s <= kMaxGracePeriodS,
                  "--preempt-timeout must be a number of seconds in [0, ", kMaxGracePeriodS,
                  "], got ", o.preempt_timeout_s, "\n", usage());
  DTRAIN_CHECK_AS(UsageError, o.grace_period_s >= 0 && o.grace_period_s <= kMaxGracePeriodS,
                  "--grace-period must be a number of seconds in [0, ", kMaxGracePeriodS, "], got ",
                  o.grace_period_s, "\n", usage());
  DTRAIN_CHECK_AS(UsageError, o.backend.empty() || comm::backend_from_name(o.backend),
                  "--backend must be ", comm::backend_choices(), ", got '", o.backend, "'\n",
                  usage());
  return o;
}

namespace {

std::string random_hex(size_t bytes) {
  std::string raw(bytes, '\0');
  int fd = ::open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  DTRAIN_CHECK(fd >= 0 && ::read(fd, raw.data(), bytes) == static_cast<ssize_t>(bytes),
               "dtrain-launch: cannot read /dev/urandom: ", std::strerror(errno));
  ::close(fd);
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : raw) {
    out += digits[c >> 4];
    out += digits[c & 15];
  }
  return out;
}

}  // namespace

// Started as one of several tasks by mpirun (OpenMPI, MPICH's Hydra, PMIx) or by a Slurm
// step with more than one task on this node: each task would launch ranks of its own, and
// the ranks would inherit MPI's variables. Names what says so, or returns an empty string.
std::string started_by_mpi_or_slurm() {
  auto env = [](const char* name) {
    const char* v = std::getenv(name);
    return std::string(v == nullptr ? "" : v);
  };
  if (!env("SLURM_STEP_ID").empty()) {
    const std::string tasks = env("SLURM_STEP_NUM_TASKS"), nodes = env("SLURM_STEP_NUM_NODES");
    if (!tasks.empty() && !nodes.empty() && std::atoi(tasks.c_str()) > std::atoi(nodes.c_str())) {
      return "srun started it as " + tasks + " tasks on " + nodes +
             " node(s) (SLURM_STEP_NUM_TASKS)";
    }
    return {};  // one launcher per node: torchrun's pattern under srun
  }
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"}) {
    if (!env(name).empty()) return std::string("mpirun started it (") + name + " is set)";
  }
  return {};
}

namespace {

// A multi-node job: every attempt's end is agreed with the other nodes (launcher/agent.h).
int run_job(const LaunchOptions& options, int port) {
  std::unique_ptr<JobAgent> agent = JobAgent::open(options, g_signal_pipe[0]);
  Verdict v = agent->begin();
  if (v.restart && v.attempt > 0) {
    std::cerr << "[dtrain-launch] the job takes this node in at attempt " << v.attempt << ": "
              << v.nodes << " node(s), this one as node slot " << v.slot << std::endl;
  }
  while (v.restart) {
    // This attempt's place: the node's slot among its nodes numbers its ranks.
    LaunchOptions here = options;
    here.node_rank = v.slot;
    here.nnodes = v.nodes;
    const Result r = run_group(here, v.attempt, port, agent.get());
    NodeEnd mine;
    if (r.interrupted || r.outcome == Outcome::kInterrupted || r.outcome == Outcome::kRequeue) {
      mine = {NodeEnd::kInterrupted, -1, r.code};
    } else if (r.outcome == Outcome::kRankFailed) {
      mine = {NodeEnd::kFailed, r.failed_rank, r.code};
    } else if (r.outcome == Outcome::kStopped) {
      mine = {NodeEnd::kStopped, -1, 0};
    } else if (r.outcome == Outcome::kLost) {
      mine = {NodeEnd::kLost, -1, 1};
    }
    const int attempt = v.attempt;
    v = agent->finish(attempt, mine);
    if (!v.restart) {
      if (v.code != 0) {
        std::cerr << "[dtrain-launch] the job ends on every node"
                  << (v.why.empty() ? "" : ": " + v.why)
                  << (options.max_restarts > 0 && v.restarts >= options.max_restarts
                          ? " (after " + std::to_string(options.max_restarts) + " restart(s))"
                          : "")
                  << std::endl;
      }
      return v.code;
    }
    if (!options.elastic()) {
      std::cerr << "[dtrain-launch] restarting every node's ranks (restart " << v.attempt << " of "
                << options.max_restarts << ", agreed by all " << options.nnodes << " nodes)"
                << std::endl;
    } else {
      std::cerr << "[dtrain-launch] restarting every node's ranks with " << v.nodes
                << " node(s), this one as node slot " << v.slot << " ("
                << (v.counted ? "restart " + std::to_string(v.restarts) + " of " +
                                    std::to_string(options.max_restarts)
                              : std::string("not counted against --max-restarts"))
                << (v.why.empty() ? "" : ": " + v.why) << ")" << std::endl;
    }
  }
  if (v.code != 0) {
    std::cerr << "[dtrain-launch] the job ended before this node ran"
              << (v.why.empty() ? "" : ": " + v.why) << std::endl;
  }
  return v.code;
}

}  // namespace

int run(const LaunchOptions& given) {
  const std::string mpi = started_by_mpi_or_slurm();
  DTRAIN_CHECK_AS(UsageError, mpi.empty(), mpi,
                  ", but mpirun and srun start the ranks themselves: run the program directly "
                  "(mpirun -np 2 dtrain-train --config ...; srun dtrain-train ...), or start "
                  "one dtrain-launch per node (srun --ntasks-per-node=1 dtrain-launch "
                  "--nnodes N ...)");
  LaunchOptions options = given;
  if (options.run_id.empty()) options.run_id = options.nnodes == 1 ? random_hex(8) : "none";
  if (options.job_token.empty() && options.nnodes == 1 &&
      std::getenv("DTRAIN_JOB_TOKEN") == nullptr) {
    options.job_token = random_hex(16);
  }
  g_guardian.start(options.grace_period_s);  // first: it inherits nothing of what follows
  struct StopGuardian {
    ~StopGuardian() { g_guardian.stop(); }
  } stop_guardian;
  DTRAIN_CHECK(::pipe2(g_signal_pipe, O_CLOEXEC) == 0, "dtrain-launch: pipe() failed");
  ::fcntl(g_signal_pipe[0], F_SETFL, O_NONBLOCK);
  ::fcntl(g_signal_pipe[1], F_SETFL, O_NONBLOCK);
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGUSR1}) ::sigaction(sig, &sa, nullptr);
  ::signal(SIGPIPE, SIG_IGN);

  // Node 0 serves the store: its port is reserved before anyone starts (later nodes cannot
  // check: the address is node 0's).
  net::Listener store;
  if (options.node_rank == 0) store = store_listener(options);
  struct CloseStore {
    int fd;
    ~CloseStore() {
      if (fd >= 0) ::close(fd);
    }
  } close_store{store.fd};
  const int port = store.fd >= 0 ? net::bound_port(store.fd) : options.master_port;
  if (options.nnodes > 1) return run_job(options, port);
  for (int attempt = 0;; ++attempt) {
    Result r = run_group(options, attempt, port, nullptr);
    if (r.outcome == Outcome::kSuccess) return 0;
    if (r.outcome == Outcome::kRequeue) return cli::kRequeueExitCode;
    if (r.outcome == Outcome::kInterrupted || r.interrupted) return r.code;
    if (attempt >= options.max_restarts) {
      if (options.max_restarts > 0) {
        std::cerr << "[dtrain-launch] giving up after " << options.max_restarts << " restart(s)"
                  << std::endl;
      }
      return r.code;
    }
    std::cerr << "[dtrain-launch] restarting all ranks (restart " << attempt + 1 << " of "
              << options.max_restarts << ")" << std::endl;
  }
}

}  // namespace dtrain::launcher
