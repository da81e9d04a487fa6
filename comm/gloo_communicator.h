// Gloo backend: LibTorch's c10d::ProcessGroupGloo over a c10d::Store (TCPStore from the
// rendezvous), so ranks started by dtrain-launch train on CPUs without mpirun.
//
// c10d's Gloo already runs collectives on its own threads; dtrain still issues them from
// one ordered worker so that AVG (which Gloo lacks: SUM, then divide) and host staging of
// CUDA tensors happen in order. Gloo sums fp16/bf16 pairwise in fp32 with one rounding per
// step, as the MPI backend does. Gloo's own timeout is set a little past dtrain's, so the
// caller's TimeoutError (naming the op) comes first and the worker is freed soon after.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <memory>
#include <string>

#include "comm/communicator.h"

namespace dtrain::comm {

struct GlooSetup {
  c10::intrusive_ptr<c10d::Store> store;
  int rank = 0;
  int size = 1;
  // Address to bind. "127.0.0.1" for single-node jobs; empty picks the host's default
  // interface (GLOO_SOCKET_IFNAME, else the hostname's address) for multi-node jobs.
  std::string hostname = "127.0.0.1";
  std::chrono::milliseconds timeout{300000};
};

std::shared_ptr<Communicator> make_gloo_world(const GlooSetup& setup);

}  // namespace dtrain::comm
