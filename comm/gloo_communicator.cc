#include "comm/gloo_communicator.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <algorithm>
#include <cstdlib>
#include <vector>

#include "comm/staging.h"
#include "comm/worker.h"
#include "core/error.h"

namespace dtrain::comm {
namespace {

// Gloo reports its own timeout shortly after dtrain's, which names the collective.
constexpr std::chrono::milliseconds kGlooSlack{5000};

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kMax:
      return c10d::ReduceOp::MAX;
    case ReduceOp::kMin:
      return c10d::ReduceOp::MIN;
    default:
      return c10d::ReduceOp::SUM;  // AVG: SUM, then divide
  }
}

c10::intrusive_ptr<c10d::ProcessGroupGloo> make_pg(const c10::intrusive_ptr<c10d::Store>& store,
                                                   int rank, int size, const std::string& hostname,
                                                   std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout + kGlooSlack);
  if (!hostname.empty()) {
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(hostname));
  } else if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME")) {
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
  } else {
    options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  }
  options->threads = 2;
  try {
    return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
  } catch (const std::exception& e) {
    DTRAIN_FAIL(CommError, "gloo: rank ", rank, " of ", size,
                " could not connect to its peers: ", ::dtrain::detail::clause(e.what()),
                ". Check MASTER_ADDR/MASTER_PORT and that every rank started.");
  }
}

// out = op(a, b) with dtrain's rounding for 16-bit floats: add in fp32, round once per
// pairwise step.
void combine(const at::Tensor& a, const at::Tensor& b, ReduceOp op, at::Tensor& out) {
  switch (op) {
    case ReduceOp::kMax:
      at::maximum_out(out, a, b);
      break;
    case ReduceOp::kMin:
      at::minimum_out(out, a, b);
      break;
    default:
      if (a.scalar_type() == at::kHalf || a.scalar_type() == at::kBFloat16) {
        out.copy_(a.to(at::kFloat).add_(b.to(at::kFloat)));
      } else {
        at::add_out(out, a, b);
      }
  }
}

// The elements per block c10d's Gloo all-reduce sums in one rank's order (gloo's ring:
// segments of at most 1 MiB, at least two per rank, P = segments / ranks per block):
// block b = [b*B, (b+1)*B) of the buffer, cut at its end.
int64_t gloo_block(int64_t numel, int64_t element_size, int size) {
  const int64_t max_segment = std::max<int64_t>(1, (int64_t{1} << 20) / element_size);
  int64_t segments = std::max<int64_t>((numel + max_segment - 1) / max_segment, 2 * size);
  segments = (segments + size - 1) / size * size;
  return segments / size * ((numel + segments - 1) / segments);
}

// Reduce-scatter as a ring of point-to-point steps. c10d's Gloo builds reduce_scatter from a
// full all-reduce plus a slice, which moves twice the bytes; the ring moves (N-1)/N of the
// input, as NCCL's does. It adds as c10d's Gloo does, so sums round alike (FSDP's parity with
// fully_shard over Gloo, at any world size): the buffer is cut into gloo's blocks
// (gloo_block), and block b becomes x_b + (x_{b+1} + (... + (x_{b+N-2} + x_{b+N-1}))). At
// step k rank r sends its partial sum of block r+1+k to r-1 and receives r+1's partial sum
// of block r+2+k, to which it adds its own on the left; after N-1 steps block r is complete
// on rank r. Blocks are usually the output chunks themselves; where gloo's rounding makes
// them longer, each rank then sends the neighbours the parts of its block their chunks hold.
// The input is left as it was.
void ring_reduce_scatter(c10d::ProcessGroupGloo& pg, int size, int rank, const at::Tensor& in,
                         at::Tensor& out, ReduceOp op, int64_t seq) {
  const int64_t n = out.numel(), total = in.numel();
  if (size == 1) {
    out.copy_(in);
    return;
  }
  const int64_t block = std::max<int64_t>(gloo_block(total, in.element_size(), size), 1);
  const bool aligned = block == n;
  auto begin_of = [&](int64_t b) { return std::min(b * block, total); };
  auto block_of = [&](int64_t i) {
    const int64_t b = (i % size + size) % size;
    return in.narrow(0, begin_of(b), begin_of(b + 1) - begin_of(b));
  };
  const int next = (rank + 1) % size, prev = (rank + size - 1) % size;
  at::Tensor incoming = at::empty({block}, in.options());
  at::Tensor owned = aligned ? out : at::empty({block}, in.options());
  at::Tensor sending = block_of(rank + 1);  // step 0: this rank's own values
  at::Tensor partial[2] = {at::empty({block}, in.options()), at::empty({block}, in.options())};
  for (int k = 0; k + 1 < size; ++k) {
    // Tags only need to tell this op's steps apart: ops run one at a time on the worker.
    const int tag = static_cast<int>((seq % (1 << 20)) * 64 + k);
    const at::Tensor mine = block_of(rank + 2 + k);
    const int64_t len = mine.numel();  // the block received, and the one sent next
    at::Tensor got_values = incoming.narrow(0, 0, len);
    c10::intrusive_ptr<c10d::Work> sent, got;
    if (sending.numel() > 0) {
      std::vector<at::Tensor> send{sending};
      sent = pg.send(send, prev, tag);
    }
    if (len > 0) {
      std::vector<at::Tensor> recv{got_values};
      got = pg.recv(recv, next, tag);
    }
    if (got) got->wait();
    if (sent) sent->wait();
    at::Tensor sum = (k + 2 == size ? owned : partial[k % 2]).narrow(0, 0, len);
    if (len > 0) combine(mine, got_values, op, sum);
    sending = sum;
  }
  if (aligned) return;
  // Block r holds elements [begin_of(r), begin_of(r + 1)); chunk c is [c*n, (c+1)*n).
  const int tag = static_cast<int>((seq % (1 << 20)) * 64 + 63);
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::vector<std::vector<at::Tensor>> keep;
  for (int peer = 0; peer < size; ++peer) {
    // Mine that its chunk holds, and its that my chunk holds.
    const int64_t send_lo = std::max(begin_of(rank), peer * n);
    const int64_t send_hi = std::min(begin_of(rank + 1), (peer + 1) * n);
    const int64_t recv_lo = std::max(begin_of(peer), rank * n);
    const int64_t recv_hi = std::min(begin_of(peer + 1), (rank + 1) * n);
    if (peer == rank) {
      if (send_hi > send_lo) {
        out.narrow(0, send_lo - rank * n, send_hi - send_lo)
            .copy_(owned.narrow(0, send_lo - begin_of(rank), send_hi - send_lo));
      }
      continue;
    }
    if (send_hi > send_lo) {
      keep.push_back({owned.narrow(0, send_lo - begin_of(rank), send_hi - send_lo)});
      works.push_back(pg.send(keep.back(), peer, tag));
    }
    if (recv_hi > recv_lo) {
      keep.push_back({out.narrow(0, recv_lo - rank * n, recv_hi - recv_lo)});
      works.push_back(pg.recv(keep.back(), peer, tag));
    }
  }
  for (auto& w : works) w->wait();
}

// All-gather as a ring of point-to-point steps, received straight into the output: at step k
// rank r forwards chunk r-k to r+1 and receives chunk r-1-k from r-1.
void ring_all_gather(c10d::ProcessGroupGloo& pg, int size, int rank, const at::Tensor& in,
                     at::Tensor& out, int64_t seq) {
  const int64_t n = in.numel();
  auto chunk = [&](int64_t i) { return out.narrow(0, ((i % size + size) % size) * n, n); };
  chunk(rank).copy_(in);
  const int next = (rank + 1) % size, prev = (rank + size - 1) % size;
  for (int k = 0; k + 1 < size; ++k) {
    const int tag = static_cast<int>((seq % (1 << 20)) * 64 + k);
    std::vector<at::Tensor> send{chunk(rank - k)};
    std::vector<at::Tensor> recv{chunk(rank - 1 - k)};
    auto sent = pg.send(send, next, tag);
    auto got = pg.recv(recv, prev, tag);
    got->wait();
    sent->wait();
  }
}

class GlooCommunicator : public Communicator {
 public:
  GlooCommunicator(c10::intrusive_ptr<c10d::Store> root_store, std::string prefix, int rank,
                   int size, std::vector<int> world_ranks, std::string hostname,
                   std::chrono::milliseconds timeout)
      : Communicator(rank, size, std::move(world_ranks), timeout),
        root_store_(std::move(root_store)),
        prefix_(std::move(prefix)),
        hostname_(std::move(hostname)),
        pg_(make_pg(c10::make_intrusive<c10d::PrefixStore>(prefix_, root_store_), rank, size,
                    hostname_, timeout)) {}

  ~GlooCommunicator() override {
    // Pending collectives reference pg_ (co-owned by the tasks); a stuck one ends at Gloo's
    // own timeout, so a short grace suffices.
    worker_.shutdown(is_broken() ? std::chrono::milliseconds(100) : timeout() + kGlooSlack);
  }

  std::string backend() const override { return "gloo"; }

 protected:
  void enqueue(Collective c) override {
    worker_.post([pg = pg_, size = size(), rank = rank(), c = std::move(c)]() mutable {
      // Failed already: the communicator broke while this waited in the queue. Issuing it
      // now would pair it with a different collective on the ranks still in step.
      if (c.state->is_completed()) return;
      c.state->mark_started();
      try {
        run(*pg, size, rank, c);
        c.release_tensors();  // before the waiter wakes (see Collective)
        c.state->finish();
      } catch (const dtrain::Error&) {
        c.state->fail(std::current_exception());
      } catch (const std::exception& e) {
        c.state->fail(backend_failure(c.state->info(), "gloo", e.what()));
      }
    });
  }

  std::shared_ptr<Communicator> split_impl(int color, int /*key*/, const std::vector<int>& members,
                                           int new_rank, int64_t split_id) override {
    if (members.empty()) return nullptr;
    std::string prefix =
        prefix_ + "/split" + std::to_string(split_id) + "/color" + std::to_string(color);
    return std::make_shared<GlooCommunicator>(root_store_, prefix, new_rank,
                                              static_cast<int>(members.size()),
                                              to_world_ranks(members), hostname_, timeout());
  }

 private:
  static void run(c10d::ProcessGroupGloo& pg, int size, int rank, const Collective& c) {
    switch (c.kind) {
      case OpKind::kAllReduce: {
        std::vector<at::Tensor> v{to_host_flat(c.input)};
        c10d::AllreduceOptions o;
        o.reduceOp = to_c10d(c.op);
        pg.allreduce(v, o)->wait();
        if (c.op == ReduceOp::kAvg) v[0].div_(size);
        copy_back(c.input, v[0]);
        break;
      }
      case OpKind::kBroadcast: {
        std::vector<at::Tensor> v{to_host_flat(c.input)};
        c10d::BroadcastOptions o;
        o.rootRank = c.root;
        pg.broadcast(v, o)->wait();
        copy_back(c.input, v[0]);
        break;
      }
      case OpKind::kReduceScatter: {
        at::Tensor in = to_host_flat(c.input);
        at::Tensor out = host_flat_like(c.output);
        ring_reduce_scatter(pg, size, rank, in, out, c.op, c.state->info().seq);
        if (c.op == ReduceOp::kAvg) out.div_(size);
        copy_back(c.output, out);
        break;
      }
      case OpKind::kAllGather: {
        at::Tensor in = to_host_flat(c.input);
        at::Tensor out = host_flat_like(c.output);
        ring_all_gather(pg, size, rank, in, out, c.state->info().seq);
        copy_back(c.output, out);
        break;
      }
      case OpKind::kBarrier:
        pg.barrier()->wait();
        break;
      case OpKind::kP2P: {
        // Tags above the ring collectives' (below 2^26), which share these pairs.
        constexpr int kP2PTags = 1 << 27;
        auto post = [&pg](bool send, const at::Tensor& bytes, int peer, int tag) -> P2PWait {
          std::vector<at::Tensor> v{bytes};
          auto w = send ? pg.send(v, peer, kP2PTags + tag) : pg.recv(v, peer, kP2PTags + tag);
          // No poll: Gloo's send and receive works complete inside wait().
          return P2PWait{nullptr, [w, v]() { w->wait(); }};
        };
        run_p2p(post, c);
        break;
      }
    }
  }

  c10::intrusive_ptr<c10d::Store> root_store_;
  std::string prefix_;
  std::string hostname_;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg_;
  OrderedWorker worker_;
};

}  // namespace

std::shared_ptr<Communicator> make_gloo_world(const GlooSetup& setup) {
  DTRAIN_CHECK_AS(CommError, setup.store, "gloo backend needs a store (the rendezvous' TCPStore)");
  return std::make_shared<GlooCommunicator>(setup.store, "dtrain/gloo", setup.rank, setup.size,
                                            std::vector<int>{}, setup.hostname, setup.timeout);
}

}  // namespace dtrain::comm
