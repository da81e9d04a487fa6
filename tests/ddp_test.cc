// DDP on real ranks (mpirun -np 2 / -np 4, dtrain-launch + Gloo): gradients equal one
// process's full-batch gradients; ranks stay bitwise identical; no_sync, unused parameters,
// reduce dtypes, fp16 overflow, GradScaler skips, mismatches, buffers; a step reads nothing
// back to the host.
#include "sharding/ddp.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "amp/grad_scaler.h"
#include "amp/numerics.h"
#include "core/error.h"
#include "framework/models/mlp.h"
#include "framework/models/transformer_lm.h"
#include "optim/fused.h"
#include "sharding/clip_grad.h"
#include "tests/host_reads.h"
#include "tests/multirank.h"

namespace dtrain::sharding {
namespace {

using dtrain::framework::MLP;
using dtrain::framework::MLPOptions;
using dtrain::framework::TransformerLM;
using dtrain::framework::TransformerLMOptions;
using dtrain::testing::world;
using dtrain::testing::world_ptr;
using Test = dtrain::testing::MultiRankTest;

constexpr int64_t kPerRank = 4;

// The global batch, identical on every rank; each rank trains on its slice.
struct Batch {
  at::Tensor input, target;
  Batch slice(int64_t rank, int64_t per_rank) const {
    return {input.narrow(0, rank * per_rank, per_rank),
            target.narrow(0, rank * per_rank, per_rank)};
  }
};

// Tensors live on dtrain::testing::device(): the CPU, or this rank's GPU in gpu-check.
at::Device dev() { return dtrain::testing::device(); }

Batch mlp_batch(int64_t n, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return {at::randn({n, 16}, gen).to(dev()), at::randint(0, 5, {n}, gen).to(dev())};
}

Batch lm_batch(int64_t n, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return {at::randint(0, 40, {n, 12}, gen).to(dev()), at::randint(0, 40, {n, 12}, gen).to(dev())};
}

at::Tensor mlp_loss(const at::Tensor& logits, const at::Tensor& target) {
  return at::cross_entropy_loss(logits, target);
}

at::Tensor lm_loss(const at::Tensor& logits, const at::Tensor& target) {
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), target.reshape(-1));
}

MLP make_mlp() {
  at::manual_seed(7 + world().rank());  // different on purpose: DDP must broadcast rank 0's
  MLP m(MLPOptions().in_features(16).hidden(32).depth(3).out_features(5));
  m->to(dev());
  return m;
}

TransformerLM make_lm() {
  at::manual_seed(11 + world().rank());
  TransformerLM m(
      TransformerLMOptions().vocab_size(40).seq_len(12).d_model(32).n_layers(2).n_heads(4).d_ff(
          64));
  m->to(dev());
  return m;
}

template <typename M>
void copy_params(M& from, M& to) {
  c10::NoGradGuard g;
  auto src = from->parameters(), dst = to->parameters();
  for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
}

// |a - b| <= rtol (|b| + max |b|): relative to the tensor's scale, since summation order
// differs (per-rank means averaged vs one mean) and near-zero entries have no relative sense.
void expect_close(const at::Tensor& got, const at::Tensor& want, double rtol,
                  const std::string& what) {
  ASSERT_TRUE(got.defined()) << what << ": no gradient";
  at::Tensor g = got.to(at::kDouble), w = want.to(at::kDouble);
  double atol = rtol * w.abs().max().item<double>() + 1e-12;
  at::Tensor err = (g - w).abs() - (rtol * w.abs() + atol);
  EXPECT_LE(err.max().item<double>(), 0.0)
      << what << ": max |diff| " << (g - w).abs().max().item<double>() << " vs max |want| "
      << w.abs().max().item<double>();
}

// Parameter grads after one DDP backward on each rank's slice == one process on the batch.
template <typename M, typename MakeBatch, typename Loss>
void check_equivalence(M (*make)(), MakeBatch make_batch, Loss loss_fn, DDPOptions options,
                       bool set_to_none) {
  const int64_t world_size = world().size(), rank = world().rank();
  DistributedDataParallel<M> ddp(make(), world_ptr(), options);
  M reference = make();
  copy_params(ddp.module(), reference);
  for (int iteration = 0; iteration < 3; ++iteration) {  // iteration 2 runs on rebuilt buckets
    SCOPED_TRACE(::testing::Message() << "iteration " << iteration);
    Batch full = make_batch(world_size * kPerRank, 100 + iteration);
    Batch mine = full.slice(rank, kPerRank);
    ddp.module()->zero_grad(set_to_none);
    reference->zero_grad(true);
    loss_fn(ddp.forward(mine.input), mine.target).backward();
    loss_fn(reference->forward(full.input), full.target).backward();
    auto got = ddp.module()->named_parameters();
    auto want = reference->named_parameters();
    for (size_t i = 0; i < got.size(); ++i) {
      expect_close(got[i].value().grad(), want[i].value().grad(), 1e-5, got[i].key());
    }
  }
}

struct Layout {
  const char* name;
  double cap_mb;
  double first_mb;
};
// One bucket, several, and one per parameter.
const Layout kLayouts[] = {
    {"one", 1000.0, 1000.0}, {"several", 0.004, 0.002}, {"per_param", 1e-9, 1e-9}};

TEST_F(Test, MlpGradientsEqualSingleProcessFullBatchForEveryBucketLayout) {
  for (const auto& l : kLayouts) {
    for (bool none : {true, false}) {
      SCOPED_TRACE(::testing::Message() << l.name << " buckets, set_to_none=" << none);
      check_equivalence<MLP>(make_mlp, mlp_batch, mlp_loss,
                             DDPOptions().bucket_cap_mb(l.cap_mb).first_bucket_mb(l.first_mb),
                             none);
    }
  }
}

TEST_F(Test, TransformerGradientsEqualSingleProcessFullBatchForEveryBucketLayout) {
  for (const auto& l : kLayouts) {
    SCOPED_TRACE(l.name);
    check_equivalence<TransformerLM>(
        make_lm, lm_batch, lm_loss,
        DDPOptions().bucket_cap_mb(l.cap_mb).first_bucket_mb(l.first_mb), true);
  }
}

// Before the first iteration, PyTorch's layout (compute_bucket_assignment_by_size, then the
// buckets reversed): the order of every sum over Gloo depends on it.
TEST_F(Test, BucketsFollowPyTorchsLayoutBeforeTheFirstIteration) {
  MLP m = make_mlp();
  const int64_t n = static_cast<int64_t>(m->parameters().size());
  std::vector<int64_t> all(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) all[static_cast<size_t>(i)] = i;
  // Without find_unused_parameters: one bucket in registration order, whatever the limits.
  for (double cap : {1000.0, 1e-9}) {
    DistributedDataParallel<MLP> ddp(make_mlp(), world_ptr(),
                                     DDPOptions().bucket_cap_mb(cap).first_bucket_mb(cap));
    EXPECT_EQ(ddp.reducer().bucket_indices(), std::vector<std::vector<int64_t>>{all}) << cap;
  }
  // With it: grouped by size in registration order, the last-registered bucket first.
  DistributedDataParallel<MLP> per(
      make_mlp(), world_ptr(),
      DDPOptions().bucket_cap_mb(1e-9).first_bucket_mb(1e-9).find_unused_parameters(true));
  auto b = per.reducer().bucket_indices();
  ASSERT_EQ(static_cast<int64_t>(b.size()), n);
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(b[i], std::vector<int64_t>{n - 1 - i});
  DistributedDataParallel<MLP> several(
      make_mlp(), world_ptr(),
      DDPOptions().bucket_cap_mb(0.004).first_bucket_mb(0.002).find_unused_parameters(true));
  auto s = several.reducer().bucket_indices();
  EXPECT_GT(s.size(), 1u);
  EXPECT_LT(static_cast<int64_t>(s.size()), n);
  EXPECT_EQ(s.back().front(), 0) << "the first-registered parameter's bucket goes last";
  std::vector<int64_t> flat;
  for (auto it = s.rbegin(); it != s.rend(); ++it) flat.insert(flat.end(), it->begin(), it->end());
  EXPECT_EQ(flat, all) << "each bucket in registration order";
}

TEST_F(Test, RanksHoldBitwiseIdenticalParametersAfterSteps) {
  DistributedDataParallel<TransformerLM> ddp(
      make_lm(), world_ptr(), DDPOptions().bucket_cap_mb(0.01).first_bucket_mb(0.005));
  torch::optim::AdamW opt(ddp.parameters(), torch::optim::AdamWOptions(1e-2));
  for (int step = 0; step < 5; ++step) {
    Batch mine = lm_batch(world().size() * kPerRank, 200 + step).slice(world().rank(), kPerRank);
    opt.zero_grad();
    lm_loss(ddp(mine.input), mine.target).backward();
    opt.step();
  }
  std::vector<at::Tensor> flat;
  for (const auto& p : ddp.parameters()) flat.push_back(p.detach().reshape(-1));
  at::Tensor mine = at::cat(flat), theirs = mine.clone();
  world().broadcast(theirs, 0).wait();
  EXPECT_TRUE(at::equal(mine, theirs)) << "parameters diverged from rank 0's";
  EXPECT_GT(ddp.last_stats().buckets, 1);
  EXPECT_GT(ddp.last_stats().comm_seconds, 0.0);
}

TEST_F(Test, NoSyncOverFourMicroBatchesEqualsOneStepOnTheCombinedBatch) {
  const int64_t world_size = world().size(), rank = world().rank();
  DistributedDataParallel<MLP> ddp(make_mlp(), world_ptr(), DDPOptions().bucket_cap_mb(0.004));
  MLP reference = make_mlp();
  copy_params(ddp.module(), reference);
  torch::optim::SGD opt(ddp.parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.1));
  const int kMicro = 4;
  std::vector<Batch> micro;
  for (int m = 0; m < kMicro; ++m) micro.push_back(mlp_batch(world_size * kPerRank, 300 + m));
  opt.zero_grad();
  {
    auto guard = ddp.no_sync();
    for (int m = 0; m < kMicro - 1; ++m) {
      Batch mine = micro[m].slice(rank, kPerRank);
      (mlp_loss(ddp(mine.input), mine.target) / kMicro).backward();
    }
    // Still local: ranks hold different gradients.
    at::Tensor g = ddp.module()->out->weight.grad().clone(), g0 = g.clone();
    world().broadcast(g0, 0).wait();
    if (rank != 0) {
      EXPECT_FALSE(at::equal(g, g0)) << "no_sync must not synchronize";
    }
  }
  Batch last = micro[kMicro - 1].slice(rank, kPerRank);
  (mlp_loss(ddp(last.input), last.target) / kMicro).backward();
  ref_opt.zero_grad();
  for (int m = 0; m < kMicro; ++m) {
    (mlp_loss(reference->forward(micro[m].input), micro[m].target) / kMicro).backward();
  }
  auto got = ddp.module()->named_parameters();
  auto want = reference->named_parameters();
  for (size_t i = 0; i < got.size(); ++i) {
    expect_close(got[i].value().grad(), want[i].value().grad(), 1e-5, got[i].key());
  }
  opt.step();
  ref_opt.step();
  for (size_t i = 0; i < got.size(); ++i) {
    expect_close(got[i].value().detach(), want[i].value().detach(), 1e-5, got[i].key());
  }
}

// `extra` is used only when the input says so, and `dead` never.
class BranchyImpl : public torch::nn::Module {
 public:
  BranchyImpl() {
    body = register_module("body", torch::nn::Linear(6, 4));
    extra = register_module("extra", torch::nn::Linear(6, 4));
    dead = register_module("dead", torch::nn::Linear(6, 4));
  }
  at::Tensor forward(const at::Tensor& x, bool use_extra) {
    at::Tensor y = body->forward(x);
    return use_extra ? y + extra->forward(x) : y;
  }
  torch::nn::Linear body{nullptr}, extra{nullptr}, dead{nullptr};
};
TORCH_MODULE(Branchy);

Branchy make_branchy() {
  at::manual_seed(5);
  Branchy m;
  m->to(dev());
  return m;
}

TEST_F(Test, FindUnusedParametersHandlesLocallyAndGloballyUnusedParameters) {
  const int64_t world_size = world().size(), rank = world().rank();
  DistributedDataParallel<Branchy> ddp(
      make_branchy(), world_ptr(), DDPOptions().find_unused_parameters(true).bucket_cap_mb(1e-9));
  Branchy reference = make_branchy();
  copy_params(ddp.module(), reference);
  for (int iteration = 0; iteration < 2; ++iteration) {
    Batch full = mlp_batch(world_size * kPerRank, 400 + iteration);
    ddp.module()->zero_grad();
    reference->zero_grad();
    // Only rank 0 uses `extra`; nobody uses `dead`.
    at::Tensor x = full.input.narrow(1, 0, 6);
    at::Tensor mine = x.narrow(0, rank * kPerRank, kPerRank);
    ddp.forward(mine, rank == 0).pow(2).mean().backward();
    at::Tensor ref = reference->forward(x, false);
    at::Tensor ref_extra = reference->extra->forward(x.narrow(0, 0, kPerRank));
    // Reference: mean over ranks of each rank's own loss.
    at::Tensor total = at::zeros({}, dev());
    for (int64_t r = 0; r < world_size; ++r) {
      at::Tensor y = ref.narrow(0, r * kPerRank, kPerRank);
      if (r == 0) y = y + ref_extra;
      total = total + y.pow(2).mean();
    }
    (total / world_size).backward();
    expect_close(ddp.module()->body->weight.grad(), reference->body->weight.grad(), 1e-5, "body");
    expect_close(ddp.module()->extra->weight.grad(), reference->extra->weight.grad(), 1e-5,
                 "extra");
    EXPECT_FALSE(ddp.module()->dead->weight.grad().defined())
        << "a parameter no rank used keeps no gradient, as in PyTorch";
  }
}

// A parameter no rank used keeps the gradient it had, its own on each rank, when gradients are
// not bucket views (PyTorch's copy_bucket_to_grad: "if a parameter is globally unused, we keep
// its grad untouched"); the others are averaged.
TEST_F(Test, FindUnusedLeavesAnOldGradientOfAParameterNobodyUsed) {
  const int64_t rank = world().rank();
  DistributedDataParallel<Branchy> ddp(
      make_branchy(), world_ptr(),
      DDPOptions().find_unused_parameters(true).gradient_as_bucket_view(false));
  for (auto& p : ddp.parameters()) p.mutable_grad() = at::full_like(p, rank + 1.0);
  ddp.forward(at::randn({kPerRank, 6}).to(dev()), false).sum().backward();
  EXPECT_TRUE(at::equal(ddp.module()->dead->weight.grad(),
                        at::full_like(ddp.module()->dead->weight, rank + 1.0)));
  at::Tensor body = ddp.module()->body->weight.grad().clone(), body0 = body.clone();
  world().broadcast(body0, 0).wait();
  EXPECT_TRUE(at::equal(body, body0)) << "a used parameter's gradient is averaged";
}

TEST_F(Test, UnusedParameterWithoutFindUnusedRaisesNamingItAtTheNextForward) {
  DistributedDataParallel<Branchy> ddp(make_branchy(), world_ptr(),
                                       DDPOptions().bucket_cap_mb(1e-9));
  at::Tensor x = at::randn({kPerRank, 6}).to(dev());
  ddp.forward(x, true).sum().backward();  // `dead` got no gradient
  {
    // As PyTorch, where the check runs only with gradients enabled: a no_grad forward (a
    // validation pass) in between says nothing.
    at::NoGradGuard no_grad;
    EXPECT_NO_THROW(ddp.forward(x, true));
  }
  try {
    ddp.forward(x, true);
    FAIL() << "no error for an unused parameter";
  } catch (const UsageError& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("dead.weight"), std::string::npos) << what;
    EXPECT_NE(what.find("find_unused_parameters"), std::string::npos) << what;
  }
}

// 16-bit reduce dtypes: within a stated tolerance of the fp32 reduction.
TEST_F(Test, Bf16AndFp16ReduceDtypesStayWithinToleranceOfFp32) {
  for (auto [dtype, rtol] : {std::pair<c10::ScalarType, double>{at::kBFloat16, 2e-2},
                             std::pair<c10::ScalarType, double>{at::kHalf, 2e-3}}) {
    SCOPED_TRACE(c10::toString(dtype));
    DistributedDataParallel<TransformerLM> fp32(make_lm(), world_ptr(), DDPOptions());
    DistributedDataParallel<TransformerLM> low(make_lm(), world_ptr(),
                                               DDPOptions().reduce_dtype(dtype));
    Batch mine = lm_batch(world().size() * kPerRank, 500).slice(world().rank(), kPerRank);
    lm_loss(fp32(mine.input), mine.target).backward();
    lm_loss(low(mine.input), mine.target).backward();
    auto a = fp32.module()->named_parameters(), b = low.module()->named_parameters();
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_EQ(b[i].value().grad().scalar_type(), at::kFloat) << "gradients return to fp32";
      expect_close(b[i].value().grad(), a[i].value().grad(), rtol, b[i].key());
    }
  }
}

class WeightedSumImpl : public torch::nn::Module {
 public:
  WeightedSumImpl() { w = register_parameter("w", at::ones({8})); }
  at::Tensor forward(const at::Tensor& x) { return (w * x).sum(); }
  at::Tensor w;
};
TORCH_MODULE(WeightedSum);

TEST_F(Test, Fp16ReduceOfValuesNearMaxOverWorldDoesNotOverflow) {
  // At one rank the value itself is 1.5 x the fp16 maximum: nothing to divide.
  if (world().size() < 2) GTEST_SKIP() << "needs two ranks (each value is 1.5 x 65504 / world)";
  // Every rank's gradient is 1.5 x 65504 / world: summed undivided it would reach 1.5 x the
  // fp16 maximum and become inf.
  const double v = 1.5 * 65504.0 / world().size();
  WeightedSum m;
  m->to(dev());
  DistributedDataParallel<WeightedSum> ddp(m, world_ptr(), DDPOptions().reduce_dtype(at::kHalf));
  ddp(at::full({8}, v, dev())).backward();
  at::Tensor g = ddp.module()->w.grad();
  EXPECT_TRUE(at::isfinite(g).all().item<bool>()) << g;
  expect_close(g, at::full({8}, v, dev()), 1e-3, "w");
}

TEST_F(Test, GradScalerSkipsOnEveryRankWhenOneRankProducesInf) {
  DistributedDataParallel<MLP> ddp(make_mlp(), world_ptr(), DDPOptions().bucket_cap_mb(0.004));
  torch::optim::SGD opt(ddp.parameters(), torch::optim::SGDOptions(0.1));
  amp::GradScaler scaler(amp::GradScalerOptions().init_scale(256.0).growth_interval(2));
  for (int step = 0; step < 5; ++step) {
    Batch mine = mlp_batch(world().size() * kPerRank, 600 + step).slice(world().rank(), kPerRank);
    opt.zero_grad();
    at::Tensor loss = mlp_loss(ddp(mine.input), mine.target);
    if (step == 2 && world().rank() == world().size() - 1) {
      loss = loss * std::numeric_limits<float>::infinity();
    }
    scaler.scale(loss).backward();
    EXPECT_EQ(scaler.step(opt), step != 2) << "step " << step;
    scaler.update();
    at::Tensor s = at::full({1}, scaler.get_scale(), at::TensorOptions(at::kDouble).device(dev()));
    at::Tensor s0 = s.clone();
    world().broadcast(s0, 0).wait();
    EXPECT_EQ(s.item<double>(), s0.item<double>())
        << "scale differs from rank 0's at step " << step;
  }
}

// check_finite: DDP's verdict from its write-back equals the scaler's own pass, in fp32,
// bf16 and fp16 buckets, for an inf or a NaN in one element of one rank's gradient, in the
// last chunk of a bucket larger than one chunk (the write-back checks 131072 at a time); and a
// fused optimizer stepped with it ends bitwise where the scaler's own check takes it.
TEST_F(Test, CheckFiniteFindsWhatTheScalersOwnCheckFinds) {
  if (dev().is_cuda()) GTEST_SKIP() << "the chunked check reads host buffers";
  for (auto reduce : {std::optional<at::ScalarType>(), std::optional<at::ScalarType>(at::kBFloat16),
                      std::optional<at::ScalarType>(at::kHalf)}) {
    for (double bad :
         {0.0, std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN()}) {
      at::manual_seed(3);
      torch::nn::Linear lin(600, 400);  // 240k weights: two chunks in one bucket
      DistributedDataParallel<torch::nn::Linear> ddp(
          lin, world_ptr(), DDPOptions().reduce_dtype(reduce).check_finite(true));
      const int victim = world().size() - 1;
      if (bad != 0 && world().rank() == victim) {
        ddp.module()->weight.register_hook([bad](at::Tensor g) {
          g = g.clone();
          g.view(-1)[g.numel() - 1] = bad;  // the last element: the last chunk
          return g;
        });
      }
      at::Tensor x = at::randn({4, 600}, at::kFloat);
      ddp(x).pow(2).mean().backward();
      ASSERT_TRUE(ddp.found_inf().defined());
      const bool own = !at::isfinite(ddp.module()->weight.grad()).all().item<bool>() ||
                       !at::isfinite(ddp.module()->bias.grad()).all().item<bool>();
      EXPECT_EQ(ddp.found_inf().item<float>() != 0, own)
          << "reduce " << (reduce ? c10::toString(*reduce) : "fp32") << ", bad " << bad;
      EXPECT_EQ(own, bad != 0) << "the injected value did not survive the reduction";
    }
  }
  // Stepping with the verdict matches stepping with the scaler's own check, bit for bit.
  auto train = [](bool use_verdict) {
    at::manual_seed(5);
    torch::nn::Linear lin(300, 200);
    DistributedDataParallel<torch::nn::Linear> ddp(
        lin, world_ptr(), DDPOptions().reduce_dtype(at::kHalf).check_finite(true));
    optim::AdamW opt(ddp.parameters(), torch::optim::AdamWOptions(1e-2));
    amp::GradScaler scaler(amp::GradScalerOptions().init_scale(65536.0 * 64).growth_interval(2));
    std::vector<bool> stepped;
    for (int step = 0; step < 6; ++step) {
      auto gen =
          at::make_generator<at::CPUGeneratorImpl>(40 + step * world().size() + world().rank());
      at::Tensor x = at::randn({4, 300}, gen) * (step == 0 ? 1e3 : 1.0);  // step 0 overflows
      opt.zero_grad();
      scaler.scale(ddp(x).pow(2).mean()).backward();
      stepped.push_back(use_verdict ? scaler.step(opt, ddp.found_inf()) : scaler.step(opt));
      scaler.update();
    }
    return std::make_pair(stepped, ddp.module()->weight.detach().clone());
  };
  auto [with, w_with] = train(true);
  auto [own, w_own] = train(false);
  EXPECT_EQ(with, own);
  EXPECT_FALSE(own.front()) << "step 0 should overflow fp16 and be skipped";
  EXPECT_TRUE(at::equal(w_with, w_own));
}

// DDPOptions::grad_scaler: DDP unscales and judges the gradients as it writes the reduced
// buckets back, and the scaler takes them as they are. Against the same run where the scaler
// does it all, bit for bit, for fp32, bf16 and fp16 buckets, a fused and a plain optimizer:
//   plain     scale, backward, step (step 0 overflows fp16 and is skipped);
//   twice     two synchronizing backwards before one step (the second forward scales back
//             what the first backward unscaled);
//   unscale   unscale_, an in-place edit of the unscaled gradients, step (the trainer's path);
//   odd       a scale that is not a power of two: DDP leaves the gradients scaled.
// After the first backward the gradients are already unscaled: times the scale, they are
// the other run's, exactly.
TEST_F(Test, GradScalerInDDPUnscalesBitwiseAsTheScalerAlone) {
  if (dev().is_cuda()) GTEST_SKIP() << "DDP unscales CPU buckets only";
  enum Mode { kPlain, kTwice, kUnscale, kOdd };
  struct Run {
    std::vector<bool> stepped;
    at::Tensor weight, first_grad;
  };
  auto train = [](std::optional<at::ScalarType> reduce, bool fused, Mode mode, bool in_ddp) {
    at::manual_seed(5);
    torch::nn::Linear lin(300, 200);
    amp::GradScaler scaler(amp::GradScalerOptions()
                               .init_scale(mode == kOdd ? 3.0e6 : 65536.0 * 64)
                               .growth_interval(2));
    DistributedDataParallel<torch::nn::Linear> ddp(
        lin, world_ptr(),
        DDPOptions().reduce_dtype(reduce).grad_scaler(in_ddp ? &scaler : nullptr));
    std::unique_ptr<torch::optim::Optimizer> opt;
    if (fused) {
      opt = std::make_unique<optim::AdamW>(ddp.parameters(), torch::optim::AdamWOptions(1e-2));
    } else {
      opt = std::make_unique<torch::optim::SGD>(ddp.parameters(), torch::optim::SGDOptions(1e-2));
    }
    Run run;
    for (int step = 0; step < 6; ++step) {
      opt->zero_grad();
      for (int pass = 0; pass < (mode == kTwice ? 2 : 1); ++pass) {
        auto gen = at::make_generator<at::CPUGeneratorImpl>(
            40 + (2 * step + pass) * world().size() + world().rank());
        at::Tensor x = at::randn({4, 300}, gen) * (step == 0 ? 1e3 : 1.0);  // step 0 overflows
        scaler.scale(ddp(x).pow(2).mean()).backward();
      }
      if (step == 1) run.first_grad = ddp.module()->weight.grad().clone();
      if (mode == kUnscale) {
        scaler.unscale_(*opt);
        for (auto& p : ddp.parameters()) p.grad().mul_(0.5);
      }
      run.stepped.push_back(scaler.step(*opt));
      scaler.update();
    }
    run.weight = ddp.module()->weight.detach().clone();
    return std::make_pair(run, scaler.get_scale());
  };
  for (auto reduce : {std::optional<at::ScalarType>(), std::optional<at::ScalarType>(at::kBFloat16),
                      std::optional<at::ScalarType>(at::kHalf)}) {
    for (bool fused : {true, false}) {
      for (Mode mode : {kPlain, kTwice, kUnscale, kOdd}) {
        const std::string what = std::string("reduce ") +
                                 (reduce ? c10::toString(*reduce) : "fp32") +
                                 (fused ? ", fused AdamW" : ", SGD") + ", mode " +
                                 std::to_string(static_cast<int>(mode));
        auto [with, scale_with] = train(reduce, fused, mode, true);
        auto [alone, scale_alone] = train(reduce, fused, mode, false);
        EXPECT_EQ(with.stepped, alone.stepped) << what;
        if (reduce == at::kHalf) {
          EXPECT_FALSE(alone.stepped.front()) << what << ": step 0 should overflow and skip";
        }
        EXPECT_EQ(scale_with, scale_alone) << what;
        EXPECT_TRUE(at::equal(with.weight, alone.weight)) << what;
        // Step 1's gradients, before step(): unscaled by DDP (times the scale of that step,
        // halved if step 0 was skipped, they are the scaled ones), or left alone.
        const double s1 =
            (mode == kOdd ? 3.0e6 : 65536.0 * 64) / (alone.stepped.front() ? 1.0 : 2.0);
        at::Tensor expect = mode == kOdd ? alone.first_grad : alone.first_grad / s1;
        EXPECT_TRUE(at::equal(with.first_grad, expect)) << what;
      }
    }
  }
}

// Nothing in a step reads a value back to the host (tests/host_reads.h; on a GPU each read
// waits for the stream): DDP reducing in fp16 with the GradScaler in its write-back, clipping
// (the norm a tensor), the fused AdamW skipping on the device when step 3 overflows. The
// verdicts, read afterwards, are right on every rank.
TEST_F(Test, AStepReadsNothingBackToTheHost) {
  if (dev().is_cuda() && world().device_type() != c10::kCUDA) {
    GTEST_SKIP() << "Gloo and MPI stage CUDA tensors through the host, which waits by design";
  }
  at::manual_seed(5);
  torch::nn::Linear lin(64, 32);
  lin->to(dev());
  amp::GradScaler scaler(amp::GradScalerOptions().init_scale(1024.0).growth_interval(2));
  DistributedDataParallel<torch::nn::Linear> ddp(
      lin, world_ptr(), DDPOptions().reduce_dtype(at::kHalf).grad_scaler(&scaler));
  optim::AdamW opt(ddp.parameters(), torch::optim::AdamWOptions(1e-2));
  std::vector<at::Tensor> found, norms, inputs;
  // The inputs are on the device before counting starts (a blocking copy from the host is a
  // wait of the test's own).
  for (int step = 0; step < 6; ++step) {
    auto gen =
        at::make_generator<at::CPUGeneratorImpl>(80 + step * world().size() + world().rank());
    inputs.push_back((at::randn({4, 64}, gen) * (step == 3 ? 1e4 : 1.0)).to(dev()));
  }
  dtrain::testing::HostReads reads;
  for (int step = 0; step < 6; ++step) {
    // Counted from step 2: step 1's forward rebuilds the buckets once, in the order rank 0's
    // first backward saw (a broadcast of that order, read back: PyTorch's Reducer does the
    // same once).
    if (step == 2) reads.reset();
    const at::Tensor& x = inputs[step];
    opt.zero_grad();
    scaler.scale(ddp(x).pow(2).mean()).backward();
    scaler.unscale_(opt);
    norms.push_back(clip_grad_norm_tensor_(ddp.parameters(), 1.0));
    found.push_back(scaler.step_deferred(opt));
    scaler.update();
  }
  EXPECT_EQ(reads.reads(), 0) << "values read back to the host in steps 2-5: " << reads.where();
  for (size_t step = 0; step < found.size(); ++step) {
    EXPECT_EQ(found[step].item<double>() != 0, step == 3) << "step " << step;
  }
}

// A gradient that changed after DDP unscaled it (here a backward that bypassed DDP's forward)
// cannot be told apart from a scaled one: step() refuses it instead of unscaling it again.
TEST_F(Test, GradScalerInDDPRefusesAGradientChangedAfterTheWriteBack) {
  if (dev().is_cuda()) GTEST_SKIP() << "DDP unscales CPU buckets only";
  at::manual_seed(6);
  torch::nn::Linear lin(30, 20);
  amp::GradScaler scaler;
  DistributedDataParallel<torch::nn::Linear> ddp(lin, world_ptr(),
                                                 DDPOptions().grad_scaler(&scaler));
  optim::AdamW opt(ddp.parameters(), torch::optim::AdamWOptions(1e-2));
  at::Tensor x = at::randn({4, 30});
  scaler.scale(ddp(x).sum()).backward();
  scaler.scale(ddp.module()->forward(x).sum()).backward();  // not through DDP
  try {
    scaler.step(opt);
    FAIL() << "a gradient changed after DDP unscaled it was accepted";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("forward through the wrapper"), std::string::npos)
        << e.what();
  }
}

TEST_F(Test, MismatchedParametersRaiseNamingTheFirstDifference) {
  if (world().size() < 2) GTEST_SKIP() << "needs two ranks to differ";
  at::manual_seed(3);
  MLP m(
      MLPOptions().in_features(16).hidden(world().rank() == 0 ? 32 : 33).depth(2).out_features(5));
  m->to(dev());
  try {
    DistributedDataParallel<MLP> ddp(m, world_ptr());
    FAIL() << "mismatched models accepted";
  } catch (const UsageError& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("layers.0.weight"), std::string::npos) << what;
    EXPECT_NE(what.find("on rank 1"), std::string::npos) << what;
    EXPECT_NE(what.find("[32, 16]"), std::string::npos) << what;
  }
}

class WithBufferImpl : public torch::nn::Module {
 public:
  WithBufferImpl() {
    lin = register_module("lin", torch::nn::Linear(3, 3));
    stat = register_buffer("stat", at::zeros({2}));
  }
  at::Tensor forward(const at::Tensor& x) { return lin->forward(x) + stat.sum(); }
  torch::nn::Linear lin{nullptr};
  at::Tensor stat;
};
TORCH_MODULE(WithBuffer);

TEST_F(Test, ParametersAndBuffersComeFromRankZero) {
  at::manual_seed(100 + world().rank());
  WithBuffer m;
  m->to(dev());
  m->stat.fill_(world().rank() + 1);
  DistributedDataParallel<WithBuffer> ddp(m, world_ptr());
  EXPECT_EQ(ddp.module()->stat[0].item<float>(), 1.0f) << "construction broadcasts buffers";
  at::Tensor w = ddp.module()->lin->weight.detach().clone(), w0 = w.clone();
  world().broadcast(w0, 0).wait();
  EXPECT_TRUE(at::equal(w, w0));
  ddp.module()->stat.fill_(world().rank() + 10);
  ddp(at::ones({1, 3}, dev()));
  EXPECT_EQ(ddp.module()->stat[1].item<float>(), 10.0f) << "the first forward broadcasts buffers";

  // broadcast_buffers(false): each rank keeps its own, at construction too (PyTorch's
  // init_sync_buffers); the parameters still come from rank 0.
  WithBuffer own;
  own->to(dev());
  own->stat.fill_(world().rank() + 1);
  DistributedDataParallel<WithBuffer> local(own, world_ptr(),
                                            DDPOptions().broadcast_buffers(false));
  EXPECT_EQ(local.module()->stat[0].item<float>(), world().rank() + 1.0f);
  local(at::ones({1, 3}, dev()));
  EXPECT_EQ(local.module()->stat[1].item<float>(), world().rank() + 1.0f);
  at::Tensor v = local.module()->lin->weight.detach().clone(), v0 = v.clone();
  world().broadcast(v0, 0).wait();
  EXPECT_TRUE(at::equal(v, v0));
}

// Layers registered a, b, c, d but applied d, c, b, a: gradients arrive a first.
class ReversedImpl : public torch::nn::Module {
 public:
  ReversedImpl() {
    for (const char* n : {"a", "b", "c", "d"})
      layers.push_back(register_module(n, torch::nn::Linear(5, 5)));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = x;
    for (auto it = layers.rbegin(); it != layers.rend(); ++it) h = (*it)->forward(h);
    return h;
  }
  std::vector<torch::nn::Linear> layers;
};
TORCH_MODULE(Reversed);

TEST_F(Test, BucketsAreRebuiltInArrivalOrderAfterTheFirstIteration) {
  at::manual_seed(2);
  Reversed m;
  m->to(dev());
  DistributedDataParallel<Reversed> ddp(m, world_ptr(),
                                        DDPOptions().bucket_cap_mb(1e-9).first_bucket_mb(1e-9));
  // Before, as PyTorch's DDP: one bucket (per dtype/device) in registration order, whatever
  // the size limits, unless unused parameters are searched for.
  const std::vector<std::vector<int64_t>> before{{0, 1, 2, 3, 4, 5, 6, 7}};
  EXPECT_EQ(ddp.reducer().bucket_indices(), before);
  at::Tensor x = at::randn({2, 5}).to(dev());
  ddp(x).sum().backward();
  ddp(x).sum().backward();  // this forward rebuilt the buckets
  auto rebuilt = ddp.reducer().bucket_indices();
  ASSERT_EQ(rebuilt.size(), 8u);
  // a (indices 0, 1) is applied last, so its gradients arrive first.
  EXPECT_LT(rebuilt.front().front(), 2)
      << "first bucket holds parameter #" << rebuilt.front().front();
  EXPECT_GE(rebuilt.back().front(), 6) << "last bucket holds parameter #" << rebuilt.back().front();
  // A resumed run builds the same buckets at once from the order a checkpoint kept.
  DistributedDataParallel<Reversed> resumed(m, world_ptr(),
                                            DDPOptions().bucket_cap_mb(1e-9).first_bucket_mb(1e-9));
  resumed.reducer().restore_rebuilt_order(ddp.reducer().rebuilt_order());
  EXPECT_EQ(resumed.reducer().bucket_indices(), rebuilt);
  resumed.reducer().restore_rebuilt_order({0, 1});  // another model's: ignored
  EXPECT_EQ(resumed.reducer().bucket_indices(), rebuilt);
}

// Rebuilt with PyTorch's two first-bucket rules: the first bucket small (the default), or the
// last one (small_last_bucket, PyTorch's DDP_SET_LAST_BUCKET_CAP=1).
TEST_F(Test, RebuiltBucketsKeepTheFirstOrTheLastOneSmall) {
  for (bool last : {false, true}) {
    SCOPED_TRACE(::testing::Message() << "small_last_bucket " << last);
    at::manual_seed(2);
    Reversed m;
    m->to(dev());
    DistributedDataParallel<Reversed> ddp(
        m, world_ptr(),
        DDPOptions().bucket_cap_mb(1000).first_bucket_mb(1e-9).small_last_bucket(last));
    at::Tensor x = at::randn({2, 5}).to(dev());
    ddp(x).sum().backward();
    ddp(x).sum().backward();  // rebuilt
    auto rebuilt = ddp.reducer().bucket_indices();
    ASSERT_EQ(rebuilt.size(), 2u);
    // a's parameters (0, 1) arrive first and d's (6, 7) last.
    if (last) {
      ASSERT_EQ(rebuilt.back().size(), 1u);
      EXPECT_GE(rebuilt.back().front(), 6);
      EXPECT_LT(rebuilt.front().back(), 2) << "the rest in reverse arrival order, as PyTorch";
    } else {
      ASSERT_EQ(rebuilt.front().size(), 1u);
      EXPECT_LT(rebuilt.front().front(), 2);
      EXPECT_GE(rebuilt.back().back(), 6);
    }
  }
}

TEST_F(Test, NumericsMonitorRecordsEveryReducedBucket) {
  amp::NumericsMonitor monitor(true);
  DistributedDataParallel<MLP> ddp(
      make_mlp(), world_ptr(),
      DDPOptions().bucket_cap_mb(0.004).first_bucket_mb(0.002).monitor(&monitor));
  monitor.begin_step(0);
  Batch mine = mlp_batch(world().size() * kPerRank, 700).slice(world().rank(), kPerRank);
  mlp_loss(ddp(mine.input), mine.target).backward();
  ASSERT_EQ(monitor.records().size(), ddp.reducer().bucket_indices().size());
  EXPECT_EQ(monitor.records().front().first, "ddp.bucket0.grad");
  EXPECT_FALSE(monitor.first_nonfinite_unit().has_value());
}

}  // namespace
}  // namespace dtrain::sharding

int main(int argc, char** argv) { return dtrain::testing::multirank_main(argc, argv); }
