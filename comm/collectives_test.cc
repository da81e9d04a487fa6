// Every collective x dtype x op x size, on real ranks (see comm/BUILD for the launches).
// Each rank computes the expected buffer itself and compares element by element.
#include <ATen/ATen.h>
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <tuple>

#include "comm/communicator.h"
#include "core/error.h"
#include "tests/multirank.h"

namespace dtrain::comm {
namespace {

using dtrain::testing::world;
using Test = dtrain::testing::MultiRankTest;

const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16,
                                             at::kInt,   at::kLong,   at::kByte};
const std::vector<ReduceOp> kOps = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin};
// 0, 1, primes, and sizes that do not divide by 2 or 4 (all_reduce and broadcast allow any);
// 300007 crosses the pieces MPI all-reduces within a node go in (main() sets
// DTRAIN_MPI_CHUNK_KIB=1024), in every dtype but the 1-byte ones.
const std::vector<int64_t> kSizes = {0, 1, 2, 7, 13, 1000, 65537, 300007};
const std::vector<int64_t> kShardSizes = {0, 1, 7, 13, 1000};

// Rank r's value at flat index i: small integers, so sums are exact in every dtype.
at::Tensor rank_values(int rank, int64_t n) {
  at::Tensor i = at::arange(n, at::kDouble);
  return at::remainder((rank + 1) * 3 + i * 7, 13);
}

at::Tensor reduce_expected(ReduceOp op, int size, int64_t n) {
  at::Tensor acc = rank_values(0, n);
  for (int r = 1; r < size; ++r) {
    at::Tensor v = rank_values(r, n);
    acc = op == ReduceOp::kMax   ? at::maximum(acc, v)
          : op == ReduceOp::kMin ? at::minimum(acc, v)
                                 : acc + v;
  }
  if (op == ReduceOp::kAvg) acc = acc / size;
  return acc;
}

bool valid(ReduceOp op, at::ScalarType t) { return op != ReduceOp::kAvg || at::isFloatingType(t); }

void expect_equal(const at::Tensor& got, const at::Tensor& want_double, at::ScalarType t) {
  at::Tensor want = want_double.to(t).to(at::kDouble);
  at::Tensor g = got.to(at::kDouble);
  ASSERT_EQ(g.numel(), want.numel());
  if (g.numel() == 0) return;
  at::Tensor bad = (g != want).nonzero();
  if (bad.numel() > 0) {
    int64_t i = bad[0].item<int64_t>();
    FAIL() << bad.size(0) << " wrong elements; first at " << i << ": got " << g[i].item<double>()
           << ", want " << want[i].item<double>();
  }
}

TEST_F(Test, AllReduceEveryDtypeOpAndSize) {
  for (auto t : kDtypes) {
    for (auto op : kOps) {
      if (!valid(op, t)) continue;
      for (int64_t n : kSizes) {
        SCOPED_TRACE(::testing::Message()
                     << c10::toString(t) << " " << to_string(op) << " n=" << n);
        at::Tensor x = rank_values(world().rank(), n).to(t);
        world().all_reduce(x, op).wait();
        expect_equal(x, reduce_expected(op, world().size(), n), t);
      }
    }
  }
}

TEST_F(Test, ReduceScatterEveryDtypeOpAndSize) {
  const int size = world().size(), rank = world().rank();
  for (auto t : kDtypes) {
    for (auto op : kOps) {
      if (!valid(op, t)) continue;
      for (int64_t shard : kShardSizes) {
        SCOPED_TRACE(::testing::Message()
                     << c10::toString(t) << " " << to_string(op) << " shard=" << shard);
        at::Tensor in = rank_values(rank, shard * size).to(t);
        at::Tensor out = at::full({shard}, 99, at::TensorOptions().dtype(t));
        world().reduce_scatter(in, out, op).wait();
        expect_equal(out, reduce_expected(op, size, shard * size).narrow(0, rank * shard, shard),
                     t);
      }
    }
  }
}

TEST_F(Test, AllGatherEveryDtypeAndSize) {
  const int size = world().size(), rank = world().rank();
  for (auto t : kDtypes) {
    for (int64_t shard : kShardSizes) {
      SCOPED_TRACE(::testing::Message() << c10::toString(t) << " shard=" << shard);
      at::Tensor in = rank_values(rank, shard).to(t);
      at::Tensor out = at::zeros({shard * size}, at::TensorOptions().dtype(t));
      world().all_gather(in, out).wait();
      std::vector<at::Tensor> parts;
      for (int r = 0; r < size; ++r) parts.push_back(rank_values(r, shard));
      expect_equal(out, at::cat(parts), t);
    }
  }
}

TEST_F(Test, BroadcastFromEveryRootEveryDtypeAndSize) {
  for (int root = 0; root < world().size(); ++root) {
    for (auto t : kDtypes) {
      for (int64_t n : kSizes) {
        SCOPED_TRACE(::testing::Message()
                     << "root " << root << " " << c10::toString(t) << " n=" << n);
        at::Tensor x = rank_values(world().rank(), n).to(t);
        world().broadcast(x, root).wait();
        expect_equal(x, rank_values(root, n), t);
      }
    }
  }
}

TEST_F(Test, ManyOutstandingCollectivesCompleteInOrder) {
  std::vector<at::Tensor> xs;
  std::vector<Work> works;
  for (int k = 0; k < 32; ++k) {
    xs.push_back(at::full({257}, double(k + world().rank()), at::kFloat));
    works.push_back(world().all_reduce(xs.back()));
  }
  for (auto& w : works) w.wait();
  const int s = world().size();
  for (int k = 0; k < 32; ++k) {
    double want = k * s + s * (s - 1) / 2.0;
    EXPECT_EQ(xs[k][0].item<float>(), want) << "collective " << k;
    EXPECT_TRUE(works[k].is_completed());
  }
  world().barrier().wait();
}

// Once wait() returns, the caller holds the only references to the tensors: a buffer it lets
// go is freed then (FSDP's peak memory depends on it), not when the worker thread gets to it.
// Gloo's own threads hold a finished c10d work (and its tensors) a moment longer, out of reach.
TEST_F(Test, AfterWaitTheCollectiveHoldsNoReferenceToItsTensors) {
  if (world().backend() == "gloo") GTEST_SKIP() << "ProcessGroupGloo releases its works late";
  const int s = world().size();
  for (int k = 0; k < 200; ++k) {
    at::Tensor x = at::full({64}, 1.0, at::kFloat);
    world().all_reduce(x).wait();
    ASSERT_EQ(x.use_count(), 1u) << "all_reduce, round " << k;
    at::Tensor full = at::full({8 * s}, 1.0, at::kFloat);
    at::Tensor shard = at::empty({8}, at::kFloat);
    world().reduce_scatter(full, shard).wait();
    ASSERT_EQ(full.use_count(), 1u) << "reduce_scatter input, round " << k;
    ASSERT_EQ(shard.use_count(), 1u) << "reduce_scatter output, round " << k;
    world().all_gather(shard, full).wait();
    ASSERT_EQ(shard.use_count(), 1u) << "all_gather input, round " << k;
    ASSERT_EQ(full.use_count(), 1u) << "all_gather output, round " << k;
    EXPECT_EQ(full[0].item<float>(), float(s));
  }
}

// fp16/bf16: the result is the fp32 sum of each pair rounded once per pairwise step.
TEST_F(Test, HalfAndBFloat16SumsRoundOncePerPairwiseStep) {
  const int size = world().size();
  for (auto t : {at::kHalf, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(t));
    at::manual_seed(1234);  // same draws on every rank
    // 600011 values: more than one 1 MiB piece (DTRAIN_MPI_CHUNK_KIB=1024), and a
    // ragged tail for the vector loops of the 16-bit sums.
    at::Tensor all = (at::randn({size, 600011}) * 3).to(t);
    at::Tensor x = all[world().rank()].clone();
    world().all_reduce(x).wait();
    at::Tensor exact = all.to(at::kFloat).sum(0);
    if (size == 2) {
      // One pairwise step: exactly round-to-nearest-even of the fp32 sum.
      at::Tensor want = exact.to(t);
      EXPECT_TRUE(at::equal(x, want))
          << "max diff " << (x.to(at::kFloat) - want.to(at::kFloat)).abs().max();
    } else {
      // size-1 roundings, each at most half an ulp of a partial sum bounded by sum |x|.
      at::Tensor mag = all.to(at::kFloat).abs().sum(0).clamp_min(1e-30);
      int mantissa = t == at::kHalf ? 10 : 7;
      at::Tensor ulp = at::exp2(at::floor(at::log2(mag)) - mantissa);
      at::Tensor err = (x.to(at::kFloat) - exact).abs();
      EXPECT_TRUE((err <= ulp * 0.5 * (size - 1)).all().item<bool>())
          << "max err/ulp " << (err / ulp).max().item<float>();
    }
  }
}

// A free port on 127.0.0.1 chosen by rank 0, known to every rank.
int agreed_port() {
  at::Tensor port = at::zeros({1}, at::kInt);
  if (world().rank() == 0) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
      port[0] = ntohs(a.sin_port);
    }
    ::close(fd);
  }
  world().broadcast(port, 0).wait();
  return port[0].item<int>();
}

// The sums of dtrain's Gloo reduce-scatter round as c10d's own Gloo reduce_scatter_tensor
// (PyTorch's, which fully_shard uses) does, bit for bit: shard sizes where gloo's blocks are
// the chunks and where they are not (odd sizes, and segments past gloo's 1 MiB).
TEST_F(Test, GlooReduceScatterSumsRoundAsC10dGloosDo) {
  if (world().backend() != "gloo") GTEST_SKIP() << "compares with c10d's Gloo";
  const int rank = world().rank(), size = world().size();
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<uint16_t>(agreed_port());
  opts.isServer = rank == 0;
  opts.numWorkers = size;
  auto store = c10::make_intrusive<c10d::PrefixStore>(
      "c10d", c10::make_intrusive<c10d::TCPStore>("127.0.0.1", opts));
  auto pg_opts = c10d::ProcessGroupGloo::Options::create();
  pg_opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  c10d::ProcessGroupGloo pg(store, rank, size, pg_opts);
  for (auto t : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (int64_t n : {1, 7, 1000, 1001, 300007, 600001}) {
      SCOPED_TRACE(::testing::Message() << c10::toString(t) << ", " << n << " per rank");
      at::manual_seed(77 + n);  // the same draws on every rank; each rank takes its row
      // Magnitudes over several decades, so the order of the additions shows in the bits.
      at::Tensor all = (at::randn({size, size * n}) * at::exp2(at::randint(-8, 9, {size, 1})));
      at::Tensor in = all[rank].to(t).contiguous();
      at::Tensor mine = at::empty({n}, in.options());
      world().reduce_scatter(in, mine).wait();
      at::Tensor theirs = at::empty({n}, in.options());
      pg._reduce_scatter_base(theirs, in)->wait();
      const int64_t differ = (mine.view(-1) != theirs.view(-1)).sum().item<int64_t>();
      EXPECT_EQ(differ, 0) << "elements that round otherwise than c10d's";
    }
  }
}

TEST_F(Test, SplitFormsColorGroupsOrderedByKey) {
  const int rank = world().rank(), size = world().size();
  // Even and odd ranks; key reverses the order inside each group.
  auto group = world().split(rank % 2, -rank);
  ASSERT_NE(group, nullptr);
  std::vector<int> members;
  for (int r = size - 1; r >= 0; --r) {
    if (r % 2 == rank % 2) members.push_back(r);
  }
  EXPECT_EQ(group->world_ranks(), members);
  EXPECT_EQ(group->size(), static_cast<int>(members.size()));
  EXPECT_EQ(group->world_ranks()[group->rank()], rank);
  at::Tensor x = at::full({5}, double(rank), at::kFloat);
  group->all_reduce(x).wait();
  double want = 0;
  for (int m : members) want += m;
  EXPECT_EQ(x[4].item<float>(), want);
  // A negative color opts out; the others still get a group.
  auto some = world().split(rank == 0 ? -1 : 0, rank);
  EXPECT_EQ(some == nullptr, rank == 0);
  if (some) {
    EXPECT_EQ(some->size(), size - 1);
    some->barrier().wait();
  }
}

TEST_F(Test, CollectivesOnDifferentCommunicatorsProgressIndependently) {
  // Two communicators over the same ranks. Rank 0 issues on B, then on A; the others on A,
  // and on B only once A completed. Were B's collective to hold up A's (one thread for
  // both), A could never complete: a deadlock, here a timeout.
  const int rank = world().rank(), size = world().size();
  auto a = world().split(0, rank), b = world().split(0, rank);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  at::Tensor ta = at::full({1000}, double(rank), at::kFloat);
  at::Tensor tb = at::full({1000}, double(2 * rank), at::kFloat);
  const auto limit = std::chrono::seconds(30);
  if (rank == 0) {
    Work wb = b->all_reduce(tb);
    a->all_reduce(ta).wait(limit);
    wb.wait(limit);
  } else {
    a->all_reduce(ta).wait(limit);
    b->all_reduce(tb).wait(limit);
  }
  const double sum = size * (size - 1) / 2.0;
  EXPECT_EQ(ta[999].item<float>(), sum);
  EXPECT_EQ(tb[0].item<float>(), 2 * sum);
}

// Runs f, which must throw a CommError whose message contains `needle`.
void expect_error(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one containing '" << needle << "'";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST_F(Test, BadArgumentsRaiseClearErrorsWithoutDesynchronizing) {
  const int size = world().size();
  at::Tensor odd = at::zeros({size * 3 + 1});
  at::Tensor shard = at::zeros({3});
  expect_error([&] { world().reduce_scatter(odd, shard); }, "multiple of the world size");
  expect_error([&] { world().all_gather(shard, odd); }, "world size x shard");
  at::Tensor strided = at::zeros({4, 4}).t();
  expect_error([&] { world().all_reduce(strided); }, "contiguous");
  at::Tensor ints = at::zeros({4}, at::kInt);
  expect_error([&] { world().all_reduce(ints, ReduceOp::kAvg); }, "AVG needs a floating dtype");
  at::Tensor bools = at::zeros({4}, at::kBool);
  expect_error([&] { world().all_reduce(bools); }, "not supported");
  expect_error([&] { world().broadcast(shard, size); }, "root");
  at::Tensor mixed = at::zeros({size * 3}, at::kDouble);
  expect_error([&] { world().reduce_scatter(mixed, shard); }, "dtypes differ");
  // Rejected calls issue nothing, so the ranks are still in step.
  at::Tensor x = at::ones({3});
  world().all_reduce(x).wait();
  EXPECT_EQ(x[0].item<float>(), size);
}

// Point-to-point: every dtype (those collectives refuse too), 0-d, empty and odd shapes.
const std::vector<at::ScalarType> kP2PDtypes = {
    at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kInt,         at::kLong,
    at::kByte,  at::kBool,   at::kChar, at::kShort,    at::kComplexFloat};
const std::vector<std::vector<int64_t>> kP2PShapes = {{},     {0},       {1},     {7},
                                                      {3, 5}, {2, 0, 3}, {300007}};

// What rank `from` sends: small integers, exact in every dtype.
at::Tensor p2p_values(int from, at::ScalarType t, at::IntArrayRef shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  at::Tensor v = at::remainder(at::arange(n, at::kDouble) * 7 + from * 3 + 1, 13).reshape(shape);
  return t == at::kBool ? v.gt(6) : v.to(t);
}

TEST_F(Test, PointToPointRingCarriesEveryDtypeAndShape) {
  const int rank = world().rank(), size = world().size();
  const int next = (rank + 1) % size, prev = (rank + size - 1) % size;
  for (auto t : kP2PDtypes) {
    for (const auto& shape : kP2PShapes) {
      SCOPED_TRACE(::testing::Message() << c10::toString(t) << " " << at::IntArrayRef(shape));
      at::Tensor out = p2p_values(rank, t, shape);
      at::Tensor in = at::zeros(shape, out.options());
      // Every rank sends first: only a batch, posted at once, cannot deadlock.
      world()
          .batch_p2p({{Communicator::P2POp::kSend, out, next, 3},
                      {Communicator::P2POp::kRecv, in, prev, 3}})
          .wait();
      EXPECT_TRUE(at::equal(in, p2p_values(prev, t, shape)));
      EXPECT_TRUE(at::equal(out, p2p_values(rank, t, shape))) << "a send leaves its tensor";
    }
  }
}

TEST_F(Test, PointToPointPairsByPeerTagAndOrder) {
  const int rank = world().rank(), size = world().size();
  // Repeated: which header a receiver's poll finds first varies from run to run, and a payload
  // posted in that order rather than its receive's would take another message's bytes.
  for (int round = 0; round < 30 && (rank % 2 == 1 || rank + 1 < size); ++round) {
    const int peer = rank % 2 == 0 ? rank + 1 : rank - 1;
    if (rank % 2 == 0) {
      // Three messages: tag 0, tag 5, tag 0; single sends, in order.
      for (int i = 0; i < 3; ++i) {
        world().send(at::full({4}, double(10 * rank + i), at::kLong), peer, i == 1 ? 5 : 0).wait();
      }
      // And back: a recv from the odd rank.
      at::Tensor back = at::zeros({2, 2}, at::kFloat);
      world().recv(back, peer, 0).wait();
      EXPECT_EQ(back[1][1].item<float>(), peer + 0.5f);
    } else {
      // Posted in another order in one batch: the tag, then the order under a tag, pairs them.
      at::Tensor t5 = at::zeros({4}, at::kLong), first = at::zeros({4}, at::kLong),
                 third = at::zeros({4}, at::kLong);
      world()
          .batch_p2p({{Communicator::P2POp::kRecv, t5, peer, 5},
                      {Communicator::P2POp::kRecv, first, peer, 0},
                      {Communicator::P2POp::kRecv, third, peer, 0}})
          .wait();
      EXPECT_EQ(first[0].item<int64_t>(), 10 * peer);
      EXPECT_EQ(t5[3].item<int64_t>(), 10 * peer + 1);
      EXPECT_EQ(third[2].item<int64_t>(), 10 * peer + 2);
      world().send(at::full({2, 2}, rank + 0.5, at::kFloat), peer, 0).wait();
    }
  }
  world().barrier().wait();  // point-to-point work left the collectives in step
}

// After a channel's first message (its header alone, then its bytes), each later one travels
// as one transfer with its header: every dtype and shape, the same again, then another shape
// on both sides (the header first, then the bytes), then the first shape again.
TEST_F(Test, PointToPointLaterMessagesTravelWithTheirHeader) {
  const int rank = world().rank(), size = world().size();
  if (rank % 2 == 0 && rank + 1 == size) {
    world().barrier().wait();
    return;
  }
  const int peer = rank % 2 == 0 ? rank + 1 : rank - 1;
  const bool sender = rank % 2 == 0;
  // The shapes a channel carries in turn: the first, the same twice, another, the first.
  for (size_t d = 0; d < kP2PDtypes.size(); ++d) {
    const at::ScalarType t = kP2PDtypes[d];
    for (const auto& shapes : std::vector<std::vector<std::vector<int64_t>>>{
             {{3, 5}, {3, 5}, {3, 5}, {7}, {3, 5}},  // a payload, then a larger one
             {{300007}, {300007}, {}, {0}, {300007}},
             {{0}, {0}, {2, 2}, {0}}}) {  // an empty first: later joint transfers are headers
      const int tag = static_cast<int>(100 + 10 * d + shapes.size() + shapes[0].size());
      for (size_t m = 0; m < shapes.size(); ++m) {
        SCOPED_TRACE(::testing::Message() << c10::toString(t) << " tag " << tag << " message " << m
                                          << " " << at::IntArrayRef(shapes[m]));
        if (sender) {
          world().send(p2p_values(rank + static_cast<int>(m), t, shapes[m]), peer, tag).wait();
        } else {
          at::Tensor in = at::zeros(shapes[m], at::TensorOptions(t));
          world().recv(in, peer, tag).wait();
          EXPECT_TRUE(at::equal(in, p2p_values(peer + static_cast<int>(m), t, shapes[m])));
        }
      }
    }
  }
  // A channel whose first message is over 4 MiB: its later messages go as the first did,
  // header and then bytes, including one of another shape on both sides.
  for (const auto& shape :
       std::vector<std::vector<int64_t>>{{1100000}, {1100000}, {3, 5}, {1100000}}) {
    SCOPED_TRACE(::testing::Message() << "large channel " << at::IntArrayRef(shape));
    if (sender) {
      world()
          .send(p2p_values(rank + static_cast<int>(shape.size()), at::kFloat, shape), peer, 90)
          .wait();
    } else {
      at::Tensor in = at::zeros(shape);
      world().recv(in, peer, 90).wait();
      EXPECT_TRUE(
          at::equal(in, p2p_values(peer + static_cast<int>(shape.size()), at::kFloat, shape)));
    }
  }
  // A channel's first message and later ones in one batch on either side: the receiver
  // waits for the first before it posts the others (their size is the first's).
  for (int round = 0; round < 2; ++round) {
    for (bool batched_sends : {true, false}) {
      const int tag = batched_sends ? 60 : 61;  // round 1: every message joint
      std::vector<at::Tensor> want, got;
      std::vector<Communicator::P2POp> ops;
      for (int m = 0; m < 3; ++m) {
        const std::vector<int64_t> shape =
            m == 1 ? std::vector<int64_t>{5} : std::vector<int64_t>{4, 2};
        want.push_back(p2p_values(peer + m, at::kFloat, shape));
        got.push_back(sender ? p2p_values(rank + m, at::kFloat, shape) : at::zeros(shape));
        ops.push_back({sender ? Communicator::P2POp::kSend : Communicator::P2POp::kRecv, got.back(),
                       peer, tag});
      }
      if (sender == batched_sends) {
        world().batch_p2p(ops).wait();
      } else {
        for (auto& op : ops) world().batch_p2p({op}).wait();
      }
      if (!sender) {
        for (int m = 0; m < 3; ++m) EXPECT_TRUE(at::equal(got[m], want[m])) << "message " << m;
      }
    }
  }
  world().barrier().wait();
}

// A batch posts every receive it can before it waits for any: where a channel's first
// message and a later one share a batch (the later one's size waits for the first's header),
// and where a message of another shape must have its bytes posted after its header, the
// other receives of the batch are already posted. Otherwise rank 0 would hold back the
// receive that rank 2 sends to first, and rank 2's next send is what rank 1 waits for before
// it sends to rank 0: all three would wait until the timeout.
TEST_F(Test, PointToPointBatchesPostEveryReceiveBeforeWaiting) {
  const int rank = world().rank(), size = world().size();
  if (size < 3) GTEST_SKIP() << "needs 3 ranks";
  using P = Communicator::P2POp;
  constexpr auto kWait = std::chrono::seconds(20);
  at::Tensor a = at::full({4}, 1.0), b = at::full({4}, 2.0), c = at::full({4}, 3.0);
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE(::testing::Message() << "round " << round);
    // Round 0: tag 410's first message and a later one in rank 0's batch. Round 1: tag 411's
    // message changes shape on both sides (its bytes follow its header).
    const int t = 410 + round, u = 420 + round, v = 430 + round;
    const std::vector<int64_t> shape_u =
        round == 0 ? std::vector<int64_t>{4} : std::vector<int64_t>{6};
    if (round == 1) {  // the channels' first messages, of shape [4]
      if (rank == 0) {
        at::Tensor x = at::zeros({4}), y = at::zeros({4});
        world().batch_p2p({{P::kRecv, x, 1, t}, {P::kRecv, y, 2, u}}).wait(kWait);
      } else if (rank == 1) {
        world().send(b, 0, t).wait(kWait);
      } else if (rank == 2) {
        world().send(c, 0, u).wait(kWait);
      }
    }
    if (rank == 0) {
      std::vector<at::Tensor> in{at::zeros({4}), at::zeros({4}), at::zeros(shape_u)};
      std::vector<P> ops{{P::kRecv, in[0], 1, t}, {P::kRecv, in[1], 1, t}, {P::kRecv, in[2], 2, u}};
      if (round == 1) ops.erase(ops.begin() + 1);
      world().batch_p2p(ops).wait(kWait);
      EXPECT_TRUE(at::equal(in[0], b));
      if (round == 0) {
        EXPECT_TRUE(at::equal(in[1], b + 1));
      }
      EXPECT_TRUE(at::equal(in.back(), at::full(shape_u, 3.0)));
    } else if (rank == 1) {
      at::Tensor x = at::zeros({4});
      world().recv(x, 2, v).wait(kWait);
      EXPECT_TRUE(at::equal(x, a));
      if (round == 0) {
        world().batch_p2p({{P::kSend, b, 0, t}, {P::kSend, b + 1, 0, t}}).wait(kWait);
      } else {
        world().send(b, 0, t).wait(kWait);
      }
    } else if (rank == 2) {
      world().send(at::full(shape_u, 3.0), 0, u).wait(kWait);
      world().send(a, 1, v).wait(kWait);
    }
    world().barrier().wait();
  }
}

TEST_F(Test, PointToPointMisuseIsRefusedNamingBothRanks) {
  const int rank = world().rank(), size = world().size();
  at::Tensor x = at::zeros({4});
  expect_error([&] { world().send(x, rank); }, "is not another rank");
  expect_error([&] { world().recv(x, size); }, "is not another rank");
  expect_error([&] { world().send(x, (rank + 1) % size, Communicator::kMaxTag + 1); }, "tag");
  expect_error([&] { world().send(at::zeros({4, 4}).t(), (rank + 1) % size); }, "contiguous");
  expect_error([&] { world().batch_p2p({}); }, "no send or receive");
  // A receive into another dtype, then another shape, between ranks 0 and 1 (each on a
  // communicator of their own: the receiver's breaks). The receiver names both ranks.
  for (const auto& [dtype, shape, want] :
       std::vector<std::tuple<at::ScalarType, std::vector<int64_t>, std::string>>{
           {at::kBFloat16,
            {4, 8},
            "rank 0 sent fp32 [4, 8] (tag 2), but rank 1 receives into "
            "bf16 [4, 8]"},
           {at::kFloat,
            {4, 9},
            "rank 0 sent fp32 [4, 8] (tag 2), but rank 1 receives into "
            "fp32 [4, 9]"},
           {at::kFloat, {}, "rank 0 sent fp32 [4, 8] (tag 2), but rank 1 receives into fp32 []"}}) {
    auto pair = world().split(rank < 2 ? 0 : -1, rank);
    if (rank == 0) {
      // Its bytes are never received: the send completes where the transport buffers them
      // (MPI's eager messages) and otherwise times out here, as a pipeline's would.
      try {
        pair->send(at::ones({4, 8}), 1, 2).wait(std::chrono::seconds(1));
      } catch (const TimeoutError&) {
      }
    } else if (rank == 1) {
      expect_error([&] { pair->recv(at::zeros(shape, dtype), 0, 2).wait(); }, want);
      EXPECT_TRUE(pair->is_broken());
    }
    world().barrier().wait();
  }
  // Two messages under one tag in a batch, where the first is refused: the second must not
  // post its bytes, which the refused message's bytes would fill first (Gloo aborts a process
  // sent more than it posted). The receiver gets the first message's error.
  {
    auto pair = world().split(rank < 2 ? 0 : -1, rank);
    if (rank == 0) {
      pair->send(at::ones({4}), 1, 5).wait();
      try {
        pair->batch_p2p({{Communicator::P2POp::kSend, at::ones({16}), 1, 5},
                         {Communicator::P2POp::kSend, at::ones({2}), 1, 5},
                         {Communicator::P2POp::kSend, at::ones({3}), 1, 6}})
            .wait(std::chrono::seconds(1));
      } catch (const TimeoutError&) {
      }
    } else if (rank == 1) {
      at::Tensor first = at::zeros({4});
      pair->recv(first, 0, 5).wait();
      expect_error(
          [&] {
            pair->batch_p2p({{Communicator::P2POp::kRecv, at::zeros({8}), 0, 5},
                             {Communicator::P2POp::kRecv, at::zeros({2}), 0, 5},
                             {Communicator::P2POp::kRecv, at::zeros({3}), 0, 6}})
                .wait();
          },
          "rank 0 sent fp32 [16] (tag 5), but rank 1 receives into fp32 [8]");
      EXPECT_TRUE(pair->is_broken());
    }
    world().barrier().wait();
  }
  // The same after a first message that agreed, when the later message travels with its
  // header: the receiver's tensor changed (the sender sends the first shape), or the
  // sender's (a notice of its shape, its bytes never taken).
  for (const auto& [sent, dtype, shape, want] : std::vector<
           std::tuple<std::vector<int64_t>, at::ScalarType, std::vector<int64_t>, std::string>>{
           {{4, 8},
            at::kBFloat16,
            {4, 8},
            "rank 0 sent fp32 [4, 8] (tag 2), but rank 1 receives into bf16 [4, 8]"},
           {{4, 8},
            at::kFloat,
            {2, 8},
            "rank 0 sent fp32 [4, 8] (tag 2), but rank 1 receives into fp32 [2, 8]"},
           {{4, 9},
            at::kFloat,
            {4, 8},
            "rank 0 sent fp32 [4, 9] (tag 2), but rank 1 receives into fp32 [4, 8]"},
           {{},
            at::kFloat,
            {4, 8},
            "rank 0 sent fp32 [] (tag 2), but rank 1 receives into fp32 [4, 8]"}}) {
    auto pair = world().split(rank < 2 ? 0 : -1, rank);
    if (rank == 0) {
      pair->send(at::ones({4, 8}), 1, 2).wait();
      try {
        pair->send(at::ones(sent), 1, 2).wait(std::chrono::seconds(1));
      } catch (const TimeoutError&) {
      }
    } else if (rank == 1) {
      at::Tensor first = at::zeros({4, 8});
      pair->recv(first, 0, 2).wait();
      EXPECT_TRUE(at::equal(first, at::ones({4, 8})));
      expect_error([&] { pair->recv(at::zeros(shape, dtype), 0, 2).wait(); }, want);
      EXPECT_TRUE(pair->is_broken());
    }
    world().barrier().wait();
  }
}

}  // namespace
}  // namespace dtrain::comm

int main(int argc, char** argv) {
  // Small pieces, so the sizes above cross them (unless the run sets its own).
  setenv("DTRAIN_MPI_CHUNK_KIB", "1024", /*overwrite=*/0);
  return dtrain::testing::multirank_main(argc, argv);
}
