// Communicator: the one interface every dtrain rank talks through (docs/architecture.md).
//
// All collectives are asynchronous and return a Work; `Work::wait()` rethrows failures and
// never hangs past the communicator's timeout. Tensors are used in place: the caller keeps
// them alive and untouched until the Work completes. Every rank must issue the same
// collectives in the same order (as in MPI and c10d); each is numbered (`seq`) so a timeout
// can say which one went missing.
//
// The base class validates arguments identically for every backend (contiguity, dtype,
// sizes, op) and numbers the collectives; backends implement `enqueue`.
//
// DTRAIN_COMM_CHECK=1 (set on every rank; like PyTorch's TORCH_DISTRIBUTED_DEBUG=DETAIL)
// verifies, before each collective, that every rank issues the same one: op, dtype, element
// counts, reduction and root, exchanged in a small all-gather of their own. A difference
// raises CommError on every rank, naming the collective and each rank that differs, and
// breaks the communicator; without the check such a mismatch is undefined behaviour of the
// backend (MPI may truncate or leave garbage, Gloo may abort the process, a same-size dtype
// or op mismatch goes unnoticed). The check waits for the collectives before it, so it
// removes overlap: a debugging tool, see docs/reliability.md. Unset, the check follows a
// process-wide default (set_default_call_check), which dtrain's trainer turns on through its
// setup and first steps, while the schedule settles, and off after; DTRAIN_COMM_CHECK=0 keeps
// it off.
//
// Supported: ops SUM, AVG, MAX, MIN (AVG only for floating dtypes); dtypes fp32, fp64,
// fp16, bf16, int32, int64, uint8. fp16/bf16 reductions add pairs in fp32 and round the
// result back once per pairwise step, on every backend.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/types.h"
#include "comm/work.h"

namespace dtrain::comm {

// The collective check's default where DTRAIN_COMM_CHECK is unset (off until set): every
// communicator of this process checks its collectives while it is on. Every rank must switch it
// at the same point of its sequence of collectives (the trainer: at a step boundary).
void set_default_call_check(bool on);
bool default_call_check();

class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // Members of this communicator as world ranks (identity for the world communicator).
  const std::vector<int>& world_ranks() const { return world_ranks_; }
  // "mpi", "gloo" or "nccl".
  virtual std::string backend() const = 0;
  // The device this communicator's collectives run on: the CPU, or this rank's GPU for NCCL.
  // Tensors a library creates for its own collectives (flags, counts, signatures) belong
  // here; NCCL refuses host tensors, MPI and Gloo stage CUDA tensors through the host.
  virtual c10::Device device() const { return c10::Device(c10::kCPU); }
  c10::DeviceType device_type() const { return device().type(); }

  // How long a wait() on this communicator's work may block before TimeoutError.
  std::chrono::milliseconds timeout() const { return timeout_; }

  // In place: every rank ends with op(tensor over ranks).
  Work all_reduce(const at::Tensor& tensor, ReduceOp op = ReduceOp::kSum);
  // input_flat holds size() equal shards; rank r receives op over ranks of shard r.
  Work reduce_scatter(const at::Tensor& input_flat, const at::Tensor& output_shard,
                      ReduceOp op = ReduceOp::kSum);
  // output_flat receives every rank's input_shard, in rank order.
  Work all_gather(const at::Tensor& input_shard, const at::Tensor& output_flat);
  // In place: every rank ends with root's tensor.
  Work broadcast(const at::Tensor& tensor, int root);

  // Point-to-point (pipeline parallelism; PyTorch's send/recv and batch_isend_irecv). `tensor`
  // goes to rank `peer` of this communicator (kSend), or is filled from it (kRecv). A send
  // and a receive pair up in the order each rank issues them for that peer and tag. Each
  // message carries its dtype and shape (MPI and Gloo), and a receive whose tensor
  // differs fails naming both ranks and what each had (the first message of a peer and tag
  // carries them alone, later ones up to 4 MiB with their bytes: run_p2p). Any dtype; 0-d
  // and empty tensors too.
  // They run in issue order with this communicator's collectives, and outside their
  // numbering (the collective check and the flight analyser's matching skip them): two ranks
  // that both send first to each other pair up only in a batch, which posts all its sends and
  // receives at once and completes when all have (no order within it can deadlock).
  struct P2POp {
    enum Kind { kSend, kRecv };
    Kind kind = kSend;
    at::Tensor tensor;
    int peer = 0;
    int tag = 0;          // in [0, kMaxTag]
    int world_peer = -1;  // set by batch_p2p: the peer's world rank, for messages
  };
  static constexpr int kMaxTag = (1 << 14) - 1;
  Work send(const at::Tensor& tensor, int dst, int tag = 0);
  Work recv(const at::Tensor& tensor, int src, int tag = 0);
  Work batch_p2p(std::vector<P2POp> ops);
  // Completes once every rank has called it.
  Work barrier();

  // Collective over this communicator, like MPI_Comm_split: ranks passing the same color
  // form a new communicator, ordered by (key, rank). A negative color opts out and returns
  // nullptr. Hybrid sharding uses it for intra-node and inter-node groups.
  std::shared_ptr<Communicator> split(int color, int key);

  // The node (host) of each world rank, numbered in order of first rank, as the rendezvous
  // learned it (comm/factory.h); empty for a communicator made otherwise. A split shares
  // its parent's.
  const std::vector<int>& world_nodes() const { return *world_nodes_; }
  void set_world_nodes(std::vector<int> nodes);
  // This communicator's ranks on this rank's node (its size when the layout is unknown).
  int local_size() const;

  // True after a collective timed out or failed: the ranks are out of step, so further
  // collectives fail at once instead of hanging.
  bool is_broken() const;
  // What broke it (the failed collective's message); empty while it is healthy.
  std::string broken_reason() const;

 protected:
  Communicator(int rank, int size, std::vector<int> world_ranks, std::chrono::milliseconds timeout);

  enum class OpKind { kAllReduce, kReduceScatter, kAllGather, kBroadcast, kBarrier, kP2P };

  // A communicator's point-to-point channels (peer, tag, direction): the header of the
  // first message each carried, which sizes the later ones (run_p2p).
  struct P2PChannels;

  // One validated collective. For kAllReduce / kBroadcast `input` is the in-place tensor.
  struct Collective {
    OpKind kind;
    at::Tensor input;
    at::Tensor output;
    ReduceOp op = ReduceOp::kSum;
    int root = 0;
    std::shared_ptr<detail::WorkState> state;
    std::vector<P2POp> p2p;  // kP2P: the batch, in issue order
    // kP2P: what each of the communicator's channels carried first (run_p2p).
    std::shared_ptr<P2PChannels> channels;

    // A synchronous backend drops its references before completing `state`: a caller whose
    // wait() has returned then holds the only ones, so the memory of a buffer it lets go is
    // freed (or pooled) at once, not whenever the worker thread gets to it. FSDP's peak
    // memory would otherwise depend on thread timing. (ProcessGroupGloo's threads drop a
    // finished work's tensors just after completing it, which dtrain cannot reach.)
    void release_tensors() {
      input = at::Tensor();
      output = at::Tensor();
      p2p.clear();
    }
  };

  // Runs `c` asynchronously and completes c.state (finish or fail). Called in issue order.
  virtual void enqueue(Collective c) = 0;

  // Creates the communicator for this rank's color group. `members` are ranks of this
  // communicator in new-rank order, `new_rank` this rank's index among them (-1 when not a
  // member); `split_id` is the same on every rank for this split.
  // Called on every rank, also those with color < 0 (members empty), since MPI and NCCL
  // splits are collective over the parent.
  virtual std::shared_ptr<Communicator> split_impl(int color, int key,
                                                   const std::vector<int>& members, int new_rank,
                                                   int64_t split_id) = 0;

  void mark_broken(const std::string& reason);

  // A point-to-point batch on a backend that moves bytes (MPI, Gloo). Each message's header
  // (dtype and shape) is checked against the receiving tensor. The first message of a channel
  // (peer, tag, direction) sends its header alone, then its bytes once the header is checked.
  // Where that first message had at most 4 MiB (a larger one's later messages go as it did),
  // every later one is a single transfer of a header and the first message's number of bytes:
  // its own bytes when its header is the first one's, else a notice followed by its bytes
  // (both sides changed shape: accepted; one side: refused). So a receive never gets more
  // bytes than it posted (Gloo would abort the process), and a pipeline's repeated messages
  // cost one transfer each, as PyTorch's after its shape inference. Runs on the backend's
  // worker; `post` posts a transfer of `bytes` (a 1-D uint8 host tensor, which the returned
  // wait keeps alive) with a transport tag in [0, 2 x kMaxTag + 1]. Throws CommError on a
  // header that differs; transfers still pending then keep their buffers for the rest of the
  // process (the communicator is broken).
  struct P2PWait {
    // Complete (or failed: wait() then throws), without blocking; empty where the transport
    // cannot tell (Gloo): run_p2p then waits for a lone receive itself, several on threads.
    std::function<bool()> done;
    std::function<void()> wait;
    explicit operator bool() const { return static_cast<bool>(wait); }
  };
  // Posts a send (send = true) or a receive of `bytes` with `peer` under `tag`.
  using P2PPost = std::function<P2PWait(bool send, const at::Tensor& bytes, int peer, int tag)>;
  static void run_p2p(const P2PPost& post, const Collective& c);
  // World ranks of `members` (ranks of this communicator).
  std::vector<int> to_world_ranks(const std::vector<int>& members) const;

 private:
  Work submit(OpKind kind, const char* name, const at::Tensor& input, const at::Tensor& output,
              ReduceOp op, int root);
  // DTRAIN_COMM_CHECK: throws CommError on every rank when the ranks' calls differ.
  void verify_same_call(OpKind kind, const CollectiveInfo& info, int64_t output_numel, ReduceOp op,
                        int root);

  int rank_;
  int size_;
  std::vector<int> world_ranks_;
  std::chrono::milliseconds timeout_;
  int64_t id_ = 0;  // this process's communicators, numbered in creation order
  int64_t next_seq_ = 1;
  int64_t next_p2p_ = 1;  // point-to-point ops, numbered apart from the collectives
  std::shared_ptr<P2PChannels> p2p_channels_;  // used by the worker only, batch after batch
  int64_t next_split_ = 1;
  std::atomic<const char*> backend_name_{nullptr};  // interned backend(), set at first use
  int check_mode_ = -1;    // DTRAIN_COMM_CHECK: 1 always, 0 never, -1 (unset) the default
  bool checking_ = false;  // inside verify_same_call: its own all-gather is not checked
  // Shared with pending Works, whose timeout marks it even if this communicator is gone.
  // Marking it fails every op still pending, so a rank that hit one timeout (or error) does
  // not wait a full timeout again per queued bucket: it can report and exit at once.
  struct Health {
    std::atomic<bool> broken{false};
    std::mutex mu;
    std::string reason;
    // In issue order; ops complete in order, so finished ones are dropped from the front.
    // Weak: each state holds on_break, which holds this Health, so an owning list would be
    // a cycle that outlives the communicator.
    std::deque<std::weak_ptr<detail::WorkState>> pending;
    void mark(const std::string& why);
    void track(const std::shared_ptr<detail::WorkState>& state);
  };
  std::shared_ptr<Health> health_ = std::make_shared<Health>();
  std::shared_ptr<const std::vector<int>> shared_ranks_;  // world_ranks_, for CollectiveInfo
  std::shared_ptr<const std::vector<int>> world_nodes_ = std::make_shared<std::vector<int>>();

 protected:
  // What a collective's late wait calls: marks this communicator broken. Set once at
  // construction (a backend may wrap it there); each collective shares it.
  std::shared_ptr<const detail::WorkState::BreakHandler> on_break_;
};

}  // namespace dtrain::comm
