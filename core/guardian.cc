#include "core/guardian.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "core/error.h"

namespace dtrain {
namespace {

using Clock = std::chrono::steady_clock;

[[noreturn]] void serve(int fd, double grace_period_s) {
  ::setsid();
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGPIPE, SIGQUIT}) ::signal(sig, SIG_IGN);
  int devnull = ::open("/dev/null", O_RDWR);
  if (devnull >= 0) {
    for (int std_fd : {0, 1, 2}) ::dup2(devnull, std_fd);
  }
  // Nothing else of the owner's stays open here (its pipes would not see EOF otherwise).
  for (int other = 3; other < 1024; ++other) {
    if (other != fd && other != devnull) ::close(other);
  }
  std::vector<pid_t> groups;
  bool goodbye = false;
  int32_t v = 0;
  while (true) {
    ssize_t n = ::read(fd, &v, sizeof(v));
    if (n < 0 && errno == EINTR) continue;
    if (n != static_cast<ssize_t>(sizeof(v))) break;  // EOF: the owner is gone
    if (v == 0) {
      goodbye = true;
    } else if (v > 0) {
      groups.push_back(v);
    } else {
      groups.erase(std::remove(groups.begin(), groups.end(), -v), groups.end());
    }
  }
  if (!goodbye && !groups.empty()) {
    for (pid_t g : groups) {
      ::kill(-g, SIGTERM);
      ::kill(-g, SIGCONT);  // a stopped process holds SIGTERM pending
    }
    auto deadline =
        Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(grace_period_s * 1000));
    auto any_left = [&] {
      for (pid_t g : groups) {
        if (::kill(-g, 0) == 0) return true;
      }
      return false;
    };
    while (any_left() && Clock::now() < deadline) ::usleep(20000);
    for (pid_t g : groups) ::kill(-g, SIGKILL);
  }
  ::_exit(0);
}

}  // namespace

Guardian::~Guardian() {
  // Without stop(): the owner is ending abnormally (an exception through main, exit()):
  // closing the pipe lets the guardian end what is registered.
  if (fd_ >= 0) ::close(fd_);
}

void Guardian::start(double grace_period_s) {
  int p[2];
  DTRAIN_CHECK(::pipe2(p, O_CLOEXEC) == 0, "guardian: pipe() failed: ", std::strerror(errno));
  pid_t pid = ::fork();
  DTRAIN_CHECK(pid >= 0, "guardian: fork() failed: ", std::strerror(errno));
  if (pid == 0) {
    ::close(p[1]);
    serve(p[0], grace_period_s);
  }
  ::close(p[0]);
  pid_ = pid;
  fd_ = p[1];
}

void Guardian::stop() {
  if (fd_ < 0) return;
  send(0);
  ::close(fd_);
  fd_ = -1;
  ::waitpid(pid_, nullptr, 0);
}

void Guardian::send(int32_t v) {
  if (fd_ < 0) return;
  const char* p = reinterpret_cast<const char*>(&v);
  size_t off = 0;
  while (off < sizeof(v)) {
    ssize_t n = ::write(fd_, p + off, sizeof(v) - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // the guardian is gone: nothing to tell
    off += static_cast<size_t>(n);
  }
}

void guard_children_of_mpi_rank() {
  static bool done = false;
  if (done || std::getenv("OMPI_COMM_WORLD_RANK") == nullptr || std::getenv("DTRAIN_LAUNCHER") ||
      ::getpgrp() != ::getpid()) {
    return;
  }
  done = true;
  // Never stopped: it lives as long as the rank and ends the group's leftovers after it.
  static Guardian* guardian = new Guardian();
  guardian->start(/*grace_period_s=*/3.0);
  guardian->add(::getpid());
}

}  // namespace dtrain
