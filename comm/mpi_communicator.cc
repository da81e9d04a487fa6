#include "comm/mpi_communicator.h"

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>

#include "comm/half_sum.h"
#include "comm/mpi_raw.h"
#include "comm/staging.h"
#include "comm/worker.h"
#include "core/env.h"
#include "core/error.h"

namespace dtrain::comm {
namespace {

std::string mpi_error_string(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, buf, &len);
  return std::string(buf, len);
}

#define DTRAIN_MPI(call)                                            \
  do {                                                              \
    int dtrain_mpi_rc = (call);                                     \
    DTRAIN_CHECK_AS(CommError, dtrain_mpi_rc == MPI_SUCCESS, #call, \
                    " failed: ", mpi_error_string(dtrain_mpi_rc));  \
  } while (0)

struct Max {
  float operator()(float a, float b) const { return a > b ? a : b; }
};
struct Min {
  float operator()(float a, float b) const { return a < b ? a : b; }
};

// inout[i] = round(op(float(in[i]), float(inout[i]))): one rounding per pairwise step.
template <typename T, typename Op>
void combine(void* in, void* inout, int* len, MPI_Datatype* /*type*/) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  Op op;
  for (int i = 0; i < *len; ++i) b[i] = T(op(static_cast<float>(a[i]), static_cast<float>(b[i])));
}

// SUM of 16-bit floats: T(float(in[i]) + float(inout[i])), as combine does MAX and MIN,
// vectorized (comm/half_sum.h).
template <c10::ScalarType kType>
void vector_sum(void* in, void* inout, int* len, MPI_Datatype* /*type*/) {
  sum_into(static_cast<const uint16_t*>(in), static_cast<uint16_t*>(inout), *len, kType);
}

// inout[i] = in[i] + inout[i] modulo 2^bits. OpenMPI 4.1's AVX reduction component saturates
// 8- and 16-bit integer sums (255 + 1 = 255) with no error, where every other backend wraps;
// dtrain's own op gives the documented result on any MPI.
template <typename T>
void wrapping_sum(void* in, void* inout, int* len, MPI_Datatype* /*type*/) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = static_cast<T>(a[i] + b[i]);
}

// Everything that must be created and destroyed on the MPI thread.
class MpiRuntime {
 public:
  static MpiRuntime& get() {
    static MpiRuntime runtime;  // destroyed at exit: finalizes MPI on its own thread
    return runtime;
  }

  // The world's worker: MPI_Init_thread and MPI_Finalize run on it too.
  OrderedWorker& worker() { return worker_; }
  // Whether communicators made by split() may run on threads of their own: the MPI library
  // gave MPI_THREAD_MULTIPLE (else every communicator shares the world's worker).
  bool thread_multiple() const { return thread_multiple_; }

  MPI_Datatype datatype(c10::ScalarType t) const {
    switch (t) {
      case c10::kFloat:
        return MPI_FLOAT;
      case c10::kDouble:
        return MPI_DOUBLE;
      case c10::kHalf:
        return handles_.half;
      case c10::kBFloat16:
        return handles_.bf16;
      case c10::kInt:
        return MPI_INT32_T;
      case c10::kLong:
        return MPI_INT64_T;
      case c10::kByte:
        return MPI_UINT8_T;
      default:
        DTRAIN_FAIL(CommError, "mpi backend: unsupported dtype ", t);
    }
  }

  MPI_Op op(c10::ScalarType t, ReduceOp op) const {
    int i = op == ReduceOp::kMax ? 1 : op == ReduceOp::kMin ? 2 : 0;  // AVG is SUM then divide
    if (t == c10::kHalf) return handles_.half_ops[i];
    if (t == c10::kBFloat16) return handles_.bf16_ops[i];
    if (t == c10::kByte && i == 0) return handles_.u8_sum;
    return i == 1 ? MPI_MAX : i == 2 ? MPI_MIN : MPI_SUM;
  }

  // A collective timed out: its MPI call may never return, so wait for it only briefly at exit.
  void abandon() { abandoned_ = true; }

 private:
  MpiRuntime() {
    worker_.run_sync([this] { init(); });
  }

  ~MpiRuntime() {
    // After a timeout the worker may be blocked in a collective a peer never joined; then
    // MPI_Finalize cannot run and the launcher or mpirun ends the job. If a late peer freed
    // it, finalize as usual.
    // Values, not `this`: a detached worker may run this after the runtime is gone.
    worker_.post([h = handles_, owns = owns_mpi_]() mutable { finalize(h, owns); });
    worker_.shutdown(abandoned_ ? std::chrono::seconds(2) : std::chrono::seconds(60));
  }

  void init() {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (initialized) {
      int provided = 0;
      MPI_Query_thread(&provided);
      thread_multiple_ = provided == MPI_THREAD_MULTIPLE;
      DTRAIN_CHECK_AS(CommError, provided >= MPI_THREAD_SERIALIZED,
                      "MPI was initialized by the application with thread level ", provided,
                      "; dtrain's mpi backend calls MPI from its own worker thread and needs "
                      "MPI_THREAD_SERIALIZED or higher: use MPI_Init_thread(..., "
                      "MPI_THREAD_SERIALIZED, ...) or let dtrain initialize MPI");
    } else {
      int provided = 0;
      DTRAIN_MPI(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided));
      owns_mpi_ = true;
      thread_multiple_ = provided == MPI_THREAD_MULTIPLE;
      // FUNNELED is enough for one worker: it is the thread that initialized MPI.
      DTRAIN_CHECK_AS(CommError, provided >= MPI_THREAD_FUNNELED,
                      "MPI_Init_thread gave thread level ", provided,
                      "; dtrain's mpi backend calls MPI from a worker thread and needs at "
                      "least MPI_THREAD_FUNNELED");
    }
    Handles& h = handles_;
    DTRAIN_MPI(MPI_Type_contiguous(2, MPI_BYTE, &h.half));
    DTRAIN_MPI(MPI_Type_commit(&h.half));
    DTRAIN_MPI(MPI_Type_contiguous(2, MPI_BYTE, &h.bf16));
    DTRAIN_MPI(MPI_Type_commit(&h.bf16));
    DTRAIN_MPI(MPI_Op_create(&vector_sum<c10::kHalf>, 1, &h.half_ops[0]));
    DTRAIN_MPI(MPI_Op_create(&combine<c10::Half, Max>, 1, &h.half_ops[1]));
    DTRAIN_MPI(MPI_Op_create(&combine<c10::Half, Min>, 1, &h.half_ops[2]));
    DTRAIN_MPI(MPI_Op_create(&vector_sum<c10::kBFloat16>, 1, &h.bf16_ops[0]));
    DTRAIN_MPI(MPI_Op_create(&combine<c10::BFloat16, Max>, 1, &h.bf16_ops[1]));
    DTRAIN_MPI(MPI_Op_create(&combine<c10::BFloat16, Min>, 1, &h.bf16_ops[2]));
    DTRAIN_MPI(MPI_Op_create(&wrapping_sum<uint8_t>, 1, &h.u8_sum));
  }

  struct Handles {
    MPI_Datatype half = MPI_DATATYPE_NULL, bf16 = MPI_DATATYPE_NULL;
    MPI_Op half_ops[3] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};
    MPI_Op bf16_ops[3] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};
    MPI_Op u8_sum = MPI_OP_NULL;
  };

  static void finalize(Handles& h, bool owns_mpi) {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    for (int i = 0; i < 3; ++i) {
      MPI_Op_free(&h.half_ops[i]);
      MPI_Op_free(&h.bf16_ops[i]);
    }
    MPI_Op_free(&h.u8_sum);
    MPI_Type_free(&h.half);
    MPI_Type_free(&h.bf16);
    if (owns_mpi) MPI_Finalize();
  }

  OrderedWorker worker_;
  bool owns_mpi_ = false;
  bool thread_multiple_ = false;
  std::atomic<bool> abandoned_{false};
  Handles handles_;
};

constexpr int64_t kMaxCount = INT_MAX;

// All-reduces within one node larger than DTRAIN_MPI_CHUNK_KIB (default 28 MiB; 0: never) are
// issued in equal pieces no larger than it. OpenMPI's shared-memory all-reduce falls off a
// cliff once a message outgrows the caches: at 2 ranks here, fp32 in one call runs at 4.5
// GB/s up to 24 MiB and at 2.3 GB/s from 32 MiB; 64 MiB takes 29.3 ms in one call and
// 13.9 ms in 16 MiB pieces. Smaller pieces would help an idle machine a little more but cost
// a DDP step whose compute fills every core: each piece is one more rendezvous of the ranks'
// comm threads (1 MiB pieces tripled the exposed all-reduce of the 19M-model step, 16 MiB
// ones made its 25 MB buckets' all-reduces 50% longer). DDP's default 25 MB buckets stay one
// call. Between nodes MPI's own pipelining is left alone.
int64_t chunk_bytes() {
  static const int64_t bytes =
      std::max<int64_t>(0, env_int(process_env(), "DTRAIN_MPI_CHUNK_KIB", 28 * 1024)) * 1024;
  return bytes;
}

// Whether every rank of `comm` shares this node (a collective over `comm`).
bool within_one_node(MPI_Comm comm) {
  MPI_Comm node = MPI_COMM_NULL;
  DTRAIN_MPI(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
  int node_size = 0, size = 0;
  MPI_Comm_size(node, &node_size);
  MPI_Comm_size(comm, &size);
  MPI_Comm_free(&node);
  return node_size == size;
}

class MpiCommunicator : public Communicator {
 public:
  // `own_worker`: run this communicator's collectives on a thread of its own, so they
  // progress independently of other communicators' (FSDP's all-gathers beside its
  // reduce-scatters); otherwise on the world's worker.
  MpiCommunicator(MPI_Comm comm, int rank, int size, std::vector<int> world_ranks,
                  std::chrono::milliseconds timeout, bool own_worker)
      : Communicator(rank, size, std::move(world_ranks), timeout),
        comm_(comm),
        own_worker_(own_worker ? std::make_unique<OrderedWorker>() : nullptr),
        worker_(own_worker ? own_worker_.get() : &MpiRuntime::get().worker()) {
    worker_->run_sync([&] { one_node_ = within_one_node(comm_); });
    // A late collective also abandons the runtime's finalize (a stuck MPI call never returns).
    on_break_ = std::make_shared<const detail::WorkState::BreakHandler>(
        [mark = on_break_, &runtime = MpiRuntime::get()](const std::string& why) {
          runtime.abandon();
          (*mark)(why);
        });
  }

  ~MpiCommunicator() override {
    if (is_broken()) {
      // The worker may be stuck in this communicator: leave it behind.
      if (own_worker_) own_worker_->shutdown(std::chrono::milliseconds(100));
      return;
    }
    MPI_Comm comm = comm_;
    try {
      worker_->post([comm]() mutable {
        int finalized = 0;
        MPI_Finalized(&finalized);
        if (!finalized) MPI_Comm_free(&comm);
      });
      if (own_worker_) own_worker_->shutdown(timeout() + std::chrono::seconds(5));
    } catch (const std::exception&) {
      // The runtime already shut down (destroyed at exit): MPI_Finalize freed it.
    }
  }

  std::string backend() const override { return "mpi"; }

 protected:
  void enqueue(Collective c) override {
    auto& runtime = MpiRuntime::get();
    // Capture values, not `this`: the task may outlive a communicator destroyed early.
    const int64_t chunk = one_node_ ? chunk_bytes() : 0;
    worker_->post([comm = comm_, size = size(), chunk, c = std::move(c), &runtime]() mutable {
      // Failed already: the communicator broke while this waited in the queue. Issuing it
      // now would pair it with a different collective on the ranks still in step.
      if (c.state->is_completed()) return;
      c.state->mark_started();
      try {
        run(runtime, comm, size, chunk, c);
        c.release_tensors();  // before the waiter wakes (see Collective)
        c.state->finish();
      } catch (...) {
        c.state->fail(std::current_exception());
      }
    });
  }

  std::shared_ptr<Communicator> split_impl(int color, int key, const std::vector<int>& members,
                                           int new_rank, int64_t /*split_id*/) override {
    MPI_Comm out = MPI_COMM_NULL;
    MPI_Comm parent = comm_;
    worker_->run_sync([&] {  // a collective on the parent, in order with its others
      DTRAIN_MPI(MPI_Comm_split(parent, color < 0 ? MPI_UNDEFINED : color, key, &out));
      if (out != MPI_COMM_NULL) DTRAIN_MPI(MPI_Comm_set_errhandler(out, MPI_ERRORS_RETURN));
    });
    if (out == MPI_COMM_NULL) return nullptr;
    return std::make_shared<MpiCommunicator>(out, new_rank, static_cast<int>(members.size()),
                                             to_world_ranks(members), timeout(),
                                             MpiRuntime::get().thread_multiple());
  }

 private:
  // A CPU tensor goes to MPI as it is (submit() checked it is contiguous): no view is made
  // per call, which costs as much as a small collective. A CUDA tensor is staged on the host.
  static at::Tensor host_input(const at::Tensor& t) { return t.is_cpu() ? t : to_host_flat(t); }
  static at::Tensor host_output(const at::Tensor& t) { return t.is_cpu() ? t : host_flat_like(t); }

  // chunk: the largest all-reduce issued as one call, in bytes (0: no limit but MPI's int
  // count); larger ones go in equal pieces.
  static void run(const MpiRuntime& rt, MPI_Comm comm, int size, int64_t chunk,
                  const Collective& c) {
    if (c.kind == OpKind::kBarrier) {
      DTRAIN_MPI(MPI_Barrier(comm));
      return;
    }
    if (c.kind == OpKind::kP2P) {
      // Bytes, in pieces of MPI's int count; the pieces of one message share its tag, and MPI
      // matches messages between two ranks under one tag in order.
      auto post = [comm](bool send, const at::Tensor& bytes, int peer, int tag) -> P2PWait {
        auto requests = std::make_shared<std::vector<MPI_Request>>();
        char* p = static_cast<char*>(bytes.data_ptr());
        for (int64_t off = 0; off < bytes.numel(); off += kMaxCount) {
          const int n = static_cast<int>(std::min(kMaxCount, bytes.numel() - off));
          requests->emplace_back();
          if (send) {
            DTRAIN_MPI(MPI_Isend(p + off, n, MPI_BYTE, peer, tag, comm, &requests->back()));
          } else {
            DTRAIN_MPI(MPI_Irecv(p + off, n, MPI_BYTE, peer, tag, comm, &requests->back()));
          }
        }
        auto done = [requests]() {
          int flag = 0;
          DTRAIN_MPI(MPI_Testall(static_cast<int>(requests->size()), requests->data(), &flag,
                                 MPI_STATUSES_IGNORE));
          return flag != 0;
        };
        auto wait = [requests, bytes]() {
          DTRAIN_MPI(MPI_Waitall(static_cast<int>(requests->size()), requests->data(),
                                 MPI_STATUSES_IGNORE));
        };
        return P2PWait{done, wait};
      };
      run_p2p(post, c);
      return;
    }
    const auto dtype = c.input.scalar_type();
    const MPI_Datatype dt = rt.datatype(dtype);
    const int64_t elem = c.input.element_size();
    switch (c.kind) {
      case OpKind::kAllReduce: {
        at::Tensor host = host_input(c.input);
        char* p = static_cast<char*>(host.data_ptr());
        int64_t piece = kMaxCount;
        if (chunk > 0 && host.numel() * elem > chunk) {
          const int64_t pieces = (host.numel() * elem + chunk - 1) / chunk;
          piece = std::min(kMaxCount, (host.numel() + pieces - 1) / pieces);
        }
        for (int64_t off = 0; off < host.numel(); off += piece) {
          int n = static_cast<int>(std::min(piece, host.numel() - off));
          DTRAIN_MPI(MPI_Allreduce(MPI_IN_PLACE, p + off * elem, n, dt, rt.op(dtype, c.op), comm));
        }
        if (c.op == ReduceOp::kAvg) host.div_(size);
        copy_back(c.input, host);
        break;
      }
      case OpKind::kBroadcast: {
        at::Tensor host = host_input(c.input);
        char* p = static_cast<char*>(host.data_ptr());
        for (int64_t off = 0; off < host.numel(); off += kMaxCount) {
          int n = static_cast<int>(std::min(kMaxCount, host.numel() - off));
          DTRAIN_MPI(MPI_Bcast(p + off * elem, n, dt, c.root, comm));
        }
        copy_back(c.input, host);
        break;
      }
      case OpKind::kReduceScatter: {
        DTRAIN_CHECK_AS(CommError, c.output.numel() <= kMaxCount, "mpi reduce_scatter: a shard of ",
                        c.output.numel(),
                        " elements exceeds MPI's int count; use more ranks or smaller units");
        at::Tensor in = host_input(c.input);
        at::Tensor out = host_output(c.output);
        DTRAIN_MPI(MPI_Reduce_scatter_block(in.data_ptr(), out.data_ptr(),
                                            static_cast<int>(out.numel()), dt, rt.op(dtype, c.op),
                                            comm));
        if (c.op == ReduceOp::kAvg) out.div_(size);
        copy_back(c.output, out);
        break;
      }
      case OpKind::kAllGather: {
        DTRAIN_CHECK_AS(CommError, c.input.numel() <= kMaxCount, "mpi all_gather: a shard of ",
                        c.input.numel(),
                        " elements exceeds MPI's int count; use more ranks or smaller units");
        at::Tensor in = host_input(c.input);
        at::Tensor out = host_output(c.output);
        int n = static_cast<int>(in.numel());
        DTRAIN_MPI(MPI_Allgather(in.data_ptr(), n, dt, out.data_ptr(), n, dt, comm));
        copy_back(c.output, out);
        break;
      }
      case OpKind::kBarrier:
      case OpKind::kP2P:
        break;
    }
  }

  MPI_Comm comm_;
  bool one_node_ = false;  // every rank on this node: large all-reduces go in pieces
  std::unique_ptr<OrderedWorker> own_worker_;
  OrderedWorker* worker_;
};

}  // namespace

std::shared_ptr<Communicator> make_mpi_world(std::chrono::milliseconds timeout,
                                             const std::string& node_key) {
  auto& runtime = MpiRuntime::get();
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0, size = 0;
  std::vector<int64_t> hashes;
  runtime.worker().run_sync([&] {
    DTRAIN_MPI(MPI_Comm_dup(MPI_COMM_WORLD, &comm));
    DTRAIN_MPI(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN));
    DTRAIN_MPI(MPI_Comm_rank(comm, &rank));
    DTRAIN_MPI(MPI_Comm_size(comm, &size));
    if (!node_key.empty()) {
      // 63 bits of the node's name: equal names, equal numbers.
      long long mine = static_cast<long long>(std::hash<std::string>{}(node_key) >> 1);
      std::vector<long long> all(static_cast<size_t>(size));
      DTRAIN_MPI(MPI_Allgather(&mine, 1, MPI_LONG_LONG, all.data(), 1, MPI_LONG_LONG, comm));
      hashes.assign(all.begin(), all.end());
    }
  });
  auto world = std::make_shared<MpiCommunicator>(comm, rank, size, std::vector<int>{}, timeout,
                                                 /*own_worker=*/false);
  if (!hashes.empty()) {
    std::vector<int64_t> seen;
    std::vector<int> nodes;
    for (int64_t h : hashes) {
      auto it = std::find(seen.begin(), seen.end(), h);
      if (it == seen.end()) it = seen.insert(seen.end(), h);
      nodes.push_back(static_cast<int>(it - seen.begin()));
    }
    world->set_world_nodes(std::move(nodes));
  }
  return world;
}

void run_on_mpi_thread(const std::function<void()>& fn) { MpiRuntime::get().worker().run_sync(fn); }

MPI_Datatype mpi_datatype(c10::ScalarType dtype) { return MpiRuntime::get().datatype(dtype); }

MPI_Op mpi_op(c10::ScalarType dtype, ReduceOp op) { return MpiRuntime::get().op(dtype, op); }

}  // namespace dtrain::comm
