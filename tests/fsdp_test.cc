// FSDP on real ranks (mpirun -np 2/3/4, dtrain-launch + Gloo): every strategy holds DDP's
// parameters after AdamW steps (TransformerLM with tied weights, MLP, sizes that do not
// divide by the world size); the mixed-precision policy's fields take effect; the
// ShardedGradScaler skips on every rank; clipping over shards; no_sync; unused parameters;
// memory: sharded state is 1/N and gathered buffers are released; a step reads nothing back to
// the host.
#include "sharding/fsdp.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <limits>
#include <map>
#include <optional>

#include "amp/sharded_grad_scaler.h"
#include "core/error.h"
#include "framework/memory.h"
#include "framework/models/llama.h"
#include "framework/models/mlp.h"
#include "framework/models/transformer_lm.h"
#include "optim/fused.h"
#include "sharding/clip_grad.h"
#include "sharding/ddp.h"
#include "tests/host_reads.h"
#include "tests/multirank.h"

namespace dtrain::sharding {
namespace {

using dtrain::framework::MLP;
using dtrain::framework::MLPOptions;
using dtrain::framework::TrackedCpuMemory;
using dtrain::framework::TransformerLM;
using dtrain::framework::TransformerLMOptions;
using dtrain::testing::world;
using dtrain::testing::world_ptr;
using Test = dtrain::testing::MultiRankTest;

constexpr int64_t kPerRank = 3;

at::Device dev() { return dtrain::testing::device(); }

struct Batch {
  at::Tensor input, target;
  Batch slice(int64_t rank, int64_t per_rank) const {
    return {input.narrow(0, rank * per_rank, per_rank),
            target.narrow(0, rank * per_rank, per_rank)};
  }
};

// The kinds of model the equivalence runs on.
enum class Kind { kLm, kMlp, kOdd };
const char* kind_name(Kind k) { return k == Kind::kLm ? "lm" : k == Kind::kMlp ? "mlp" : "odd"; }

Batch batch_for(Kind k, int64_t n, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  if (k == Kind::kLm) {
    return {at::randint(0, 40, {n, 10}, gen).to(dev()), at::randint(0, 40, {n, 10}, gen).to(dev())};
  }
  const int64_t in = k == Kind::kMlp ? 16 : 7;
  return {at::randn({n, in}, gen).to(dev()), at::randint(0, 5, {n}, gen).to(dev())};
}

at::Tensor loss_of(const at::Tensor& out, const at::Tensor& target) {
  at::Tensor o = out.to(at::kFloat);
  if (o.dim() == 3) return at::cross_entropy_loss(o.reshape({-1, o.size(-1)}), target.reshape(-1));
  return at::cross_entropy_loss(o, target);
}

// Rank-dependent seeds on purpose: DDP and FSDP must both start from rank 0's values.
TransformerLM make_lm(int64_t layers = 2, int64_t d_model = 24) {
  at::manual_seed(11 + world().rank());
  TransformerLM m(TransformerLMOptions()
                      .vocab_size(40)
                      .seq_len(10)
                      .d_model(d_model)
                      .n_layers(layers)
                      .n_heads(4)
                      .d_ff(2 * d_model)
                      .tie_weights(true));
  m->to(dev());
  return m;
}

MLP make_mlp(Kind k) {
  at::manual_seed(7 + world().rank());
  // kOdd: 7x13 + 13 + 13x13 + 13 + ... parameters: no size divides by 2, 3 or 4.
  MLP m(k == Kind::kMlp ? MLPOptions().in_features(16).hidden(32).depth(3).out_features(5)
                        : MLPOptions().in_features(7).hidden(13).depth(3).out_features(5));
  m->to(dev());
  return m;
}

// |a - b| <= rtol (|b| + max |b|): relative to the tensor's scale, as in ddp_test.
void expect_close(const at::Tensor& got, const at::Tensor& want, double rtol,
                  const std::string& what) {
  ASSERT_TRUE(got.defined()) << what;
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  at::Tensor g = got.to(at::kDouble).cpu(), w = want.to(at::kDouble).cpu();
  double atol = rtol * w.abs().max().item<double>() + 1e-12;
  at::Tensor err = (g - w).abs() - (rtol * w.abs() + atol);
  EXPECT_LE(err.max().item<double>(), 0.0)
      << what << ": max |diff| " << (g - w).abs().max().item<double>() << " vs max |want| "
      << w.abs().max().item<double>();
}

std::vector<ShardingStrategy> strategies() {
  std::vector<ShardingStrategy> s{ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                                  ShardingStrategy::kNoShard};
  if (world().size() % 2 == 0) s.push_back(ShardingStrategy::kHybridShard);  // groups of 2
  return s;
}

FSDPOptions options_for(ShardingStrategy s) {
  return FSDPOptions().sharding_strategy(s).hybrid_group_size(2);
}

// AdamW as in the equivalence runs. eps 1e-4 rather than 1e-8: the attention's key bias has
// an exactly zero gradient (softmax ignores a shift shared by a row's logits), so what DDP
// and FSDP compute for it is rounding noise of ~1e-10 in different summation orders, which
// Adam with eps 1e-8 would turn into updates of ~lr / 10 with random signs.
torch::optim::AdamWOptions adamw() { return torch::optim::AdamWOptions(1e-2).eps(1e-4); }

// K AdamW steps under DDP and under FSDP from the same start on the same data.
template <typename M>
void check_against_ddp(Kind kind, M (*make)(), ShardingStrategy strategy, int steps,
                       double clip = 0) {
  SCOPED_TRACE(::testing::Message() << kind_name(kind) << " " << to_string(strategy));
  const int64_t world_size = world().size(), rank = world().rank();
  DistributedDataParallel<M> ddp(make(), world_ptr());
  FullyShardedDataParallel<M> fsdp(make(), world_ptr(), options_for(strategy));
  torch::optim::AdamW ddp_opt(ddp.parameters(), adamw());
  torch::optim::AdamW fsdp_opt(fsdp.parameters(), adamw());
  for (int step = 0; step < steps; ++step) {
    Batch mine = batch_for(kind, world_size * kPerRank, 100 + step).slice(rank, kPerRank);
    ddp_opt.zero_grad();
    fsdp_opt.zero_grad();
    loss_of(ddp(mine.input), mine.target).backward();
    loss_of(fsdp(mine.input), mine.target).backward();
    if (clip > 0) {
      double a = clip_grad_norm_(ddp.parameters(), clip);
      double b = fsdp.clip_grad_norm_(clip);
      EXPECT_NEAR(b, a, 1e-5 * a) << "total gradient norm, step " << step;
    }
    ddp_opt.step();
    fsdp_opt.step();
  }
  std::map<std::string, at::Tensor> want;
  for (const auto& item : ddp.module()->named_parameters()) want[item.key()] = item.value();
  auto got = fsdp.state().full_parameters();
  EXPECT_EQ(got.size(), want.size());
  for (const auto& [name, t] : got) {
    ASSERT_TRUE(want.count(name)) << "FSDP parameter '" << name << "' is not the module's";
    expect_close(t, want[name], 1e-5, name);
  }
}

TEST_F(Test, EveryStrategyHoldsDdpParametersAfterAdamWSteps) {
  for (auto s : strategies()) {
    check_against_ddp<TransformerLM>(
        Kind::kLm, [] { return make_lm(); }, s, 3);
    check_against_ddp<MLP>(
        Kind::kMlp, [] { return make_mlp(Kind::kMlp); }, s, 3);
    check_against_ddp<MLP>(
        Kind::kOdd, [] { return make_mlp(Kind::kOdd); }, s, 3);
  }
}

TEST_F(Test, ClipGradNormOverShardsEqualsTheFullGradientNorm) {
  for (auto s : {ShardingStrategy::kFullShard, ShardingStrategy::kNoShard}) {
    check_against_ddp<TransformerLM>(
        Kind::kLm, [] { return make_lm(); }, s, 2, /*clip=*/0.05);
  }
}

TEST_F(Test, ParameterNamesAreTheUnwrappedModulesAndTiedWeightsAppearOnce) {
  TransformerLM plain = make_lm();
  std::vector<std::string> names;
  for (const auto& item : plain->named_parameters()) names.push_back(item.key());
  FullyShardedDataParallel<TransformerLM> fsdp(make_lm(), world_ptr());
  std::vector<std::string> got;
  int64_t mine = 0;
  for (const auto& [name, t] : fsdp.named_parameters()) {
    got.push_back(name);
    mine += t.numel();
  }
  EXPECT_EQ(got, names);
  // Sharded as fully_shard shards: rank r holds chunk r of every parameter cut on dim 0
  // (torch.chunk: ceil(dim0 / N) rows each, none where there are fewer chunks than ranks).
  int64_t want = 0;
  for (const auto& n : names) {
    const at::Tensor t = plain->named_parameters()[n];
    const auto chunks = (t.dim() == 0 ? t.reshape({1}) : t).chunk(world().size(), 0);
    if (world().rank() < static_cast<int>(chunks.size())) want += chunks[world().rank()].numel();
  }
  EXPECT_EQ(mine, want);
  const int64_t units = static_cast<int64_t>(fsdp.state().units().size());
  // Two blocks and the root (embeddings, final norm; the head is the tied embedding).
  EXPECT_EQ(units, 3);
}

TEST_F(Test, FullShardReshardsAfterForwardAndShardGradOpKeepsUnitsUntilBackward) {
  if (world().size() < 2) GTEST_SKIP() << "one rank holds every unit whole: nothing to reshard";
  for (auto s : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp}) {
    SCOPED_TRACE(to_string(s));
    FullyShardedDataParallel<TransformerLM> fsdp(make_lm(4), world_ptr(),
                                                 options_for(s).limit_all_gathers(2));
    Batch b = batch_for(Kind::kLm, kPerRank, 7);
    at::Tensor loss = loss_of(fsdp(b.input), b.target);
    const auto& units = fsdp.state().units();
    for (size_t u = 0; u + 1 < units.size(); ++u) {
      const bool sharded = units[u]->state() == FlatUnit::State::kSharded;
      EXPECT_EQ(sharded, s == ShardingStrategy::kFullShard) << units[u]->name();
      for (const auto& p : units[u]->params()) {
        EXPECT_EQ(p.module_param.numel() == 0, sharded) << p.name;
      }
    }
    loss.backward();
    for (const auto& u : units) {
      EXPECT_EQ(u->state(), FlatUnit::State::kSharded) << u->name() << " after backward";
    }
    if (world().size() > 1 && s == ShardingStrategy::kFullShard) {
      EXPECT_LE(fsdp.state().peak_gathered_units(), 2) << "limit_all_gathers";
    }
  }
}

TEST_F(Test, NoSyncAccumulationMatchesDdp) {
  const int64_t world_size = world().size(), rank = world().rank();
  DistributedDataParallel<MLP> ddp(make_mlp(Kind::kMlp), world_ptr());
  FullyShardedDataParallel<MLP> fsdp(make_mlp(Kind::kMlp), world_ptr());
  torch::optim::SGD ddp_opt(ddp.parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD fsdp_opt(fsdp.parameters(), torch::optim::SGDOptions(0.1));
  for (int m = 0; m < 3; ++m) {
    Batch mine = batch_for(Kind::kMlp, world_size * kPerRank, 300 + m).slice(rank, kPerRank);
    std::optional<NoSyncGuard> a, b;
    if (m < 2) {
      a.emplace(ddp.no_sync());
      b.emplace(fsdp.no_sync());
    }
    (loss_of(ddp(mine.input), mine.target) / 3).backward();
    (loss_of(fsdp(mine.input), mine.target) / 3).backward();
    if (m < 2) {
      for (const auto& p : fsdp.parameters()) {
        EXPECT_FALSE(p.grad().defined()) << "no_sync must not reduce";
      }
    }
  }
  ddp_opt.step();
  fsdp_opt.step();
  std::map<std::string, at::Tensor> want;
  for (const auto& item : ddp.module()->named_parameters()) want[item.key()] = item.value();
  for (const auto& [name, t] : fsdp.state().full_parameters())
    expect_close(t, want[name], 1e-5, name);
}

// `extra` is used only on rank 0; `dead` never.
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

class TwoBranchyImpl : public torch::nn::Module {
 public:
  TwoBranchyImpl() {
    first = register_module("first", Unit<BranchyImpl>());
    head = register_module("head", torch::nn::Linear(4, 6));
    second = register_module("second", Unit<BranchyImpl>());
  }
  at::Tensor forward(const at::Tensor& x, bool use_extra) {
    return second->forward(head->forward(first->forward(x, use_extra)), false);
  }
  Unit<BranchyImpl> first{nullptr}, second{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(TwoBranchy);

TwoBranchy make_branchy() {
  at::manual_seed(5 + world().rank());
  TwoBranchy m;
  m->to(dev());
  return m;
}

TEST_F(Test, UnusedParametersReduceZerosWithoutDesynchronizingTheRanks) {
  const int64_t world_size = world().size(), rank = world().rank();
  DistributedDataParallel<TwoBranchy> ddp(make_branchy(), world_ptr(),
                                          DDPOptions().find_unused_parameters(true));
  FullyShardedDataParallel<TwoBranchy> fsdp(make_branchy(), world_ptr());
  torch::optim::SGD ddp_opt(ddp.parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD fsdp_opt(fsdp.parameters(), torch::optim::SGDOptions(0.1));
  for (int step = 0; step < 2; ++step) {
    Batch mine = batch_for(Kind::kOdd, world_size * kPerRank, 400 + step).slice(rank, kPerRank);
    at::Tensor x = mine.input.narrow(1, 0, 6);
    ddp_opt.zero_grad();
    fsdp_opt.zero_grad();
    ddp.forward(x, rank == 0).pow(2).mean().backward();
    fsdp.forward(x, rank == 0).pow(2).mean().backward();
    ddp_opt.step();
    fsdp_opt.step();
  }
  std::map<std::string, at::Tensor> want;
  for (const auto& item : ddp.module()->named_parameters()) want[item.key()] = item.value();
  for (const auto& [name, t] : fsdp.state().full_parameters())
    expect_close(t, want[name], 1e-5, name);
}

// A wrap point that records what its forward saw.
class ProbeImpl : public torch::nn::Module {
 public:
  ProbeImpl() {
    lin = register_module("lin", torch::nn::Linear(4, 4));
    stat = register_buffer("stat", at::zeros({3}));
  }
  at::Tensor forward(const at::Tensor& x) {
    seen_input = x.scalar_type();
    seen_param = lin->weight.scalar_type();
    return lin->forward(x.to(seen_param));  // an fp32 input meets bf16 weights otherwise
  }
  torch::nn::Linear lin{nullptr};
  at::Tensor stat;
  c10::ScalarType seen_input = at::kFloat, seen_param = at::kFloat;
};

class ProbeModelImpl : public torch::nn::Module {
 public:
  ProbeModelImpl() {
    probe = register_module("probe", Unit<ProbeImpl>());
    out = register_module("out", torch::nn::Linear(4, 2));
  }
  // The root hands the unit an fp32 tensor whatever the input's dtype.
  at::Tensor forward(const at::Tensor& x) { return out->forward(probe->forward(x.to(at::kFloat))); }
  Unit<ProbeImpl> probe{nullptr};
  torch::nn::Linear out{nullptr};
};
TORCH_MODULE(ProbeModel);

TEST_F(Test, EveryMixedPrecisionFieldTakesEffect) {
  auto run = [&](amp::MixedPrecisionPolicy mp) {
    at::manual_seed(3);
    ProbeModel m;
    m->to(dev());
    auto fsdp = std::make_unique<FullyShardedDataParallel<ProbeModel>>(
        m, world_ptr(), FSDPOptions().mixed_precision(mp));
    at::Tensor out = (*fsdp)(at::randn({2, 4}, dev()));
    out.to(at::kFloat).sum().backward();
    return std::make_pair(std::move(fsdp), out);
  };
  auto bf16 = amp::MixedPrecisionPolicy::bf16();
  {
    auto [fsdp, out] = run(bf16);
    auto& probe = *fsdp->module()->probe;
    EXPECT_EQ(probe.seen_param, at::kBFloat16) << "param_dtype";
    EXPECT_EQ(probe.seen_input, at::kFloat) << "cast_forward_inputs is off";
    EXPECT_EQ(out.scalar_type(), at::kBFloat16) << "no output_dtype";
    EXPECT_EQ(probe.stat.scalar_type(), at::kBFloat16) << "buffer_dtype";
    for (const auto& p : fsdp->parameters()) {
      EXPECT_EQ(p.scalar_type(), at::kFloat) << "masters stay fp32";
      EXPECT_EQ(p.grad().scalar_type(), at::kFloat) << "gradients upcast for the optimizer";
    }
  }
  {
    auto mp = bf16;
    mp.output_dtype = at::kFloat;
    mp.cast_forward_inputs = true;
    mp.keep_low_precision_grads = true;
    auto [fsdp, out] = run(mp);
    EXPECT_EQ(out.scalar_type(), at::kFloat) << "output_dtype";
    EXPECT_EQ(fsdp->module()->probe->seen_input, at::kBFloat16) << "cast_forward_inputs";
    for (const auto& p : fsdp->parameters()) {
      EXPECT_EQ(p.grad().scalar_type(), at::kBFloat16) << "keep_low_precision_grads";
    }
    // The fused optimizers step a parameter with a gradient of its dtype (as PyTorch's fused
    // kernels): built on these masters they refuse at once, naming both settings.
    for (int which : {0, 1}) {
      try {
        if (which == 0) {
          optim::AdamW opt(fsdp->parameters(), torch::optim::AdamWOptions(1e-3));
        } else {
          optim::SGD opt(fsdp->parameters(), torch::optim::SGDOptions(1e-3));
        }
        ADD_FAILURE() << "a fused optimizer accepted masters with bf16 gradients";
      } catch (const UsageError& e) {
        const std::string what = e.what();
        EXPECT_NE(what.find("keep_low_precision_grads"), std::string::npos) << what;
        EXPECT_NE(what.find("fused kernel"), std::string::npos) << what;
      }
    }
  }
  {
    auto mp = bf16;
    mp.reduce_dtype = at::kFloat;
    mp.buffer_dtype = std::nullopt;
    auto [fsdp, out] = run(mp);
    EXPECT_EQ(fsdp->module()->probe->stat.scalar_type(), at::kFloat) << "buffers left as they are";
    for (const auto& p : fsdp->parameters()) EXPECT_EQ(p.grad().scalar_type(), at::kFloat);
  }
}

// An inf in this rank's first non-empty gradient shard.
void put_inf_in_a_gradient(FullyShardedDataParallel<MLP>& fsdp) {
  for (const auto& p : fsdp.parameters()) {
    if (p.numel() > 0) {
      c10::NoGradGuard g;
      p.grad().view({-1})[0].fill_(std::numeric_limits<float>::infinity());
      return;
    }
  }
}

TEST_F(Test, Fp16InfOnOneRanksShardMakesEveryRankSkipWithEqualScales) {
  FullyShardedDataParallel<MLP> fsdp(
      make_mlp(Kind::kMlp), world_ptr(),
      FSDPOptions().mixed_precision(amp::MixedPrecisionPolicy::fp16()));
  torch::optim::SGD opt(fsdp.parameters(), torch::optim::SGDOptions(0.1));
  amp::ShardedGradScaler scaler(world_ptr(),
                                amp::GradScalerOptions().init_scale(1024.0).growth_interval(2));
  for (int step = 0; step < 5; ++step) {
    Batch mine = batch_for(Kind::kMlp, world().size() * kPerRank, 600 + step)
                     .slice(world().rank(), kPerRank);
    opt.zero_grad();
    scaler.scale(loss_of(fsdp(mine.input), mine.target)).backward();
    if (step == 2 && world().rank() == world().size() - 1) put_inf_in_a_gradient(fsdp);
    EXPECT_EQ(scaler.step(opt), step != 2) << "step " << step;
    scaler.update();
    at::Tensor s =
        at::full({1}, scaler.get_scale(), at::TensorOptions(at::kDouble).device(world().device()));
    at::Tensor s0 = s.clone();
    world().broadcast(s0, 0).wait();
    EXPECT_EQ(s.item<double>(), s0.item<double>())
        << "scale differs from rank 0's at step " << step;
  }
}

// Nothing in a step reads a value back to the host (tests/host_reads.h; on a GPU each read
// waits for the stream): fp16 units, the ShardedGradScaler's verdict agreed over the ranks,
// clipping over the shards (the norm a tensor), the fused AdamW skipping on the device, with an
// inf on one rank's shard at step 2. The verdicts, read afterwards, are right on every rank.
TEST_F(Test, AStepReadsNothingBackToTheHost) {
  if (dev().is_cuda() && world().device_type() != c10::kCUDA) {
    GTEST_SKIP() << "Gloo and MPI stage CUDA tensors through the host, which waits by design";
  }
  FullyShardedDataParallel<MLP> fsdp(
      make_mlp(Kind::kMlp), world_ptr(),
      FSDPOptions().mixed_precision(amp::MixedPrecisionPolicy::fp16()));
  optim::AdamW opt(fsdp.parameters(), adamw());
  amp::ShardedGradScaler scaler(world_ptr(),
                                amp::GradScalerOptions().init_scale(1024.0).growth_interval(2));
  std::vector<at::Tensor> found, norms;
  // The batches are on the device before counting starts (a blocking copy from the host is
  // a wait of the test's own).
  std::vector<Batch> batches;
  for (int step = 0; step < 5; ++step) {
    batches.push_back(batch_for(Kind::kMlp, world().size() * kPerRank, 700 + step)
                          .slice(world().rank(), kPerRank));
  }
  dtrain::testing::HostReads reads;
  for (int step = 0; step < 5; ++step) {
    if (step == 1) reads.reset();  // the first step's setup aside
    const Batch& mine = batches[step];
    opt.zero_grad();
    scaler.scale(loss_of(fsdp(mine.input), mine.target)).backward();
    if (step == 2 && world().rank() == world().size() - 1) put_inf_in_a_gradient(fsdp);
    scaler.unscale_(opt);
    norms.push_back(
        clip_grad_norm_tensor_(fsdp.parameters(), 1.0, 2.0, fsdp.state().shard_group()));
    found.push_back(scaler.step_deferred(opt));
    scaler.update();
  }
  EXPECT_EQ(reads.reads(), 0) << "values read back to the host in steps 1-4: " << reads.where();
  for (size_t step = 0; step < found.size(); ++step) {
    EXPECT_EQ(found[step].item<double>() != 0, step == 2) << "step " << step;
    EXPECT_EQ(std::isfinite(norms[step].item<double>()), step != 2) << "step " << step;
  }
}

// Tracked memory over a step of an FSDP TransformerLM of `layers` blocks: `steady` at the
// step's start (shards of the parameters, gradients and AdamW state, pooled buffers) and
// `overhead`, the peak during the step above it.
struct StepMemory {
  int64_t steady = 0;
  int64_t overhead = 0;
};

StepMemory step_memory(int64_t layers) {
  FullyShardedDataParallel<TransformerLM> fsdp(make_lm(layers, 64), world_ptr(),
                                               FSDPOptions().limit_all_gathers(2));
  torch::optim::AdamW opt(fsdp.parameters(), torch::optim::AdamWOptions(1e-3));
  StepMemory m;
  for (int step = 0; step < 3; ++step) {
    Batch b = batch_for(Kind::kLm, 1, 900 + step);
    b.input = b.input.narrow(1, 0, 2);
    b.target = b.target.narrow(1, 0, 2);
    const int64_t steady = TrackedCpuMemory::current_bytes();
    TrackedCpuMemory::reset_peak();
    opt.zero_grad();
    loss_of(fsdp(b.input), b.target).backward();
    opt.step();
    if (step == 2) m = {steady, TrackedCpuMemory::peak_bytes() - steady};
  }
  return m;
}

TEST_F(Test, GatheredParametersAreReleasedSoThePeakDoesNotGrowWithUnits) {
  if (dev().is_cuda()) GTEST_SKIP() << "tracks CPU tensor memory";
  ASSERT_TRUE(TrackedCpuMemory::installed());
  int64_t block = 0;  // one block of d_model 64: ~33k parameters, ~134 kB in fp32
  for (const auto& p : make_lm(1, 64)->blocks[0]->parameters()) block += p.nbytes();
  const StepMemory two = step_memory(2);
  const StepMemory eight = step_memory(8);
  const std::string seen =
      "two blocks: " + std::to_string(two.steady) + " B steady + " + std::to_string(two.overhead) +
      " B in the step; eight: " + std::to_string(eight.steady) + " + " +
      std::to_string(eight.overhead) + " B; one block: " + std::to_string(block) + " B";
  // Between steps each rank holds 1/n of every block's parameters, gradients and two AdamW
  // moments: six more blocks add 6 * 4/n blocks. Kept gathered, they would add six whole
  // blocks more; the bound lies halfway.
  const int n = world().size();
  EXPECT_LT(eight.steady - two.steady, 6 * block * 4 / n + 3 * block) << seen;
  // During the step at most limit_all_gathers blocks are gathered and two gradient buffers
  // are out at once whatever the depth. Whether a collective's buffer returns to the pool
  // before the next is taken depends on the comm thread's timing, which is worth up to one
  // block here (a block and a half under load, before collectives let go of their tensors
  // before completing). Kept gathered until the step ends, the six more blocks would add six.
  EXPECT_LT(eight.overhead - two.overhead, 3 * block) << seen;
}

// The optimizer in backward (FSDPState::set_step_in_backward) steps each unit as its gradients
// are reduced: after three steps (the second with two micro-batches, the first under no_sync)
// every strategy holds bitwise the parameters of the same model stepped after backward, with
// the same fused AdamW and the same gradient norm; and no gradient shard is left when backward
// returns, where the step after backward holds all of them then.
TEST_F(Test, TheOptimizerInBackwardStepsEachUnitAsTheStepAfterBackwardWould) {
  struct Run {
    FullyShardedDataParallel<TransformerLM> fsdp;
    optim::AdamW opt;
    std::map<const c10::TensorImpl*, at::Tensor> norms;
    int64_t after_backward = 0;  // tracked bytes when the last backward returned
    Run(ShardingStrategy s, int64_t layers, int64_t d_model)
        : fsdp(make_lm(layers, d_model), world_ptr(), options_for(s).limit_all_gathers(2)),
          opt(fsdp.parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.01)) {}
    void in_backward() {
      fsdp.state().set_step_in_backward([this](const std::vector<at::Tensor>& ps) {
        for (const auto& p : ps) norms[p.unsafeGetTensorImpl()] = local_grad_norm(p);
        opt.step_only(ps);
      });
    }
    // One step of `micro` micro-batches; the gradient norm, from the gradients or the norms
    // recorded as each unit was stepped.
    at::Tensor step(int64_t step, int64_t micro, int64_t tokens, bool in_backward) {
      opt.zero_grad();
      for (int64_t m = 0; m < micro; ++m) {
        Batch b = batch_for(Kind::kLm, world().size() * kPerRank, 500 + 10 * step + m)
                      .slice(world().rank(), kPerRank);
        std::optional<NoSyncGuard> local;
        if (m + 1 < micro) local.emplace(fsdp.no_sync());
        (loss_of(fsdp(b.input.narrow(1, 0, tokens)), b.target.narrow(1, 0, tokens)) /
         static_cast<double>(micro))
            .backward();
      }
      after_backward = TrackedCpuMemory::current_bytes();
      at::Tensor norm;
      if (in_backward) {
        std::vector<at::Tensor> ordered;
        for (const auto& p : fsdp.parameters()) {
          EXPECT_FALSE(p.grad().defined()) << "a gradient outlived its unit's step";
          auto it = norms.find(p.unsafeGetTensorImpl());
          ordered.push_back(it == norms.end() ? at::Tensor() : it->second);
        }
        norms.clear();
        norm = norm_of_grad_norms(ordered, 2.0, fsdp.state().shard_group());
      } else {
        norm = grad_norm(fsdp.parameters(), 2.0, fsdp.state().shard_group());
      }
      opt.step();  // finds no gradient after the steps in backward
      return norm;
    }
  };
  for (auto s : strategies()) {
    SCOPED_TRACE(to_string(s));
    Run after(s, 3, 24), during(s, 3, 24);
    during.in_backward();
    for (int64_t step = 0; step < 3; ++step) {
      const int64_t micro = step == 1 ? 2 : 1;
      const at::Tensor a = after.step(step, micro, 10, false);
      const at::Tensor b = during.step(step, micro, 10, true);
      EXPECT_TRUE(at::equal(a, b)) << "gradient norm, step " << step << ": " << a.item<double>()
                                   << " vs " << b.item<double>();
    }
    const auto want = after.fsdp.state().full_parameters();
    const auto got = during.fsdp.state().full_parameters();
    ASSERT_EQ(got.size(), want.size());
    for (size_t k = 0; k < got.size(); ++k) {
      EXPECT_TRUE(at::equal(got[k].second, want[k].second)) << got[k].first;
    }
  }
  if (dev().is_cuda()) return;  // the rest counts CPU tensor memory
  // Memory: 8 blocks of d_model 64 (~33k parameters each), 2 tokens.
  struct Bytes {
    int64_t peak = 0, after_backward = 0, shards = 0;
  };
  auto measure = [&](bool in_backward) {
    const int64_t base = TrackedCpuMemory::current_bytes();
    Run r(ShardingStrategy::kFullShard, 8, 64);
    if (in_backward) r.in_backward();
    Bytes b;
    for (const auto& p : r.fsdp.parameters()) b.shards += p.nbytes();
    for (int64_t step = 0; step < 3; ++step) {
      TrackedCpuMemory::reset_peak();
      r.step(step, 1, 2, in_backward);
      // The model, its state and the step.
      b.peak = TrackedCpuMemory::peak_bytes() - base;
      b.after_backward = r.after_backward - base;
    }
    return b;
  };
  const Bytes after = measure(false), during = measure(true);
  const std::string seen = "stepping in backward: peak " + std::to_string(during.peak) + " B, " +
                           std::to_string(during.after_backward) +
                           " B when backward returned; after it: " + std::to_string(after.peak) +
                           " and " + std::to_string(after.after_backward) +
                           " B; the parameter shards are " + std::to_string(after.shards) + " B";
  // The gradient shards take at least the parameter shards' bytes (padding aside). The peaks
  // are printed, not compared: in a model this small they are the gathered and reduced
  // buffers, whose return to the pool depends on the comm threads' timing (at 4 ranks the
  // shards are 270 kB and the peaks move by more than that).
  EXPECT_GE(after.after_backward - during.after_backward, after.shards * 9 / 10) << seen;
  std::printf("optimizer in backward, %d ranks: %s\n", world().size(), seen.c_str());
}

// A step that throws inside backward (the optimizer in backward's callback, on its second unit,
// on every rank) ends that backward; the next forward abandons it. What the units not stepped
// received must not survive into the next step: the masters hold no gradient afterwards.
TEST_F(Test, AStepThatThrowsInBackwardLeavesNoGradientBehind) {
  for (auto s : strategies()) {
    SCOPED_TRACE(to_string(s));
    FullyShardedDataParallel<TransformerLM> fsdp(make_lm(3, 24), world_ptr(), options_for(s));
    optim::AdamW opt(fsdp.parameters(), torch::optim::AdamWOptions(1e-2));
    int calls = 0;
    fsdp.state().set_step_in_backward([&](const std::vector<at::Tensor>& ps) {
      if (++calls == 2) throw std::runtime_error("the optimizer failed");
      opt.step_only(ps);
    });
    Batch b = batch_for(Kind::kLm, world().size() * kPerRank, 900).slice(world().rank(), kPerRank);
    EXPECT_THROW(loss_of(fsdp(b.input), b.target).backward(), std::exception);
    EXPECT_GE(calls, 2);
    fsdp(b.input);  // the next forward abandons it
    for (const auto& p : fsdp.parameters()) {
      EXPECT_FALSE(p.grad().defined()) << "a gradient of the aborted backward was left";
    }
  }
}

// Deferred initialization: a TransformerLM built with placeholders and initialized by FSDP
// unit by unit holds, on every rank, the shards of the same model built eagerly under the same
// seed, and computes the same logits; building it peaks at one unit plus the shards.
TEST_F(Test, DeferredInitHoldsTheEagerModelsShardsAndPeaksAtOneUnit) {
  if (dev().is_cuda()) GTEST_SKIP() << "tracks CPU tensor memory";
  const auto o =
      TransformerLMOptions().vocab_size(40).seq_len(10).d_model(32).n_layers(12).n_heads(4).d_ff(
          64);
  const int n = world().size();
  int64_t model = 0, block = 0;
  {
    at::manual_seed(1);
    TransformerLM probe(o);
    for (const auto& p : probe->parameters()) model += p.nbytes();
    for (const auto& p : probe->blocks[0]->parameters()) block += p.nbytes();
  }
  for (ShardLayout layout : {ShardLayout::kPerParameter, ShardLayout::kFlat}) {
    SCOPED_TRACE(layout == ShardLayout::kFlat ? "flat" : "per_parameter");
    const auto fo = FSDPOptions().shard_layout(layout);
    at::manual_seed(21);  // the same seed on every rank: no broadcast needed for either
    TransformerLM eager_lm(o);
    FullyShardedDataParallel<TransformerLM> eager(eager_lm, world_ptr(),
                                                  FSDPOptions(fo).sync_module_states(false));

    const int64_t before = TrackedCpuMemory::current_bytes();
    TrackedCpuMemory::reset_peak();
    at::manual_seed(21);
    TransformerLM lazy_lm(TransformerLMOptions(o).deferred_init(true));
    int64_t held = 0;
    for (const auto& p : lazy_lm->parameters()) {
      EXPECT_TRUE(p.numel() <= 1 || is_placeholder(p));
      held += p.has_storage() ? static_cast<int64_t>(p.storage().nbytes()) : 0;
    }
    EXPECT_LT(held, 1024) << "a deferred model holds memory";
    // Without the initializer, FSDP and DDP refuse the placeholders rather than read them.
    EXPECT_THROW(FullyShardedDataParallel<TransformerLM>(
                     TransformerLM(TransformerLMOptions(o).deferred_init(true)), world_ptr(), fo),
                 UsageError);
    EXPECT_THROW(DistributedDataParallel<TransformerLM>(
                     TransformerLM(TransformerLMOptions(o).deferred_init(true)), world_ptr()),
                 UsageError);
    FullyShardedDataParallel<TransformerLM> lazy(
        lazy_lm, world_ptr(),
        FSDPOptions(fo).sync_module_states(false).param_init(lazy_lm->param_init()));
    const int64_t peak = TrackedCpuMemory::peak_bytes() - before;
    const int64_t shards = TrackedCpuMemory::current_bytes() - before;

    const auto want = eager.named_parameters(), got = lazy.named_parameters();
    ASSERT_EQ(want.size(), got.size());
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ(want[i].first, got[i].first);
      EXPECT_TRUE(at::equal(want[i].second, got[i].second)) << want[i].first;
    }
    Batch b = batch_for(Kind::kLm, 2, 77);
    c10::NoGradGuard no_grad;
    EXPECT_TRUE(at::equal(eager(b.input), lazy(b.input)));
    // The shards (1/n of the model, padded) and one unit's fp32 buffer at a time; built eagerly,
    // the whole model (`model` bytes) would be held first. The root (embeddings, final norm)
    // is the largest unit here.
    const std::string seen = "peak " + std::to_string(peak) + " B, held after " +
                             std::to_string(shards) + " B; model " + std::to_string(model) +
                             " B, one block " + std::to_string(block) + " B";
    EXPECT_LT(shards, model / n + 2 * block) << seen;
    EXPECT_LT(peak, model / n + 4 * block) << seen;
    EXPECT_LT(peak, model) << seen;
  }
}

// The Llama decoder (grouped-query attention, no biases, RMSNorm) under FSDP with its layers
// as units: built deferred, its shards are the eager build's bit for bit, and its logits and
// gradients are those of the plain model in one process.
TEST_F(Test, LlamaUnderFsdpFromADeferredBuildMatchesThePlainModel) {
  const auto o = dtrain::framework::LlamaOptions()
                     .vocab_size(50)
                     .hidden_size(24)
                     .intermediate_size(40)
                     .num_hidden_layers(3)
                     .num_attention_heads(4)
                     .num_key_value_heads(2)
                     .max_position_embeddings(16);
  using dtrain::framework::LlamaForCausalLM;
  at::manual_seed(31);
  LlamaForCausalLM plain(o);
  at::manual_seed(31);
  LlamaForCausalLM eager_lm(o);
  at::manual_seed(31);
  LlamaForCausalLM lazy_lm(dtrain::framework::LlamaOptions(o).deferred_init(true));
  eager_lm->to(dev());
  dtrain::sharding::defer_parameters(*lazy_lm, dev());  // as the trainer places them
  const auto fo = FSDPOptions().sync_module_states(false).auto_wrap(
      AutoWrapPolicy().module_types({"LlamaDecoderLayer"}));
  FullyShardedDataParallel<LlamaForCausalLM> eager(eager_lm, world_ptr(), fo);
  FullyShardedDataParallel<LlamaForCausalLM> lazy(
      lazy_lm, world_ptr(), FSDPOptions(fo).param_init(lazy_lm->param_init()));
  EXPECT_EQ(lazy.state().units().size(), 4u);  // three layers and the root
  const auto want = eager.named_parameters(), got = lazy.named_parameters();
  ASSERT_EQ(want.size(), got.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_TRUE(at::equal(want[i].second, got[i].second)) << want[i].first;
  }
  // Every rank computes the whole batch, so FSDP's averaged gradients are the plain model's.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  at::Tensor tokens = at::randint(0, 50, {2, 9}, gen).to(dev());
  plain->to(dev());
  auto loss_of = [&](const at::Tensor& logits) {
    return at::cross_entropy_loss(logits.narrow(1, 0, 8).reshape({-1, 50}),
                                  tokens.narrow(1, 1, 8).reshape(-1));
  };
  at::Tensor ref = plain->forward(tokens);
  loss_of(ref).backward();
  at::Tensor out = lazy(tokens);
  expect_close(out, ref, 1e-6, "logits");
  loss_of(out).backward();
  std::map<std::string, at::Tensor> grads;
  for (const auto& p : plain->named_parameters()) grads[p.key()] = p.value().grad();
  // The gradient shards gathered back into full gradients (all parameters train here).
  std::vector<at::Tensor> parts;
  const auto all = lazy.state().all_parameters();
  for (const auto& [name, master] : all) parts.push_back(master.grad());
  const std::vector<at::Tensor> full = lazy.state().gather_full(parts);
  for (size_t k = 0; k < all.size(); ++k) {
    expect_close(full[k], grads.at(all[k].first), 1e-5, all[k].first + " grad");
  }
}

}  // namespace
}  // namespace dtrain::sharding

int main(int argc, char** argv) {
  dtrain::framework::TrackedCpuMemory::install();  // before any tensor is allocated
  return dtrain::testing::multirank_main(argc, argv);
}
