// The guardian: a small process that outlives the one that started it and ends what that
// process can no longer end.
//
// Killing a process does not kill its children. PR_SET_PDEATHSIG ends a rank with its
// launcher, but not the rank's own children (a data-loader helper, a shell it ran). The
// guardian holds the read end of a pipe whose only write end is its owner's, learns the
// process groups to look after through it, and when the pipe reports EOF without a goodbye
// (the owner died, even by SIGKILL) it sends SIGTERM and SIGCONT to every group still
// registered, then SIGKILL after the grace period. It runs in its own session, ignores the
// terminal's signals, and holds no file of its owner's but its pipe.
//
// dtrain-launch starts one for all its ranks (launcher/launcher.cc). A rank started by
// mpirun, which gives each rank its own process group but does not end the children of a
// rank that died, starts one for its own group (guard_children_of_mpi_rank).
#pragma once

#include <sys/types.h>

#include <cstdint>

namespace dtrain {

class Guardian {
 public:
  Guardian() = default;
  Guardian(const Guardian&) = delete;
  Guardian& operator=(const Guardian&) = delete;
  ~Guardian();

  // Forks the guardian. Throws dtrain::Error when the system refuses a pipe or a process.
  void start(double grace_period_s);
  void add(pid_t group) { send(group); }
  void remove(pid_t group) { send(-group); }
  // A normal end: the guardian exits without signalling anything, and is reaped.
  void stop();
  bool started() const { return fd_ >= 0; }

 private:
  void send(int32_t v);

  pid_t pid_ = -1;
  int fd_ = -1;
};

// Under mpirun (OMPI_COMM_WORLD_RANK set) in a process that leads its own process group, as
// OpenMPI's ranks do: starts a guardian for that group, once per process, so that the
// children of a rank that dies do not outlive it. Does nothing elsewhere: a process run from
// a shell shares its group with the rest of its pipeline, and dtrain-launch guards its ranks
// itself.
void guard_children_of_mpi_rank();

}  // namespace dtrain
