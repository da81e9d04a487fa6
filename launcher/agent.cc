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
      for (size_t node = 1; node < peers_.size() && !said; ++node) {
        if (peers_[node].joined || peers_[node].lost) continue;
        std::cerr << "[dtrain-launch] waiting for node " << node
                  << " to join (up to --join-timeout " << o_.join_timeout_s
                  << " s from the start) before ending the attempt" << std::endl;
        said = true;
      }
      if (Clock::now() >= join_deadline_) {
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
    return verdict(attempt);
  }

 private:
  struct Peer {
    Conn conn;
    bool joined = false;
    bool lost = false;
    int ended_attempt = -1;
    NodeEnd end;
  };

  void accept_one() {
    int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) return;
    keep_alive(fd);
    pending_.push_back(Conn{fd, "", false});
  }

  // "hello <node> <nproc> <max_restarts> <run_id> <token digest>"
  AgentEvent hello(Conn& c, const std::string& line) {
    auto w = words(line, 6);
    std::string refusal;
    const int node = w.size() == 6 && w[0] == "hello" ? to_int(w[1]) : -1;
    if (node < 1 || node >= o_.nnodes) {
      refusal = "node 0 expects --node-rank 1 to " + std::to_string(o_.nnodes - 1) +
                " of --nnodes " + std::to_string(o_.nnodes) + ", and was sent '" +
                line.substr(0, 80) + "'";
    } else if (peers_[node].joined) {
      refusal = "node " + std::to_string(node) +
                " has already joined: two launchers were given "
                "--node-rank " +
                std::to_string(node);
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
    } else if (attempt_ > 0 || ended_) {
      refusal = "node " + std::to_string(node) +
                " joined after the job's first attempt ended; "
                "start every node's dtrain-launch again";
    }
    if (!refusal.empty()) {
      send_line(c.fd, "refuse " + refusal);
      c.close();
      // A node that cannot join would leave the others' ranks waiting at the rendezvous.
      if (node < 1 || node >= o_.nnodes || peers_[node].joined) return {};
      return lose(node, "it was refused: " + refusal);
    }
    Peer& p = peers_[node];
    p.conn = std::move(c);
    c.fd = -1;
    p.joined = true;
    send_line(p.conn.fd, "welcome " + std::to_string(attempt_));
    // A node that joins after a failure was decided stops at once.
    if (stopped_) send_line(p.conn.fd, "stop " + std::to_string(attempt_) + " " + stop_why_);
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
    if (lost_why_.empty()) lost_why_ = why;
    stop(why, node, 1);
    return {AgentEvent::kLost, why};
  }

  // Tells every other node to stop its ranks (once per attempt); true the first time.
  bool stop(const std::string& why, int from_node, int code) {
    if (stopped_) return false;
    stopped_ = true;
    stop_why_ = why;
    stop_code_ = code == 0 ? 1 : code;
    for (size_t node = 1; node < peers_.size(); ++node) {
      if (static_cast<int>(node) != from_node) {
        send_line(peers_[node].conn.fd, "stop " + std::to_string(attempt_) + " " + why);
      }
    }
    return true;
  }

  bool all_ended(int attempt) const {
    for (size_t node = 1; node < peers_.size(); ++node) {
      const Peer& p = peers_[node];
      if (!p.lost && p.ended_attempt != attempt) return false;
    }
    return true;
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
    } else {
      v.code = stop_code_;
      v.why = stop_why_;
    }
    if (v.restart) {
      attempt_ = v.attempt;
      stopped_ = false;
      stop_why_.clear();
    }
    for (size_t node = 1; node < peers_.size(); ++node) {
      send_line(peers_[node].conn.fd, v.restart ? "start " + std::to_string(v.attempt)
                                                : "exit " + std::to_string(v.code) + " " + v.why);
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
  bool ended_ = false;    // an attempt has ended: no node may join any more
  bool stopped_ = false;  // this attempt's nodes were told to stop
  std::string stop_why_;
  int stop_code_ = 1;
  std::string lost_why_;
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
                            std::to_string(o.max_restarts) + " " + o.run_id + " " + token_digest());
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
    while (true) {
      std::string line = next_line(Clock::time_point::max(), signal_fd_);
      if (line.empty() && conn_.closed) {
        v.code = 1;
        v.why = lost_why();
        return v;
      }
      std::string rest;
      auto w = words(line, 2, &rest);
      if (w.size() == 2 && w[0] == "start") {
        v.restart = true;
        v.attempt = attempt_ = to_int(w[1]);
        return v;
      }
      if (w.size() == 2 && w[0] == "exit") {
        v.code = to_int(w[1]);
        v.why = rest;
        return v;
      }
    }
  }

 private:
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
