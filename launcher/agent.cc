#include "launcher/agent.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <optional>
#include <sstream>
#include <thread>

#include "core/error.h"
#include "core/net.h"

namespace dtrain::launcher {
namespace {

using Clock = std::chrono::steady_clock;

int agent_port(const LaunchOptions& o) {
  return o.agent_port > 0 ? o.agent_port : o.master_port + 1;
}

// What a hello carries of DTRAIN_JOB_TOKEN: FNV-1a of it (the token itself stays on the node).
std::string token_digest() {
  const char* t = std::getenv("DTRAIN_JOB_TOKEN");
  uint64_t h = 1469598103934665603ull;
  for (const char* p = t == nullptr ? "" : t; *p; ++p) {
    h ^= static_cast<unsigned char>(*p);
    h *= 1099511628211ull;
  }
  std::ostringstream os;
  os << std::hex << h;
  return os.str();
}

// A node silent for about 15 s (no TCP acknowledgement, no keepalive answer) is lost.
void keep_alive(int fd) {
  int one = 1, idle = 5, interval = 2, count = 5;
  unsigned timeout_ms = 15000;
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof(count));
  ::setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &timeout_ms, sizeof(timeout_ms));
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

void send_line(int fd, const std::string& line) {
  if (fd < 0) return;
  const std::string s = line + "\n";
  size_t off = 0;
  while (off < s.size()) {
    ssize_t n = ::send(fd, s.data() + off, s.size() - off, MSG_NOSIGNAL);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) {
      pollfd p{fd, POLLOUT, 0};
      ::poll(&p, 1, 100);
      continue;
    }
    if (n <= 0) return;  // a closed peer is noticed by its reads
    off += static_cast<size_t>(n);
  }
}

// One connection's incoming lines.
struct Conn {
  int fd = -1;
  std::string buf;
  bool closed = false;
  bool silent = false;  // closed because the peer stopped answering (keep_alive)

  // Appends what the socket has to `buf` (or notes that it closed).
  void fill() {
    char chunk[4096];
    ssize_t n = ::recv(fd, chunk, sizeof(chunk), MSG_DONTWAIT);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) return;
    if (n <= 0) {
      closed = true;
      silent = n < 0 && errno == ETIMEDOUT;
      return;
    }
    buf.append(chunk, static_cast<size_t>(n));
  }
  // The next complete line in `buf`, taken out of it; false when there is none yet.
  bool take_line(std::string& line) {
    const size_t nl = buf.find('\n');
    if (nl == std::string::npos) return false;
    line = buf.substr(0, nl);
    buf.erase(0, nl + 1);
    return true;
  }
  // Reads what the socket has; complete lines (buffered ones first) go to `lines`.
  void read_into(std::vector<std::string>& lines) {
    fill();
    for (std::string line; take_line(line);) lines.push_back(line);
  }
  void close() {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
};

bool readable(const std::vector<pollfd>& fds, int fd) {
  for (const auto& p : fds) {
    if (p.fd == fd && fd >= 0) return (p.revents & (POLLIN | POLLHUP | POLLERR)) != 0;
  }
  return false;
}

// Why a connection to another node's launcher ended.
std::string gone(const Conn& c, const std::string& where = "") {
  return "its dtrain-launch" + (where.empty() ? "" : " at " + where) +
         (c.silent ? " stopped answering for about 15 s (its host or the network went down)"
                   : " closed the connection (killed, or its host went down)");
}

std::string describe(int rank, int node, int code) {
  std::string how = code > 128 ? "was killed by signal " + std::to_string(code - 128)
                               : "exited with code " + std::to_string(code);
  return "rank " + std::to_string(rank) + " on node " + std::to_string(node) + " " + how;
}

// The words of a line, and what follows the first `n` of them.
std::vector<std::string> words(const std::string& line, size_t n, std::string* rest = nullptr) {
  std::vector<std::string> out;
  size_t at = 0;
  while (out.size() < n && at < line.size()) {
    size_t end = line.find(' ', at);
    if (end == std::string::npos) end = line.size();
    out.push_back(line.substr(at, end - at));
    at = end + 1;
  }
  if (rest != nullptr) *rest = at < line.size() ? line.substr(at) : "";
  return out;
}

int to_int(const std::string& s) { return std::atoi(s.c_str()); }

const char* kind_word(NodeEnd::Kind k) {
  switch (k) {
    case NodeEnd::kOk:
      return "ok";
    case NodeEnd::kFailed:
      return "failed";
    case NodeEnd::kStopped:
      return "stopped";
    case NodeEnd::kInterrupted:
      return "interrupted";
    case NodeEnd::kLost:
      return "lost";
  }
  return "failed";
}

NodeEnd::Kind kind_of(const std::string& w) {
  for (auto k : {NodeEnd::kOk, NodeEnd::kFailed, NodeEnd::kStopped, NodeEnd::kInterrupted}) {
    if (w == kind_word(k)) return k;
  }
  return NodeEnd::kFailed;
}

// ---- node 0 ----------------------------------------------------------------------------------

class Coordinator final : public JobAgent {
 public:
  Coordinator(const LaunchOptions& o, int signal_fd) : o_(o), signal_fd_(signal_fd) {
    const std::string bind = net::store_bind_address(o.master_addr);
    net::Listener l = net::listen_on(bind, agent_port(o));
    DTRAIN_CHECK_AS(UsageError, l.fd >= 0, "--agent-port ", agent_port(o), " on ", bind,
                    " cannot be listened on (", l.detail,
                    "): node 0's dtrain-launch meets the other nodes' there; choose a free port "
                    "with --agent-port (the same on every node)");
    listen_fd_ = l.fd;
    peers_.resize(static_cast<size_t>(o.nnodes));
    join_deadline_ =
        Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(o.join_timeout_s * 1000));
  }
  ~Coordinator() override {
    if (listen_fd_ >= 0) ::close(listen_fd_);
    for (auto& p : peers_) p.conn.close();
    for (auto& c : pending_) c.close();
  }

  Verdict begin() override {
    Verdict v;
    if (!o_.elastic()) {
      running_ = true;
      v.restart = true;
      v.nodes = o_.nnodes;
      return v;
    }
    // Elastic: the first attempt starts with every node, or with MIN of them once
    // --elastic-wait has passed since MIN had joined.
    std::optional<Clock::time_point> min_since;
    bool said = false;
    while (true) {
      const int live = live_nodes();
      if (live >= o_.min_nodes && !min_since) min_since = Clock::now();
      if (live < o_.min_nodes) min_since.reset();
      const bool waited = min_since && Clock::now() - *min_since >=
                                           std::chrono::milliseconds(
                                               static_cast<int64_t>(o_.elastic_wait_s * 1000));
      if (live == o_.nnodes || waited) break;
      if (live < o_.min_nodes && Clock::now() >= join_deadline_) {
        return end(1, "only " + std::to_string(live) + " node(s) joined within --join-timeout " +
                          std::to_string(int(o_.join_timeout_s)) + " s, fewer than --nnodes " +
                          o_.nnodes_text() + " needs");
      }
      if (!said && live >= o_.min_nodes) {
        std::cerr << "[dtrain-launch] " << live << " of --nnodes " << o_.nnodes_text()
                  << " node(s) have joined; starting in " << o_.elastic_wait_s << " s unless all "
                  << o_.nnodes << " join first (--elastic-wait)" << std::endl;
        said = true;
      }
      std::vector<pollfd> fds;
      add_fds(fds);
      fds.push_back({signal_fd_, POLLIN, 0});
      if (::poll(fds.data(), fds.size(), 100) <= 0) continue;
      if (readable(fds, signal_fd_)) {
        unsigned char sig = 0;
        if (::read(signal_fd_, &sig, 1) == 1) {
          return end(128 + sig, "node 0's dtrain-launch was interrupted (signal " +
                                    std::to_string(sig) + ") before the job started");
        }
      }
      handle(fds);
    }
    return start(0, "");
  }

  void add_fds(std::vector<pollfd>& fds) const override {
    fds.push_back({listen_fd_, POLLIN, 0});
    for (const auto& c : pending_) fds.push_back({c.fd, POLLIN, 0});
    for (const auto& p : peers_) {
      if (p.conn.fd >= 0) fds.push_back({p.conn.fd, POLLIN, 0});
    }
  }

  AgentEvent handle(const std::vector<pollfd>& fds) override {
    AgentEvent event;
    auto note = [&](AgentEvent e) {
      if (event.kind == AgentEvent::kNone || e.kind == AgentEvent::kLost) event = e;
    };
    if (readable(fds, listen_fd_)) accept_one();
    for (size_t i = 0; i < pending_.size();) {
      Conn& c = pending_[i];
      std::vector<std::string> lines;
      if (readable(fds, c.fd)) c.read_into(lines);
      if (!lines.empty()) {
        note(hello(c, lines.front()));
        pending_.erase(pending_.begin() + static_cast<long>(i));
        continue;
      }
      if (c.closed) {
        c.close();
        pending_.erase(pending_.begin() + static_cast<long>(i));
        continue;
      }
      ++i;
    }
    for (size_t node = 1; node < peers_.size(); ++node) {
      Peer& p = peers_[node];
      if (p.conn.fd < 0 || !readable(fds, p.conn.fd)) continue;
      std::vector<std::string> lines;
      p.conn.read_into(lines);
      for (const auto& line : lines) note(message(static_cast<int>(node), line));
      if (p.conn.closed) note(lose(static_cast<int>(node), gone(p.conn)));
    }
    return event;
  }

  void report_failure(int attempt, int rank, int code) override {
    if (attempt == attempt_) stop(describe(rank, 0, code), 0, code);
  }

  Verdict finish(int attempt, const NodeEnd& mine) override {
    mine_ = mine;
    if (mine.kind == NodeEnd::kInterrupted) {
      stop(
          "node 0's dtrain-launch was interrupted (signal " + std::to_string(mine.code - 128) + ")",
          -1, mine.code);
    }
    if (mine.kind == NodeEnd::kFailed) stop(describe(mine.rank, 0, mine.code), 0, mine.code);
    bool said = false;
    while (!all_ended(attempt)) {
      for (size_t node = 1; node < peers_.size() && !said && !o_.elastic(); ++node) {
        if (peers_[node].joined || peers_[node].lost) continue;
        std::cerr << "[dtrain-launch] waiting for node " << node
                  << " to join (up to --join-timeout " << o_.join_timeout_s
                  << " s from the start) before ending the attempt" << std::endl;
        said = true;
      }
      if (Clock::now() >= join_deadline_ && !o_.elastic()) {
        for (size_t node = 1; node < peers_.size(); ++node) {
          if (!peers_[node].joined) {
            lose(static_cast<int>(node),
                 "it never joined: no dtrain-launch --node-rank " + std::to_string(node) +
                     " connected to " + o_.master_addr + ":" + std::to_string(agent_port(o_)) +
                     " within --join-timeout " + std::to_string(int(o_.join_timeout_s)) + " s");
          }
        }
      }
      std::vector<pollfd> fds;
      add_fds(fds);
      fds.push_back({signal_fd_, POLLIN, 0});
      if (::poll(fds.data(), fds.size(), 200) <= 0) continue;
      if (readable(fds, signal_fd_)) {
        unsigned char sig = 0;
        if (::read(signal_fd_, &sig, 1) == 1) {
          mine_ = {NodeEnd::kInterrupted, -1, 128 + sig};
          stop("node 0's dtrain-launch was interrupted (signal " + std::to_string(sig) + ")", -1,
               128 + sig);
        }
      }
      handle(fds);
    }
    return o_.elastic() ? elastic_verdict(attempt) : verdict(attempt);
  }

 private:
  // Why an elastic attempt was stopped first.
  enum class Cause { kNone, kFailure, kLost, kJoin };

  struct Peer {
    Conn conn;
    bool joined = false;
    bool lost = false;
    int in_attempt = -1;  // elastic: the attempt it runs in (-1: waits for the next)
    int ended_attempt = -1;
    NodeEnd end;
  };

  void accept_one() {
    int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) return;
    keep_alive(fd);
    pending_.push_back(Conn{fd, "", false});
  }

  // Nodes joined and not lost, node 0 included.
  int live_nodes() const {
    int live = 1;
    for (size_t node = 1; node < peers_.size(); ++node) {
      live += peers_[node].joined && !peers_[node].lost;
    }
    return live;
  }

  // "hello <node> <nproc> <max_restarts> <run_id> <token digest> <nnodes>"
  AgentEvent hello(Conn& c, const std::string& line) {
    auto w = words(line, 7);
    std::string refusal;
    const int node = w.size() == 7 && w[0] == "hello" ? to_int(w[1]) : -1;
    if (node < 1 || node >= o_.nnodes) {
      refusal = "node 0 expects --node-rank 1 to " + std::to_string(o_.nnodes - 1) +
                " of --nnodes " + o_.nnodes_text() + ", and was sent '" + line.substr(0, 80) + "'";
    } else if (peers_[node].joined && !peers_[node].lost) {
      refusal = "node " + std::to_string(node) +
                " has already joined: two launchers were given "
                "--node-rank " +
                std::to_string(node);
    } else if (w[6] != o_.nnodes_text()) {
      refusal = "node " + std::to_string(node) + " has --nnodes " + w[6] + ", node 0 " +
                o_.nnodes_text() + "; give every node the same";
    } else if (to_int(w[2]) != o_.nproc_per_node) {
      refusal = "node " + std::to_string(node) + " has --nproc-per-node " + w[2] + ", node 0 " +
                std::to_string(o_.nproc_per_node) + "; give every node the same";
    } else if (to_int(w[3]) != o_.max_restarts) {
      refusal = "node " + std::to_string(node) + " has --max-restarts " + w[3] + ", node 0 " +
                std::to_string(o_.max_restarts) + "; give every node the same";
    } else if (w[4] != o_.run_id) {
      refusal = "node " + std::to_string(node) + " has --run-id '" + w[4] + "', node 0 '" +
                o_.run_id + "': give every node of one job the same";
    } else if (w[5] != token_digest()) {
      refusal = "node " + std::to_string(node) +
                " presented a different DTRAIN_JOB_TOKEN (or none): set the same token on "
                "every node";
    } else if (ended_) {
      refusal = "node " + std::to_string(node) + " joined after the job ended";
    } else if (!o_.elastic() && attempt_ > 0) {
      refusal = "node " + std::to_string(node) +
                " joined after the job's first attempt ended; "
                "start every node's dtrain-launch again (or give --nnodes MIN:MAX for a job "
                "that takes nodes in)";
    }
    if (!refusal.empty()) {
      send_line(c.fd, "refuse " + refusal);
      c.close();
      // An elastic job goes on without the refused node. A fixed-size job's node that cannot
      // join would leave the others' ranks waiting at the rendezvous.
      if (o_.elastic() || node < 1 || node >= o_.nnodes || peers_[node].joined) return {};
      return lose(node, "it was refused: " + refusal);
    }
    Peer& p = peers_[node];
    p.conn = std::move(c);
    c.fd = -1;
    p.joined = true;
    p.lost = false;
    p.ended_attempt = -1;
    p.in_attempt = o_.elastic() ? -1 : attempt_;
    send_line(p.conn.fd, "welcome " + std::to_string(attempt_));
    if (!o_.elastic()) {
      // A node that joins after a failure was decided stops at once.
      if (stopped_) send_line(p.conn.fd, "stop " + std::to_string(attempt_) + " " + stop_why_);
      return {};
    }
    if (!running_) return {};  // before the first attempt, or between two: the next takes it
    // While an attempt runs: it stops, saving, and the job restarts with this node.
    std::cerr << "[dtrain-launch] node " << node << " joins the job: stopping attempt " << attempt_
              << " to restart with " << live_nodes() << " node(s)" << std::endl;
    const std::string why = "node " + std::to_string(node) + " joined: restarting with " +
                            std::to_string(live_nodes()) + " node(s)";
    if (stop(why, -1, 1, Cause::kJoin)) return {AgentEvent::kResize, why};
    return {};
  }

  AgentEvent message(int node, const std::string& line) {
    std::string rest;
    auto w = words(line, 4, &rest);
    if (w.size() >= 4 && w[0] == "failed" && to_int(w[1]) == attempt_) {
      const std::string why = describe(to_int(w[2]), node, to_int(w[3]));
      if (stop(why, node, to_int(w[3]))) return {AgentEvent::kStop, why};
    } else if (w.size() >= 4 && w[0] == "ended" && to_int(w[1]) == attempt_) {
      Peer& p = peers_[node];
      p.ended_attempt = attempt_;
      p.end = {kind_of(w[2]), to_int(w[3]), to_int(rest)};
      if (p.end.kind == NodeEnd::kFailed) {
        stop(describe(p.end.rank, node, p.end.code), node, p.end.code);
      } else if (p.end.kind == NodeEnd::kInterrupted) {
        stop("node " + std::to_string(node) + "'s dtrain-launch was interrupted", node, p.end.code);
      }
    }
    return {};
  }

  AgentEvent lose(int node, const std::string& how) {
    Peer& p = peers_[node];
    p.conn.close();
    if (p.lost) return {};
    p.lost = true;
    const std::string why = "node " + std::to_string(node) + " is lost: " + how;
    if (o_.elastic()) {
      // Waiting for an attempt, it is only gone; in one, the attempt stops without it.
      if (!running_ || p.in_attempt != attempt_) {
        std::cerr << "[dtrain-launch] " << why << std::endl;
        return {};
      }
      // The cause to name, even when a rank's failure (its peer gone) was heard first.
      if (attempt_lost_why_.empty()) attempt_lost_why_ = why;
      if (stop(why, node, 1, Cause::kLost)) return {AgentEvent::kStop, why};
      return {};
    }
    if (lost_why_.empty()) lost_why_ = why;
    stop(why, node, 1);
    return {AgentEvent::kLost, why};
  }

  // Tells every other node to stop its ranks (once per attempt); true the first time. A join
  // asks for a graceful stop ("resize": the ranks may save first).
  bool stop(const std::string& why, int from_node, int code, Cause cause = Cause::kFailure) {
    if (stopped_) return false;
    stopped_ = true;
    cause_ = cause;
    stop_why_ = why;
    stop_code_ = code == 0 ? 1 : code;
    const std::string word = cause == Cause::kJoin ? "resize " : "stop ";
    for (size_t node = 1; node < peers_.size(); ++node) {
      if (static_cast<int>(node) != from_node &&
          (!o_.elastic() || peers_[node].in_attempt == attempt_)) {
        send_line(peers_[node].conn.fd, word + std::to_string(attempt_) + " " + why);
      }
    }
    return true;
  }

  bool all_ended(int attempt) const {
    for (size_t node = 1; node < peers_.size(); ++node) {
      const Peer& p = peers_[node];
      if (o_.elastic() && p.in_attempt != attempt) continue;
      if (!p.lost && p.ended_attempt != attempt) return false;
    }
    return true;
  }

  // Ends the job on every node with `code`.
  Verdict end(int code, const std::string& why) {
    ended_ = true;
    running_ = false;
    Verdict v;
    v.code = code;
    v.why = why;
    v.restarts = restarts_;
    for (size_t node = 1; node < peers_.size(); ++node) {
      send_line(peers_[node].conn.fd,
                "exit " + std::to_string(code) + " " + std::to_string(restarts_) + " " + why);
    }
    return v;
  }

  // Starts attempt `attempt` with every live node, each told its place (node 0 first, then
  // the others by node rank); returns node 0's.
  Verdict start(int attempt, std::string why, bool counted = true) {
    attempt_ = attempt;
    stopped_ = false;
    cause_ = Cause::kNone;
    stop_why_.clear();
    attempt_lost_why_.clear();
    running_ = true;
    const int nodes = live_nodes();
    int slot = 1;
    std::string names = "0";
    for (size_t node = 1; node < peers_.size(); ++node) {
      Peer& p = peers_[node];
      if (!p.joined || p.lost) continue;
      p.in_attempt = attempt;
      send_line(p.conn.fd, "start " + std::to_string(attempt) + " " + std::to_string(slot++) + " " +
                               std::to_string(nodes) + " " + std::to_string(restarts_) + " " +
                               (counted ? "1" : "0") + " " + why);
      names += ", " + std::to_string(node);
    }
    if (attempt == 0) {
      std::cerr << "[dtrain-launch] starting with " << nodes << " of --nnodes " << o_.nnodes_text()
                << " node(s): node " << names << std::endl;
    }
    Verdict v;
    v.restart = true;
    v.attempt = attempt;
    v.nodes = nodes;
    v.restarts = restarts_;
    v.counted = counted;
    v.why = why;
    return v;
  }

  Verdict elastic_verdict(int attempt) {
    running_ = false;
    bool all_ok = mine_.kind == NodeEnd::kOk;
    int interrupted = mine_.kind == NodeEnd::kInterrupted ? mine_.code : 0;
    for (size_t node = 1; node < peers_.size(); ++node) {
      const Peer& p = peers_[node];
      if (p.in_attempt != attempt) continue;
      all_ok = all_ok && !p.lost && p.end.kind == NodeEnd::kOk;
      if (!p.lost && p.end.kind == NodeEnd::kInterrupted && interrupted == 0) {
        interrupted = p.end.code;
      }
    }
    const int live = live_nodes();
    if (!attempt_lost_why_.empty()) {
      if (cause_ == Cause::kFailure) cause_ = Cause::kLost;
      if (cause_ == Cause::kLost) stop_why_ = attempt_lost_why_;
    }
    if (all_ok) return end(0, "");  // the job's steps are done (before any stop took hold)
    if (interrupted != 0) return end(interrupted, stop_why_);
    if (cause_ == Cause::kJoin) return start(attempt + 1, stop_why_, /*counted=*/false);
    if (live < o_.min_nodes) {
      return end(1, stop_why_ + "; " + std::to_string(live) + " node(s) remain, fewer than the " +
                        std::to_string(o_.min_nodes) + " --nnodes " + o_.nnodes_text() + " needs");
    }
    if (restarts_ < o_.max_restarts) {
      ++restarts_;
      return start(attempt + 1, stop_why_);
    }
    return end(cause_ == Cause::kLost ? 1 : stop_code_, stop_why_);
  }

  Verdict verdict(int attempt) {
    ended_ = true;
    Verdict v;
    bool all_ok = mine_.kind == NodeEnd::kOk;
    int interrupted = mine_.kind == NodeEnd::kInterrupted ? mine_.code : 0;
    for (size_t node = 1; node < peers_.size(); ++node) {
      const Peer& p = peers_[node];
      all_ok = all_ok && !p.lost && p.end.kind == NodeEnd::kOk;
      if (!p.lost && p.end.kind == NodeEnd::kInterrupted && interrupted == 0) {
        interrupted = p.end.code;
      }
    }
    if (all_ok) {
      v.code = 0;
    } else if (!lost_why_.empty()) {
      v.code = 1;
      v.why = lost_why_;
    } else if (interrupted != 0) {
      v.code = interrupted;
      v.why = stop_why_;
    } else if (attempt < o_.max_restarts) {
      v.restart = true;
      v.attempt = attempt + 1;
      v.nodes = o_.nnodes;
      v.restarts = v.attempt;
    } else {
      v.code = stop_code_;
      v.why = stop_why_;
    }
    v.restarts = v.restart ? v.attempt : attempt;
    if (v.restart) {
      ended_ = false;
      attempt_ = v.attempt;
      stopped_ = false;
      stop_why_.clear();
    }
    for (size_t node = 1; node < peers_.size(); ++node) {
      send_line(
          peers_[node].conn.fd,
          v.restart
              ? "start " + std::to_string(v.attempt) + " " + std::to_string(node) + " " +
                    std::to_string(o_.nnodes) + " " + std::to_string(v.restarts) + " 1"
              : "exit " + std::to_string(v.code) + " " + std::to_string(v.restarts) + " " + v.why);
    }
    return v;
  }

  const LaunchOptions o_;
  const int signal_fd_;
  int listen_fd_ = -1;
  std::vector<Peer> peers_;  // by node rank; [0] is this node
  std::vector<Conn> pending_;
  Clock::time_point join_deadline_;
  int attempt_ = 0;
  int restarts_ = 0;      // elastic: restarts counted against --max-restarts
  bool running_ = false;  // an attempt runs
  bool ended_ = false;    // fixed size: an attempt has ended, no node may join; elastic: the job
  bool stopped_ = false;  // this attempt's nodes were told to stop
  Cause cause_ = Cause::kNone;
  std::string stop_why_;
  int stop_code_ = 1;
  std::string lost_why_;
  std::string attempt_lost_why_;  // elastic: the first node lost in this attempt
  NodeEnd mine_;
};

// ---- node k > 0 ------------------------------------------------------------------------------

class Member final : public JobAgent {
 public:
  Member(const LaunchOptions& o, int signal_fd) : o_(o), signal_fd_(signal_fd) {
    where_ = o.master_addr + ":" + std::to_string(agent_port(o));
    const auto deadline =
        Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(o.join_timeout_s * 1000));
    std::string last_error;
    while (conn_.fd < 0) {
      conn_.fd = connect_once(&last_error);
      if (conn_.fd >= 0) break;
      DTRAIN_CHECK(Clock::now() < deadline, "node 0's dtrain-launch at ", where_,
                   " did not answer within --join-timeout ", o.join_timeout_s, " s (", last_error,
                   "): start it with --node-rank 0 and the same --master-addr, "
                   "--master-port and --agent-port");
      pollfd p{signal_fd, POLLIN, 0};
      if (::poll(&p, 1, 500) > 0) {
        DTRAIN_FAIL(Error, "interrupted while waiting for node 0 at ", where_);
      }
    }
    keep_alive(conn_.fd);
    send_line(conn_.fd, "hello " + std::to_string(o.node_rank) + " " +
                            std::to_string(o.nproc_per_node) + " " +
                            std::to_string(o.max_restarts) + " " + o.run_id + " " + token_digest() +
                            " " + o.nnodes_text());
    std::string line = next_line(deadline, signal_fd);
    std::string rest;
    auto w = words(line, 1, &rest);
    DTRAIN_CHECK_AS(UsageError, w.empty() || w[0] != "refuse", "node 0 at ", where_,
                    " refused this node: ", rest);
    DTRAIN_CHECK(!w.empty() && w[0] == "welcome", "node 0 at ", where_,
                 " did not welcome this node (it said '", line.substr(0, 80), "')");
    attempt_ = to_int(rest);
    // A stop sent right after the welcome waits in the buffer for the first handle().
  }
  ~Member() override { conn_.close(); }

  Verdict begin() override {
    Verdict v;
    if (!o_.elastic()) {
      v.restart = true;
      v.attempt = attempt_;
      v.slot = o_.node_rank;
      v.nodes = o_.nnodes;
      return v;
    }
    std::cerr << "[dtrain-launch] joined node 0 at " << where_
              << "; waiting for it to start an attempt with this node" << std::endl;
    return next_verdict();
  }

  void add_fds(std::vector<pollfd>& fds) const override {
    if (conn_.fd >= 0) fds.push_back({conn_.fd, POLLIN, 0});
  }

  AgentEvent handle(const std::vector<pollfd>& fds) override {
    std::vector<std::string> lines;
    if (conn_.fd >= 0 && readable(fds, conn_.fd)) conn_.fill();
    for (std::string line; conn_.take_line(line);) lines.push_back(line);
    for (const auto& line : lines) {
      std::string why;
      auto w = words(line, 2, &why);
      if (w.size() == 2 && w[0] == "stop" && to_int(w[1]) == attempt_) {
        return {AgentEvent::kStop, why};
      }
      if (w.size() == 2 && w[0] == "resize" && to_int(w[1]) == attempt_) {
        return {AgentEvent::kResize, why};
      }
    }
    if (conn_.closed && conn_.fd >= 0) {
      conn_.close();
      return {AgentEvent::kLost, lost_why()};
    }
    return {};
  }

  void report_failure(int attempt, int rank, int code) override {
    send_line(conn_.fd, "failed " + std::to_string(attempt) + " " + std::to_string(rank) + " " +
                            std::to_string(code));
  }

  Verdict finish(int attempt, const NodeEnd& mine) override {
    Verdict v;
    if (conn_.fd < 0) {
      v.code = 1;
      v.why = lost_why();
      return v;
    }
    send_line(conn_.fd, "ended " + std::to_string(attempt) + " " + kind_word(mine.kind) + " " +
                            std::to_string(mine.rank) + " " + std::to_string(mine.code));
    return next_verdict();
  }

 private:
  // Node 0's next word on the job: "start <attempt> <slot> <nodes> <restarts> <counted>
  // [why]" or "exit <code> <restarts> [why]" (other lines, a stop for an attempt already over, are
  // passed over).
  Verdict next_verdict() {
    Verdict v;
    while (true) {
      std::string line = next_line(Clock::time_point::max(), signal_fd_);
      if (line.empty() && conn_.closed) {
        v.code = 1;
        v.why = lost_why();
        return v;
      }
      std::string rest;
      auto w = words(line, 6, &rest);
      if (w.size() == 6 && w[0] == "start") {
        v.restart = true;
        v.attempt = attempt_ = to_int(w[1]);
        v.slot = to_int(w[2]);
        v.nodes = to_int(w[3]);
        v.restarts = to_int(w[4]);
        v.counted = w[5] == "1";
        v.why = rest;
        return v;
      }
      w = words(line, 3, &rest);
      if (w.size() == 3 && w[0] == "exit") {
        v.code = to_int(w[1]);
        v.restarts = to_int(w[2]);
        v.why = rest;
        return v;
      }
    }
  }

  int connect_once(std::string* error) const {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    addrinfo* found = nullptr;
    const std::string service = std::to_string(agent_port(o_));
    int rc = ::getaddrinfo(o_.master_addr.c_str(), service.c_str(), &hints, &found);
    if (rc != 0) {
      *error = std::string("does not resolve: ") + ::gai_strerror(rc);
      return -1;
    }
    int out = -1;
    for (addrinfo* a = found; a != nullptr && out < 0; a = a->ai_next) {
      int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
      if (fd < 0) continue;
      int r = ::connect(fd, a->ai_addr, a->ai_addrlen);
      if (r != 0 && errno == EINPROGRESS) {
        pollfd p{fd, POLLOUT, 0};
        int err = ETIMEDOUT;
        socklen_t len = sizeof(err);
        if (::poll(&p, 1, 2000) == 1) ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
        r = err == 0 ? 0 : -1;
        errno = err;
      }
      if (r == 0) {
        ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
        out = fd;
      } else {
        *error = std::strerror(errno);
        ::close(fd);
      }
    }
    ::freeaddrinfo(found);
    return out;
  }

  // The next line from node 0 ("" when the connection closed or the deadline passed; a
  // readable `signal_fd` ends the wait with an error).
  std::string next_line(Clock::time_point deadline, int signal_fd) {
    for (std::string line;;) {
      if (conn_.take_line(line)) return line;
      if (conn_.closed || Clock::now() >= deadline) return "";
      pollfd p[2] = {{conn_.fd, POLLIN, 0}, {signal_fd, POLLIN, 0}};
      if (::poll(p, signal_fd >= 0 ? 2 : 1, 200) <= 0) continue;
      DTRAIN_CHECK(!(p[1].revents & POLLIN) || signal_fd < 0,
                   "interrupted while waiting for node 0 at ", where_);
      conn_.fill();
    }
  }

  std::string lost_why() const { return "node 0 is lost: " + gone(conn_, where_); }

  const LaunchOptions o_;
  const int signal_fd_;
  std::string where_;
  Conn conn_;
  int attempt_ = 0;
};

}  // namespace

std::unique_ptr<JobAgent> JobAgent::open(const LaunchOptions& o, int signal_fd) {
  if (o.node_rank == 0) return std::make_unique<Coordinator>(o, signal_fd);
  return std::make_unique<Member>(o, signal_fd);
}

}  // namespace dtrain::launcher
