// comm_bench: collective bandwidth, nccl-tests style, for dtrain's MPI backend beside raw MPI
// on the same bytes in the same run, and for the Gloo backend.
//
//   mpirun -np 2 bazel-bin/bench/comm_bench [--min-kib 4] [--max-mib 64 | --max-kib K] [--reps 5]
//                                           [--op all_gather]... [--no-gloo]
// (bench/run_comm_bench.sh repeats it and reports each row's median and minimum ratio.)
//
// Sizes are the total buffer (all_reduce: the tensor; reduce_scatter: the input; all_gather:
// the output), 4 KiB to 64 MiB. Each measurement issues `iters` collectives back to back and
// waits for the last, so a backend's per-op launch cost is amortized as in nccl-tests; raw MPI
// runs the same loop of blocking calls on the MPI thread itself. Time is the slowest rank's,
// the reported figure the median of --reps repetitions. algbw = size / time;
// busbw = algbw x 2(n-1)/n for all_reduce, x (n-1)/n for reduce_scatter and all_gather.
// "dtrain extra us/op" is dtrain's time per collective less raw MPI's: the cost of handing
// the call to the worker thread and completing its Work, which a message of a few KiB cannot
// hide (raw MPI moves 4 KiB between two ranks in well under a microsecond).
// Every result is checked against the buffer each rank computes; a wrong element on any
// rank fails the run.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "comm/factory.h"
#include "comm/mpi_communicator.h"
#include "comm/mpi_raw.h"
#include "core/cli.h"
#include "core/error.h"

namespace {

using namespace dtrain::comm;
using Clock = std::chrono::steady_clock;

enum class Op { kAllReduce, kReduceScatter, kAllGather };
const char* name(Op op) {
  return op == Op::kAllReduce       ? "all_reduce"
         : op == Op::kReduceScatter ? "reduce_scatter"
                                    : "all_gather";
}
double bus_factor(Op op, int n) {
  return op == Op::kAllReduce ? 2.0 * (n - 1) / n : double(n - 1) / n;
}

struct Buffers {
  at::Tensor in, out;
};

Buffers make_buffers(Op op, int64_t elems, int world, int rank, at::ScalarType t) {
  // Small integers: sums stay exact in bf16 for checking.
  auto value = at::full({}, double((rank % 3) + 1), at::kFloat);
  switch (op) {
    case Op::kAllReduce: {
      at::Tensor x = value.expand({elems}).to(t).contiguous();
      return {x, x};
    }
    case Op::kReduceScatter:
      return {value.expand({elems}).to(t).contiguous(), at::zeros({elems / world}, t)};
    case Op::kAllGather:
      return {value.expand({elems / world}).to(t).contiguous(), at::zeros({elems}, t)};
  }
  return {};
}

// Expected value of every element after one collective (checked once per size).
bool check(Op op, const Buffers& b, int world) {
  if (op == Op::kAllGather) {
    for (int r = 0; r < world; ++r) {
      int64_t shard = b.out.numel() / world;
      if (!b.out.narrow(0, r * shard, shard).eq((r % 3) + 1).all().item<bool>()) return false;
    }
    return true;
  }
  double sum = 0;
  for (int r = 0; r < world; ++r) sum += (r % 3) + 1;
  return b.out.eq(sum).all().item<bool>();
}

Work launch(Communicator& c, Op op, const Buffers& b) {
  switch (op) {
    case Op::kAllReduce:
      return c.all_reduce(b.in);
    case Op::kReduceScatter:
      return c.reduce_scatter(b.in, b.out);
    case Op::kAllGather:
      return c.all_gather(b.in, b.out);
  }
  return Work();
}

double slowest(Communicator& c, double seconds) {
  at::Tensor t = at::full({1}, seconds, at::kDouble);
  c.all_reduce(t, ReduceOp::kMax).wait();
  return t.item<double>();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Seconds per collective through a dtrain communicator.
double time_dtrain(Communicator& c, Op op, const Buffers& b, int iters) {
  c.barrier().wait();
  auto t0 = Clock::now();
  std::vector<Work> works;
  for (int i = 0; i < iters; ++i) works.push_back(launch(c, op, b));
  works.back().wait();  // collectives complete in order: one wake-up, as nccl-tests syncs once
  for (auto& w : works) w.wait();  // already complete; rethrows any failure
  return std::chrono::duration<double>(Clock::now() - t0).count() / iters;
}

// Seconds per collective, raw MPI calls on the MPI thread (MPI_COMM_WORLD).
double time_raw(Op op, const Buffers& b, int iters, int world) {
  double seconds = 0;
  run_on_mpi_thread([&] {
    MPI_Datatype dt = mpi_datatype(b.in.scalar_type());
    MPI_Op sum = mpi_op(b.in.scalar_type(), ReduceOp::kSum);
    MPI_Barrier(MPI_COMM_WORLD);
    auto t0 = Clock::now();
    for (int i = 0; i < iters; ++i) {
      switch (op) {
        case Op::kAllReduce:
          MPI_Allreduce(MPI_IN_PLACE, b.in.data_ptr(), int(b.in.numel()), dt, sum, MPI_COMM_WORLD);
          break;
        case Op::kReduceScatter:
          MPI_Reduce_scatter_block(b.in.data_ptr(), b.out.data_ptr(), int(b.out.numel()), dt, sum,
                                   MPI_COMM_WORLD);
          break;
        case Op::kAllGather:
          MPI_Allgather(b.in.data_ptr(), int(b.in.numel()), dt, b.out.data_ptr(), int(b.in.numel()),
                        dt, MPI_COMM_WORLD);
          break;
      }
    }
    seconds = std::chrono::duration<double>(Clock::now() - t0).count() / iters;
  });
  (void)world;
  return seconds;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "comm_bench: dtrain's MPI backend beside raw MPI (and Gloo) for all_reduce, reduce_scatter "
      "and all_gather in fp32 and bf16, 4 KiB to --max-mib; every result checked.\n"
      "Run under mpirun: mpirun -np 2 comm_bench"};
  dtrain::cli::setup(app, "comm_bench");
  int64_t max_mib = 64;
  int reps = 5;
  int64_t min_kib = 4, max_kib = 0;
  std::vector<std::string> ops_wanted = {"all_reduce", "reduce_scatter", "all_gather"};
  bool with_gloo = true;
  app.add_option("--max-mib", max_mib, "largest message, MiB")->check(CLI::Range(1, 4096));
  app.add_option("--reps", reps, "repetitions per size; the median is reported")
      ->check(CLI::Range(1, 1000));
  app.add_option("--min-kib", min_kib, "smallest message, KiB (a power of 4 times 4)")
      ->check(CLI::Range(4, 4 * 1024 * 1024));
  app.add_option("--max-kib", max_kib, "largest message, KiB (instead of --max-mib)")
      ->check(CLI::Range(4, 4 * 1024 * 1024));
  app.add_option("--op", ops_wanted, "collectives to run (repeatable)")
      ->check(CLI::IsMember({"all_reduce", "reduce_scatter", "all_gather"}));
  app.add_flag("!--no-gloo", with_gloo, "skip the Gloo column (c10d's; slow at large sizes)");
  dtrain::cli::parse(app, argc, argv);
  at::set_num_threads(1);
  CommOptions mo;
  mo.backend = Backend::kMpi;
  auto mpi = create_world(mo);
  CommOptions go;
  go.backend = Backend::kGloo;
  const int64_t max_bytes = max_kib > 0 ? max_kib * 1024 : max_mib * 1024 * 1024;
  std::shared_ptr<Communicator> gloo = with_gloo ? create_world(go) : nullptr;
  const int world = mpi->size(), rank = mpi->rank();
  if (rank == 0) {
    std::printf("# comm_bench: %d ranks, median of %d reps, GB/s (1e9 bytes/s)\n", world, reps);
    std::printf(
        "| op | dtype | size | dtrain-mpi algbw | busbw | raw MPI algbw | busbw | "
        "dtrain/raw | raw us/op | dtrain extra us/op | gloo algbw | busbw |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  }
  int failures = 0;
  for (Op op : {Op::kAllReduce, Op::kReduceScatter, Op::kAllGather}) {
    if (std::find(ops_wanted.begin(), ops_wanted.end(), name(op)) == ops_wanted.end()) continue;
    for (auto t : {at::kFloat, at::kBFloat16}) {
      for (int64_t bytes = min_kib * 1024; bytes <= max_bytes; bytes *= 4) {
        int64_t elems = bytes / c10::elementSize(t);
        elems -= elems % world;
        const int iters = static_cast<int>(std::clamp<int64_t>((256LL << 20) / bytes, 3, 200));
        double per[3];
        Communicator* comms[3] = {mpi.get(), nullptr, gloo.get()};
        for (int k = 0; k < 3; ++k) {
          per[k] = 0;
          if (k == 2 && !gloo) continue;
          std::vector<double> samples;
          Buffers b = make_buffers(op, elems, world, rank, t);
          for (int r = 0; r < reps + 1; ++r) {  // the first repetition warms up
            if (op == Op::kAllReduce) b = make_buffers(op, elems, world, rank, t);
            double s = k == 1 ? time_raw(op, b, r == 0 ? 1 : iters, world)
                              : time_dtrain(*comms[k], op, b, r == 0 ? 1 : iters);
            if (r == 0) {
              // One collective on fresh buffers: check every element on every rank.
              if (!check(op, b, world)) {
                ++failures;
                std::fprintf(stderr, "rank %d: %s %s %lld bytes (%s): wrong result\n", rank,
                             name(op), c10::toString(t), static_cast<long long>(bytes),
                             k == 0   ? "dtrain-mpi"
                             : k == 1 ? "raw"
                                      : "gloo");
              }
              continue;
            }
            samples.push_back(slowest(*mpi, s));
          }
          per[k] = median(samples);
        }
        if (rank == 0) {
          double size = double(elems) * c10::elementSize(t);
          auto alg = [&](double s) { return size / s / 1e9; };
          char gloo_cols[64] = "- | -";
          if (gloo) {
            std::snprintf(gloo_cols, sizeof gloo_cols, "%.3f | %.3f", alg(per[2]),
                          alg(per[2]) * bus_factor(op, world));
          }
          std::printf("| %s | %s | %s | %.3f | %.3f | %.3f | %.3f | %.2f | %.2f | %.2f | %s |\n",
                      name(op), t == at::kFloat ? "fp32" : "bf16",
                      bytes >= (1 << 20) ? (std::to_string(bytes >> 20) + " MiB").c_str()
                                         : (std::to_string(bytes >> 10) + " KiB").c_str(),
                      alg(per[0]), alg(per[0]) * bus_factor(op, world), alg(per[1]),
                      alg(per[1]) * bus_factor(op, world), per[1] / per[0], per[1] * 1e6,
                      (per[0] - per[1]) * 1e6, gloo_cols);
          std::fflush(stdout);
        }
      }
    }
  }
  at::Tensor f = at::full({1}, failures, at::kInt);
  mpi->all_reduce(f).wait();
  if (rank == 0) std::printf("# wrong results on all ranks: %d\n", f.item<int>());
  gloo.reset();
  mpi.reset();
  return f.item<int>() == 0 ? 0 : 1;
}
