// Randomized collectives: every op, dtype, reduce op and shape the API accepts, on real ranks.
//
// A fixed seed draws the cases, identically on every rank: op, dtype, reduce op, shapes from
// 0-d to 3-D, sizes 0, 1, primes and sizes that do not divide by the world size. Inputs are
// drawn per (case, rank), so each rank computes every rank's input and the expected result
// itself. Cases are issued in batches of up to five asynchronous collectives whose Works are
// waited in a shuffled order. What "expected" means is the documented contract:
//   integers       exact; uint8 SUM wraps modulo 256 (as uint8 addition does everywhere)
//   MAX / MIN      exact
//   float SUM/AVG  at two ranks bitwise the one pairwise step: fp16/bf16 add in fp32 and
//                  round once, fp32/fp64 add in their own type; AVG divides that in the
//                  dtype. At more ranks each of the world - 1 steps rounds once, so the error
//                  is at most (world - 1) ulp-steps of sum |x|; and every rank agrees bitwise.
// A failure names the case (index, op, dtype, shapes, seed) so it can be replayed alone
// with --gtest_filter and DTRAIN_RANDOM_CASE=<index>.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/StringUtil.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <random>
#include <set>
#include <sstream>

#include "comm/communicator.h"
#include "comm/types.h"
#include "tests/multirank.h"

namespace dtrain::comm {
namespace {

using dtrain::testing::world;
using Test = dtrain::testing::MultiRankTest;

constexpr uint64_t kSeed = 20261130;

enum class Kind { kAllReduce, kReduceScatter, kAllGather, kBroadcast };
const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kAllReduce:
      return "all_reduce";
    case Kind::kReduceScatter:
      return "reduce_scatter";
    case Kind::kAllGather:
      return "all_gather";
    case Kind::kBroadcast:
      return "broadcast";
  }
  return "?";
}

const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16,
                                             at::kInt,   at::kLong,   at::kByte};
// Element counts worth hitting: empty, one, primes, powers of two and their neighbours.
const std::vector<int64_t> kCounts = {0,  1,   2,   3,    5,    7,    13,   31,    64,
                                      97, 127, 128, 1000, 1021, 4096, 8191, 65537, 300007};

struct Case {
  int64_t index = 0;
  Kind kind = Kind::kAllReduce;
  at::ScalarType dtype = at::kFloat;
  ReduceOp op = ReduceOp::kSum;
  int root = 0;
  std::vector<int64_t> shape;       // all_reduce / broadcast tensor, or the shard
  std::vector<int64_t> flat_shape;  // reduce_scatter input / all_gather output
  double scale = 1.0;               // magnitude of float inputs
  uint64_t seed = 0;

  std::string describe() const {
    std::ostringstream os;
    os << "case " << index << ": " << kind_name(kind) << " " << dtype_name(dtype);
    if (kind == Kind::kAllReduce || kind == Kind::kReduceScatter) os << " " << to_string(op);
    if (kind == Kind::kBroadcast) os << " root " << root;
    os << " shape " << at::IntArrayRef(shape);
    if (!flat_shape.empty() || kind == Kind::kReduceScatter || kind == Kind::kAllGather) {
      os << " flat " << at::IntArrayRef(flat_shape);
    }
    os << " scale " << scale << " (seed " << kSeed << ", world " << world().size() << ")";
    return os.str();
  }
};

int64_t numel_of(const std::vector<int64_t>& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

// A shape of 0 to 3 dimensions holding `n` elements (n = 1 may become 0-d).
std::vector<int64_t> shape_for(int64_t n, std::mt19937_64& rng) {
  int dims = static_cast<int>(rng() % 4);
  if (n == 1 && rng() % 2 == 0) return {};  // 0-d: a scalar (a 0-d shard: flat [world])
  if (dims == 0) return {n};
  std::vector<int64_t> s(dims, 1);
  int64_t rest = n;
  for (int d = 0; d + 1 < dims; ++d) {
    // A small divisor of what is left, so later dimensions keep the count exact.
    std::vector<int64_t> divisors;
    for (int64_t k = 1; k <= std::min<int64_t>(rest, 16); ++k) {
      if (rest % k == 0) divisors.push_back(k);
    }
    if (rest == 0) divisors = {0, 1, 3};
    s[d] = divisors[rng() % divisors.size()];
    if (s[d] != 0) rest /= s[d];
  }
  s[dims - 1] = rest;
  if (numel_of(s) != n) s = {n};  // a zero dimension earlier: keep it 1-D
  return s;
}

Case draw_case(int64_t index, int world_size) {
  std::mt19937_64 rng(kSeed * 1000003ull + static_cast<uint64_t>(index));
  Case c;
  c.index = index;
  c.seed = rng();
  c.kind = static_cast<Kind>(rng() % 4);
  c.dtype = kDtypes[rng() % kDtypes.size()];
  const bool floating = at::isFloatingType(c.dtype);
  do {
    c.op = static_cast<ReduceOp>(rng() % 4);
  } while (c.op == ReduceOp::kAvg && !floating);
  c.root = static_cast<int>(rng() % world_size);
  // Mostly small (latency paths), sometimes large (chunking, pipelining).
  int64_t n =
      rng() % 10 == 0 ? 1 : kCounts[rng() % (rng() % 8 == 0 ? kCounts.size() : kCounts.size() - 3)];
  c.shape = shape_for(n, rng);
  if (c.kind == Kind::kReduceScatter || c.kind == Kind::kAllGather) {
    // The flat side: [world * n], [world, *shard], or [world * d0, d1, ...].
    switch (rng() % 3) {
      case 0:
        c.flat_shape = {world_size * n};
        break;
      case 1:
        c.flat_shape = c.shape;
        c.flat_shape.insert(c.flat_shape.begin(), world_size);
        break;
      default:
        c.flat_shape = c.shape.empty() ? std::vector<int64_t>{world_size} : c.shape;
        if (!c.shape.empty()) c.flat_shape[0] *= world_size;
    }
  }
  const double scales[] = {1e-3, 1.0, 1.0, 50.0, 1000.0};
  c.scale = scales[rng() % 5];
  return c;
}

// Rank r's input for a case: exactly representable in the dtype, drawn in double.
at::Tensor input_of(const Case& c, int rank, const std::vector<int64_t>& shape) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(c.seed + 7919ull * (rank + 1));
  const int64_t n = numel_of(shape);
  at::Tensor v;
  switch (c.dtype) {
    case at::kByte:
      v = at::randint(0, 256, {n}, gen, at::kLong);  // full range: SUM must wrap
      break;
    case at::kInt:
      v = at::randint(-(1 << 20), 1 << 20, {n}, gen, at::kLong);
      break;
    case at::kLong:
      v = at::randint(-(int64_t{1} << 40), int64_t{1} << 40, {n}, gen, at::kLong);
      break;
    default:
      v = at::randn({n}, gen, at::kDouble) * c.scale;
  }
  return v.to(c.dtype).reshape(shape);
}

// op over the ranks' inputs, on the host, as the contract above defines it. For floating
// dtypes at more than two ranks this is the exact sum in fp64; `bound` receives the
// admissible error per element (zero where the result must be bitwise).
at::Tensor expected_reduce(const Case& c, const std::vector<at::Tensor>& inputs,
                           at::Tensor* bound) {
  const int world_size = static_cast<int>(inputs.size());
  const bool floating = at::isFloatingType(c.dtype);
  *bound = at::zeros({inputs[0].numel()}, at::kDouble);
  auto flat = [](const at::Tensor& t) { return t.reshape({-1}); };
  if (c.op == ReduceOp::kMax || c.op == ReduceOp::kMin) {
    at::Tensor acc = flat(inputs[0]);
    for (int r = 1; r < world_size; ++r) {
      acc = c.op == ReduceOp::kMax ? at::maximum(acc, flat(inputs[r]))
                                   : at::minimum(acc, flat(inputs[r]));
    }
    return acc;
  }
  if (!floating) {
    at::Tensor acc = at::zeros({inputs[0].numel()}, at::kLong);
    for (const auto& x : inputs) acc += flat(x).to(at::kLong);
    if (c.dtype == at::kByte) acc = at::remainder(acc, 256);
    return acc.to(c.dtype);
  }
  if (world_size == 2) {
    // One pairwise step. 16-bit types add in fp32 and round once; the others in their own.
    const bool half = c.dtype == at::kHalf || c.dtype == at::kBFloat16;
    at::Tensor a = flat(inputs[0]), b = flat(inputs[1]);
    at::Tensor sum = half ? (a.to(at::kFloat) + b.to(at::kFloat)).to(c.dtype) : a + b;
    if (c.op == ReduceOp::kAvg) sum = sum.div(2);
    return sum;
  }
  at::Tensor exact = at::zeros({inputs[0].numel()}, at::kDouble);
  at::Tensor magnitude = at::zeros({inputs[0].numel()}, at::kDouble);
  for (const auto& x : inputs) {
    exact += flat(x).to(at::kDouble);
    magnitude += flat(x).to(at::kDouble).abs();
  }
  const double eps = c10::isReducedFloatingType(c.dtype) || c.dtype == at::kHalf
                         ? (c.dtype == at::kHalf ? std::ldexp(1.0, -10) : std::ldexp(1.0, -7))
                         : (c.dtype == at::kFloat ? std::ldexp(1.0, -23) : std::ldexp(1.0, -52));
  // world - 1 roundings of partial sums bounded by sum |x|, half an ulp each, plus fp16's
  // subnormal spacing per step.
  const double tiny = c.dtype == at::kHalf ? std::ldexp(1.0, -24) * world_size : 1e-300;
  // fp64's reference is itself an fp64 sum, off by as much again.
  const double reference_error = c.dtype == at::kDouble ? 2.0 : 1.0;
  *bound = magnitude * (eps * 0.5 * (world_size - 1) * reference_error) + tiny;
  if (c.op == ReduceOp::kAvg) {
    exact = exact / world_size;
    *bound = *bound / world_size + exact.abs() * eps;
  }
  return exact;
}

// "" when `got` meets `want` within `bound` (bitwise where bound is zero), else a message.
std::string compare(const at::Tensor& got_any, const at::Tensor& want, const at::Tensor& bound) {
  at::Tensor got = got_any.cpu().reshape({-1});
  if (got.numel() != want.numel()) return "wrong element count";
  if (got.numel() == 0) return "";
  at::Tensor bad;
  if (want.scalar_type() == at::kDouble && got.scalar_type() != at::kDouble) {
    bad = ((got.to(at::kDouble) - want).abs() > bound).nonzero();
  } else if (bound.abs().max().item<double>() > 0) {
    bad = ((got.to(at::kDouble) - want.to(at::kDouble)).abs() > bound).nonzero();
  } else {
    // Bitwise: compare the bytes, so -0.0 vs 0.0 and NaN payloads count.
    at::Tensor g = got.contiguous().view(at::kByte).reshape({got.numel(), -1});
    at::Tensor w =
        want.to(got.scalar_type()).contiguous().view(at::kByte).reshape({got.numel(), -1});
    bad = (g != w).any(1).nonzero();
  }
  if (bad.numel() == 0) return "";
  const int64_t i = bad[0].item<int64_t>();
  std::ostringstream os;
  os.precision(17);
  os << bad.size(0) << " of " << got.numel() << " elements wrong; first at " << i << ": got "
     << got[i].to(at::kDouble).item<double>() << ", want " << want[i].to(at::kDouble).item<double>()
     << " (bound " << bound[i].item<double>() << ")";
  return os.str();
}

struct Issued {
  Case c;
  at::Tensor result;  // the tensor the collective writes
  Work work;
};

Issued issue(const Case& c, const at::Device& device) {
  const int rank = world().rank();
  Issued is{c, {}, {}};
  switch (c.kind) {
    case Kind::kAllReduce:
      is.result = input_of(c, rank, c.shape).to(device);
      is.work = world().all_reduce(is.result, c.op);
      break;
    case Kind::kBroadcast:
      is.result = input_of(c, rank, c.shape).to(device);
      is.work = world().broadcast(is.result, c.root);
      break;
    case Kind::kReduceScatter: {
      at::Tensor in = input_of(c, rank, c.flat_shape).to(device);
      is.result = at::full(c.shape, 77, at::TensorOptions().dtype(c.dtype).device(device));
      is.work = world().reduce_scatter(in, is.result, c.op);
      break;
    }
    case Kind::kAllGather: {
      at::Tensor in = input_of(c, rank, c.shape).to(device);
      is.result = at::full(c.flat_shape, 77, at::TensorOptions().dtype(c.dtype).device(device));
      is.work = world().all_gather(in, is.result);
      break;
    }
  }
  return is;
}

std::string check(const Issued& is) {
  const Case& c = is.c;
  const int world_size = world().size(), rank = world().rank();
  at::Tensor bound = at::zeros({0}, at::kDouble);
  at::Tensor want;
  switch (c.kind) {
    case Kind::kAllReduce: {
      std::vector<at::Tensor> inputs;
      for (int r = 0; r < world_size; ++r) inputs.push_back(input_of(c, r, c.shape));
      want = expected_reduce(c, inputs, &bound);
      break;
    }
    case Kind::kBroadcast:
      want = input_of(c, c.root, c.shape).reshape({-1});
      bound = at::zeros({want.numel()}, at::kDouble);
      break;
    case Kind::kReduceScatter: {
      std::vector<at::Tensor> inputs;
      for (int r = 0; r < world_size; ++r) inputs.push_back(input_of(c, r, c.flat_shape));
      const int64_t n = numel_of(c.shape);
      want = expected_reduce(c, inputs, &bound).narrow(0, rank * n, n);
      bound = bound.narrow(0, rank * n, n);
      break;
    }
    case Kind::kAllGather: {
      std::vector<at::Tensor> parts;
      for (int r = 0; r < world_size; ++r) parts.push_back(input_of(c, r, c.shape).reshape({-1}));
      want = at::cat(parts);
      bound = at::zeros({want.numel()}, at::kDouble);
      break;
    }
  }
  if (is.result.sizes() != at::IntArrayRef(c.kind == Kind::kAllGather ? c.flat_shape : c.shape)) {
    return "the collective changed the tensor's shape to " + c10::str(is.result.sizes());
  }
  return compare(is.result, want, bound);
}

int64_t case_count() {
  const char* n = std::getenv("DTRAIN_RANDOM_CASES");
  return n ? std::atoll(n) : 1200;
}

TEST_F(Test, RandomizedCasesMatchTheContractOnEveryRank) {
  const at::Device device = dtrain::testing::device();
  const int64_t total = case_count();
  const char* only = std::getenv("DTRAIN_RANDOM_CASE");
  std::mt19937_64 batch_rng(kSeed);  // same on every rank: batches and wait orders agree
  int64_t failures = 0;
  int64_t next = only ? std::atoll(only) : 0;
  const int64_t end = only ? next + 1 : total;
  while (next < end) {
    const int64_t batch = std::min<int64_t>(1 + static_cast<int64_t>(batch_rng() % 5), end - next);
    std::vector<Issued> issued;
    for (int64_t k = 0; k < batch; ++k)
      issued.push_back(issue(draw_case(next + k, world().size()), device));
    std::vector<size_t> order(issued.size());
    for (size_t k = 0; k < order.size(); ++k) order[k] = k;
    std::shuffle(order.begin(), order.end(), batch_rng);
    for (size_t k : order) issued[k].work.wait();
    for (const auto& is : issued) {
      std::string why = check(is);
      if (!why.empty()) {
        ++failures;
        ADD_FAILURE() << is.c.describe() << ": " << why;
      }
    }
    next += batch;
  }
  EXPECT_EQ(failures, 0);
}

// The draw reaches what the contract covers: every op with every dtype, every reduce op,
// shapes from 0-d to 3-D for each op, empty tensors, and uneven flat layouts.
TEST_F(Test, DrawnCasesCoverEveryOpDtypeAndShapeKind) {
  std::set<std::string> seen;
  for (int64_t i = 0; i < case_count(); ++i) {
    Case c = draw_case(i, world().size());
    seen.insert(std::string(kind_name(c.kind)) + "/" + dtype_name(c.dtype));
    seen.insert(std::string(kind_name(c.kind)) + "/dims" + std::to_string(c.shape.size()));
    if (numel_of(c.shape) == 0) seen.insert(std::string(kind_name(c.kind)) + "/empty");
    if (c.kind == Kind::kAllReduce) seen.insert(std::string("op/") + to_string(c.op));
    if (c.kind == Kind::kReduceScatter || c.kind == Kind::kAllGather) {
      seen.insert(std::string(kind_name(c.kind)) + "/flatdims" +
                  std::to_string(c.flat_shape.size()));
    }
  }
  std::vector<std::string> missing;
  for (Kind k : {Kind::kAllReduce, Kind::kReduceScatter, Kind::kAllGather, Kind::kBroadcast}) {
    for (auto t : kDtypes) missing.push_back(std::string(kind_name(k)) + "/" + dtype_name(t));
    for (int d = 0; d < 4; ++d)
      missing.push_back(std::string(kind_name(k)) + "/dims" + std::to_string(d));
    missing.push_back(std::string(kind_name(k)) + "/empty");
  }
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin}) {
    missing.push_back(std::string("op/") + to_string(op));
  }
  for (int d = 1; d < 4; ++d) {
    missing.push_back(std::string("reduce_scatter/flatdims") + std::to_string(d));
    missing.push_back(std::string("all_gather/flatdims") + std::to_string(d));
  }
  missing.erase(std::remove_if(missing.begin(), missing.end(),
                               [&](const std::string& k) { return seen.count(k) > 0; }),
                missing.end());
  EXPECT_TRUE(missing.empty()) << "not drawn: " << c10::Join(", ", missing)
                               << " (raise DTRAIN_RANDOM_CASES or change the seed)";
}

// All-reduce results are bitwise identical on every rank (DDP relies on it), for every
// float dtype at every size drawn.
TEST_F(Test, AllReduceResultsAgreeBitwiseAcrossRanks) {
  const at::Device device = dtrain::testing::device();
  for (int64_t i = 0; i < case_count(); ++i) {
    Case c = draw_case(i, world().size());
    if (c.kind != Kind::kAllReduce || !at::isFloatingType(c.dtype)) continue;
    Issued is = issue(c, device);
    is.work.wait();
    at::Tensor mine = is.result.contiguous().reshape({-1}).view(at::kByte);
    at::Tensor root = mine.clone();
    world().broadcast(root, 0).wait();
    EXPECT_TRUE(at::equal(mine.cpu(), root.cpu()))
        << c.describe() << ": rank " << world().rank() << " differs from rank 0";
  }
}

}  // namespace
}  // namespace dtrain::comm

int main(int argc, char** argv) { return dtrain::testing::multirank_main(argc, argv); }
