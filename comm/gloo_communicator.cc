#include "comm/gloo_communicator.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <cstdlib>

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
                " could not connect to its peers: ", e.what(),
                ". Check MASTER_ADDR/MASTER_PORT and that every rank started.");
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
    worker_.post([pg = pg_, size = size(), c = std::move(c)] {
      // Failed already: the communicator broke while this waited in the queue. Issuing it
      // now would pair it with a different collective on the ranks still in step.
      if (c.state->is_completed()) return;
      c.state->mark_started();
      try {
        run(*pg, size, c);
        c.state->finish();
      } catch (const dtrain::Error&) {
        c.state->fail(std::current_exception());
      } catch (const std::exception& e) {
        c.state->fail(std::make_exception_ptr(
            CommError(describe(c.state->info()) + " failed in gloo: " + e.what())));
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
  static void run(c10d::ProcessGroupGloo& pg, int size, const Collective& c) {
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
        c10d::ReduceScatterOptions o;
        o.reduceOp = to_c10d(c.op);
        pg._reduce_scatter_base(out, in, o)->wait();
        if (c.op == ReduceOp::kAvg) out.div_(size);
        copy_back(c.output, out);
        break;
      }
      case OpKind::kAllGather: {
        at::Tensor in = to_host_flat(c.input);
        at::Tensor out = host_flat_like(c.output);
        pg._allgather_base(out, in)->wait();
        copy_back(c.output, out);
        break;
      }
      case OpKind::kBarrier:
        pg.barrier()->wait();
        break;
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
