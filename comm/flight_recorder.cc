#include "comm/flight_recorder.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

#include "comm/types.h"
#include "core/json.h"

namespace dtrain::comm::flight {
namespace {

int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

struct Entry {
  int64_t ticket = -1;  // which collective holds the slot
  int64_t comm_id = 0;
  int64_t seq = 0;
  std::string op;
  c10::ScalarType dtype = c10::kFloat;
  int64_t numel = 0;
  std::string backend;
  std::shared_ptr<const std::vector<int>> ranks;
  int64_t issued_us = 0, started_us = 0, ended_us = 0;
  State state = State::kIssued;
};

const char* name_of(State s) {
  switch (s) {
    case State::kIssued:
      return "issued";
    case State::kStarted:
      return "started";
    case State::kCompleted:
      return "completed";
    case State::kFailed:
      return "failed";
    case State::kTimedOut:
      return "timed out";
  }
  return "?";
}

class Recorder {
 public:
  Recorder() {
    const char* n = std::getenv("DTRAIN_FLIGHT_ENTRIES");
    const long entries = n != nullptr ? std::atol(n) : 2048;
    ring_.resize(static_cast<size_t>(entries > 0 ? entries : 0));
  }

  bool on() const { return !ring_.empty(); }

  int64_t issued(const CollectiveInfo& info) {
    if (!on()) return -1;
    const int64_t t = now_us();
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t ticket = next_++;
    Entry& e = ring_[static_cast<size_t>(ticket) % ring_.size()];
    e.ticket = ticket;
    e.comm_id = info.comm_id;
    e.seq = info.seq;
    e.op = info.op;
    e.dtype = info.dtype;
    e.numel = info.numel;
    e.backend = info.backend;
    e.ranks = info.ranks;
    e.issued_us = t;
    e.started_us = e.ended_us = 0;
    e.state = State::kIssued;
    return ticket;
  }

  void update(int64_t ticket, State state) {
    if (ticket < 0) return;
    const int64_t t = now_us();
    std::lock_guard<std::mutex> lock(mu_);
    Entry& e = ring_[static_cast<size_t>(ticket) % ring_.size()];
    if (e.ticket != ticket) return;  // overwritten: the ring has moved on
    if (state == State::kStarted) {
      e.started_us = t;
    } else {
      e.ended_us = t;
    }
    e.state = state;
  }

  std::string json(const std::string& reason, int rank) {
    std::ostringstream os;
    os << "{\"rank\":" << rank << ",\"pid\":" << ::getpid() << ",\"reason\":" << json::quote(reason)
       << ",\"dumped_us\":" << now_us() << ",\"capacity\":" << ring_.size() << ",\"entries\":[";
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t first = std::max<int64_t>(0, next_ - static_cast<int64_t>(ring_.size()));
    for (int64_t t = first; t < next_; ++t) {
      const Entry& e = ring_[static_cast<size_t>(t) % ring_.size()];
      if (t > first) os << ",";
      os << "\n{\"comm\":" << e.comm_id << ",\"seq\":" << e.seq << ",\"op\":\"" << e.op
         << "\",\"dtype\":\"" << dtype_name(e.dtype) << "\",\"numel\":" << e.numel
         << ",\"backend\":\"" << e.backend << "\",\"ranks\":[";
      if (e.ranks) {
        for (size_t i = 0; i < e.ranks->size(); ++i) os << (i ? "," : "") << (*e.ranks)[i];
      }
      os << "],\"issued_us\":" << e.issued_us << ",\"started_us\":" << e.started_us
         << ",\"ended_us\":" << e.ended_us << ",\"state\":\"" << name_of(e.state) << "\"}";
    }
    os << "]}\n";
    return os.str();
  }

 private:
  std::mutex mu_;
  std::vector<Entry> ring_;
  int64_t next_ = 0;
};

Recorder& recorder() {
  static Recorder* r = new Recorder();  // never destroyed: a dump may come at exit
  return *r;
}

std::mutex g_dir_mu;
std::string g_dir;
int g_rank = 0;

int g_pipe[2] = {-1, -1};
int g_done[2] = {-1, -1};  // the dumping thread's reply to a crashing one

void on_signal(int sig) {
  const int saved = errno;
  const unsigned char s = static_cast<unsigned char>(sig);
  [[maybe_unused]] ssize_t n = ::write(g_pipe[1], &s, 1);
  if (sig == SIGABRT) {
    // Dying (an uncaught exception in a backend thread, an assertion): let the other thread
    // dump, for up to 2 s (it may need a lock this thread holds), then die as before.
    pollfd p{g_done[0], POLLIN, 0};
    ::poll(&p, 1, 2000);
    ::signal(SIGABRT, SIG_DFL);
    ::raise(SIGABRT);
  }
  errno = saved;
}

}  // namespace

int64_t issued(const CollectiveInfo& info) { return recorder().issued(info); }
void started(int64_t ticket) { recorder().update(ticket, State::kStarted); }
void ended(int64_t ticket, State state) { recorder().update(ticket, state); }

void set_dump_dir(const std::string& dir, int rank) {
  std::lock_guard<std::mutex> lock(g_dir_mu);
  g_dir = dir;
  g_rank = rank;
}

std::string to_json(const std::string& reason) {
  int rank;
  {
    std::lock_guard<std::mutex> lock(g_dir_mu);
    rank = g_rank;
  }
  return recorder().json(reason, rank);
}

std::string dump(const std::string& reason) {
  std::string dir;
  int rank;
  {
    std::lock_guard<std::mutex> lock(g_dir_mu);
    dir = g_dir;
    rank = g_rank;
  }
  if (dir.empty() || !recorder().on()) return {};
  const std::string path = dir + "/flight_rank" + std::to_string(rank) + ".json";
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << recorder().json(reason, rank);
    if (!out.flush()) {
      std::remove(tmp.c_str());
      return {};
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return {};
  }
  return path;
}

void install_signal_dumps() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (::pipe2(g_pipe, O_CLOEXEC) != 0 || ::pipe2(g_done, O_CLOEXEC) != 0) return;
    std::thread([] {
      unsigned char sig = 0;
      while (::read(g_pipe[0], &sig, 1) == 1 || errno == EINTR) {
        if (sig == 0) continue;
        dump(sig == SIGTERM   ? "SIGTERM"
             : sig == SIGABRT ? "SIGABRT (the process aborted)"
                              : "SIGUSR1 (on demand)");
        if (sig == SIGTERM) {
          ::signal(SIGTERM, SIG_DFL);
          ::raise(SIGTERM);
        }
        if (sig == SIGABRT) {
          [[maybe_unused]] ssize_t n = ::write(g_done[1], &sig, 1);
        }
        sig = 0;
      }
    }).detach();
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    ::sigaction(SIGUSR1, &sa, nullptr);
    ::sigaction(SIGTERM, &sa, nullptr);
    ::sigaction(SIGABRT, &sa, nullptr);
  });
}

}  // namespace dtrain::comm::flight
