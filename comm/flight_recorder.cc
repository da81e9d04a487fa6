#include "comm/flight_recorder.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>
#include <vector>

#include "comm/types.h"
#include "core/json.h"

namespace dtrain::comm::flight {
namespace {

// Wall-clock microseconds now.
int64_t wall_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// One collective's record. Every field is a relaxed atomic: the issuing thread, the backend's
// thread and a dump (from another thread, at any moment) touch a slot without a lock.
//   - Issue claims the slot by moving its ticket from an older one to -2 (compare-exchange:
//     of two issuers that the ring brought to one slot, the later wins and the earlier records
//     nothing), writes the fields, and publishes the ticket last.
//   - A dump takes an entry only when it reads the same ticket before and after the fields,
//     so a slot being rewritten is left out, never mixed with its successor.
//   - The state carries its ticket (`stamp`), so a start or end that arrives after the ring
//     moved on cannot relabel the newer entry.
// Times are steady-clock nanoseconds (0: not yet), the readings the Work takes anyway; a dump
// converts them to wall-clock microseconds.
constexpr int64_t stamp_of(int64_t ticket, State state) {
  return ticket * 8 + static_cast<int64_t>(state);
}

struct Slot {
  std::atomic<int64_t> ticket{-1};  // which collective holds the slot; -1: none, -2: writing
  std::atomic<int64_t> comm_id{0};
  std::atomic<int64_t> seq{0};
  // CollectiveInfo's views, of NUL-terminated process-lifetime strings: a pointer alone, so
  // even a torn read could not run past one.
  std::atomic<const char*> op{""};
  std::atomic<int> dtype{static_cast<int>(c10::kFloat)};
  std::atomic<int64_t> numel{0};
  std::atomic<const char*> backend{""};
  std::atomic<const std::vector<int>*> ranks{nullptr};  // kept alive by Recorder::keep_
  std::atomic<int64_t> issued_ns{0}, started_ns{0}, ended_ns{0};
  std::atomic<int64_t> stamp{-8};  // ticket * 8 + State (-8: ticket -1, none)
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
    size_ = static_cast<size_t>(entries > 0 ? entries : 0);
    if (size_ > 0) ring_ = std::make_unique<Slot[]>(size_);
  }

  bool on() const { return size_ > 0; }

  int64_t issued(const CollectiveInfo& info, int64_t now_ns) {
    if (!on()) return -1;
    const std::vector<int>* ranks = keep(info.ranks);  // may lock: outside the slot's window
    const int64_t ticket = next_.fetch_add(1, std::memory_order_relaxed);
    Slot& e = ring_[static_cast<size_t>(ticket) % size_];
    constexpr auto kRelaxed = std::memory_order_relaxed;
    int64_t held = e.ticket.load(kRelaxed);
    do {
      // Being written (an issuer the ring lapped while it was preempted), or already taken by
      // a later collective: this one goes unrecorded rather than mixed with another.
      if (held == -2 || held >= ticket) return -1;
    } while (!e.ticket.compare_exchange_weak(held, -2, kRelaxed));
    std::atomic_thread_fence(std::memory_order_release);
    e.comm_id.store(info.comm_id, kRelaxed);
    e.seq.store(info.seq, kRelaxed);
    e.op.store(info.op.data(), kRelaxed);
    e.dtype.store(static_cast<int>(info.dtype), kRelaxed);
    e.numel.store(info.numel, kRelaxed);
    e.backend.store(info.backend.data(), kRelaxed);
    e.ranks.store(ranks, kRelaxed);
    e.issued_ns.store(now_ns, kRelaxed);
    e.started_ns.store(0, kRelaxed);
    e.ended_ns.store(0, kRelaxed);
    e.stamp.store(stamp_of(ticket, State::kIssued), kRelaxed);
    e.ticket.store(ticket, std::memory_order_release);
    return ticket;
  }

  void update(int64_t ticket, State state, int64_t now_ns) {
    if (ticket < 0 || !on()) return;
    Slot& e = ring_[static_cast<size_t>(ticket) % size_];
    // Overwritten: the ring has moved on. (A slot retaken between this check and the time's
    // store, 2048 collectives later, would show one wrong time in a dump; its state, which
    // carries the ticket, stays the newer entry's.)
    int64_t stamp = e.stamp.load(std::memory_order_acquire);
    if (stamp / 8 != ticket || e.ticket.load(std::memory_order_acquire) != ticket) return;
    (state == State::kStarted ? e.started_ns : e.ended_ns).store(now_ns, std::memory_order_relaxed);
    while (stamp / 8 == ticket &&
           !e.stamp.compare_exchange_weak(stamp, stamp_of(ticket, state), std::memory_order_release,
                                          std::memory_order_acquire)) {
    }
  }

  std::string json(const std::string& reason, int rank) {
    // Steady nanoseconds to wall-clock microseconds, at the offset of the moment of the dump.
    const int64_t offset_us = wall_us() - steady_ns() / 1000;
    auto wall = [&](int64_t ns) { return ns == 0 ? int64_t{0} : ns / 1000 + offset_us; };
    std::ostringstream os;
    os << "{\"rank\":" << rank << ",\"pid\":" << ::getpid() << ",\"reason\":" << json::quote(reason)
       << ",\"dumped_us\":" << wall_us() << ",\"capacity\":" << size_ << ",\"entries\":[";
    const int64_t next = next_.load(std::memory_order_acquire);
    const int64_t first = std::max<int64_t>(0, next - static_cast<int64_t>(size_));
    bool any = false;
    for (int64_t t = first; t < next; ++t) {
      const Slot& e = ring_[static_cast<size_t>(t) % size_];
      constexpr auto kRelaxed = std::memory_order_relaxed;
      if (e.ticket.load(std::memory_order_acquire) != t) continue;
      const int64_t stamp = e.stamp.load(std::memory_order_acquire);
      const int64_t comm_id = e.comm_id.load(kRelaxed), seq = e.seq.load(kRelaxed);
      const char* op = e.op.load(kRelaxed);
      const auto dtype = static_cast<c10::ScalarType>(e.dtype.load(kRelaxed));
      const int64_t numel = e.numel.load(kRelaxed);
      const char* backend = e.backend.load(kRelaxed);
      const std::vector<int>* ranks = e.ranks.load(kRelaxed);
      const int64_t issued = e.issued_ns.load(kRelaxed), started = e.started_ns.load(kRelaxed),
                    ended = e.ended_ns.load(kRelaxed);
      std::atomic_thread_fence(std::memory_order_acquire);
      if (e.ticket.load(kRelaxed) != t || stamp / 8 != t) continue;  // rewritten while read
      const auto state = static_cast<State>(stamp % 8);
      os << (any ? "," : "") << "\n{\"comm\":" << comm_id << ",\"seq\":" << seq << ",\"op\":\""
         << op << "\",\"dtype\":\"" << dtype_name(dtype) << "\",\"numel\":" << numel
         << ",\"backend\":\"" << backend << "\",\"ranks\":[";
      any = true;
      if (ranks) {
        for (size_t i = 0; i < ranks->size(); ++i) os << (i ? "," : "") << (*ranks)[i];
      }
      os << "],\"issued_us\":" << wall(issued) << ",\"started_us\":" << wall(started)
         << ",\"ended_us\":" << wall(ended) << ",\"state\":\"" << name_of(state) << "\"}";
    }
    os << "]}\n";
    return os.str();
  }

 private:
  // The member list a slot points to, kept for the process's life (a communicator's
  // collectives share one, so this holds one per communicator). Each issuing thread remembers
  // the last few it kept (HYBRID_SHARD's thread alternates two communicators), so issuing
  // takes the lock only for a communicator's first collectives.
  const std::vector<int>* keep(const std::shared_ptr<const std::vector<int>>& ranks) {
    if (!ranks) return nullptr;
    constexpr size_t kRemembered = 8;
    thread_local const std::vector<int>* kept[kRemembered] = {};
    thread_local size_t next = 0;
    for (const std::vector<int>* k : kept) {
      if (k == ranks.get()) return k;
    }
    {
      std::lock_guard<std::mutex> lock(keep_mu_);
      keep_.insert(ranks);
    }
    kept[next++ % kRemembered] = ranks.get();
    return ranks.get();
  }

  size_t size_ = 0;
  std::unique_ptr<Slot[]> ring_;
  std::atomic<int64_t> next_{0};
  std::mutex keep_mu_;
  std::set<std::shared_ptr<const std::vector<int>>> keep_;
};

Recorder& recorder() {
  static Recorder* r = new Recorder();  // never destroyed: a dump may come at exit
  return *r;
}

// Never destroyed either: the dump thread may read them while exit runs static destructors
// (ASan saw a SIGTERM's dump read a destroyed g_dir under mpirun).
std::mutex& g_dir_mu = *new std::mutex();
std::string& g_dir = *new std::string();
int g_rank = 0;

int g_pipe[2] = {-1, -1};
int g_done[2] = {-1, -1};  // the dumping thread's reply to a crashing one
// Marks a signal in the pipe that another handler took (dump_on_signal): dump, then go on.
constexpr unsigned char kGoesOn = 0x80;

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

int64_t issued(const CollectiveInfo& info, int64_t now_ns) {
  return recorder().issued(info, now_ns);
}
int64_t issued(const CollectiveInfo& info) { return issued(info, steady_ns()); }
void started(int64_t ticket, int64_t now_ns) { recorder().update(ticket, State::kStarted, now_ns); }
void started(int64_t ticket) { started(ticket, steady_ns()); }
void ended(int64_t ticket, State state, int64_t now_ns) {
  recorder().update(ticket, state, now_ns);
}
void ended(int64_t ticket, State state) { ended(ticket, state, steady_ns()); }

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

void dump_on_signal(int sig) {
  if (g_pipe[1] < 0) return;
  const int saved = errno;
  const unsigned char s = static_cast<unsigned char>(sig | kGoesOn);
  [[maybe_unused]] ssize_t n = ::write(g_pipe[1], &s, 1);
  errno = saved;
}

void install_signal_dumps() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (::pipe2(g_pipe, O_CLOEXEC) != 0 || ::pipe2(g_done, O_CLOEXEC) != 0) return;
    std::thread([] {
      unsigned char sig = 0;
      while (::read(g_pipe[0], &sig, 1) == 1 || errno == EINTR) {
        if (sig == 0) continue;
        if (sig & kGoesOn) {  // another handler's signal (dump_on_signal): the rank goes on
          const int s = sig & ~kGoesOn;
          dump(std::string(s == SIGTERM   ? "SIGTERM"
                           : s == SIGUSR1 ? "SIGUSR1"
                                          : "SIGINT") +
               " (the run saves a checkpoint and stops)");
          sig = 0;
          continue;
        }
        dump(sig == SIGTERM   ? "SIGTERM"
             : sig == SIGABRT ? "SIGABRT (the process aborted)"
                              : "SIGUSR2 (on demand)");
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
    ::sigaction(SIGUSR2, &sa, nullptr);
    ::sigaction(SIGTERM, &sa, nullptr);
    ::sigaction(SIGABRT, &sa, nullptr);
  });
}

}  // namespace dtrain::comm::flight
