// The module zoo: FSDP (every strategy) and DDP against one process, gradient by gradient,
// on models built from the patterns real models have:
//   - a unit called more than once in a forward, interleaved with others (weight sharing);
//   - a forward under NoGradGuard before, between (forward ... backward) or after;
//   - no_sync accumulation where a parameter is used in early micro-batches but not the last;
//   - 0-dim parameters (a learnable gain, a temperature);
//   - units returning std::pair/std::optional and a user struct (for_each_tensor);
//   - frozen parameters, and units whose parameters are all frozen;
//   - buffers of float, double, bfloat16, int64 and bool dtype, changed by every forward;
//   - a column-wise then row-wise Linear pair in every block (an MLP), which tensor
//     parallelism slices (sharding/tensor_parallel_plan.h): whole without it.
// Every rank also trains the same model alone, on the whole batch (the reference); after each
// step the ranks' averaged gradients, then the parameters and buffers, must equal it. Then
// the trained model is checkpointed (FSDP: sharded and full; DDP: full) and restored into a
// fresh one, whose parameters and buffers must equal the reference's bit for bit. And every
// FSDP strategy with the optimizer in backward must end with bitwise the parameters and
// buffers of the same strategy stepped after backward.
//
// Tensor parallelism (ZooTest.TensorParallel...): the same patterns on a mesh of data-parallel
// x tp ranks, each block's MLP pair sliced over the tp group, under FSDP (and the optimizer in
// backward) and DDP over the data-parallel group: the gradients, gathered over both dimensions,
// and the trained parameters equal one process's, and a full checkpoint comes back bitwise.
//
// Named tests pin one pattern each; ZooTest.RandomModels draws models from seeds
// (DTRAIN_ZOO_SEEDS=first:count, default a fixed set; scripts/zoo runs random ones).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "framework/checkpoint/checkpointer.h"
#include "framework/config.h"
#include "sharding/ddp.h"
#include "sharding/fsdp.h"
#include "sharding/mesh.h"
#include "sharding/recompute.h"
#include "sharding/tensor_parallel_plan.h"
#include "tests/multirank.h"

namespace dtrain::sharding {
namespace {

using dtrain::testing::world;
using dtrain::testing::world_ptr;
using Test = dtrain::testing::MultiRankTest;

constexpr int64_t kIn = 5, kClasses = 4, kPerRank = 3;
// The MLP pair's inner width: divisible by every tp degree tried (1 to 4, and 8).
constexpr int64_t kMlp = 24;

// How a model of the zoo is made and trained.
struct ZooSpec {
  int64_t width = 6;
  int64_t blocks = 3;
  std::vector<int64_t> calls = {0, 1, 2};  // block indices, in forward order (repeats: reuse)
  std::vector<int> frozen = {0, 0, 0};     // per block: 0 none, 1 weight frozen, 2 all frozen
  int64_t sometimes_unused = -1;           // this block's `extra` runs in all but the last micro
  bool extra_unused = false;               // no block runs `extra`: unused in every backward
  bool recompute = false;                  // blocks recompute their forward in backward
  int64_t skipped_in_last = -1;            // this block does not run in the last micro-batch
  int nograd = 0;                          // no-grad forward: 0 none, 1 before, 2 between, 3 after
  int64_t micro_batches = 1;
  int64_t steps = 3;
  std::string describe() const {
    std::ostringstream os;
    os << "width " << width << ", calls [";
    for (size_t i = 0; i < calls.size(); ++i) os << (i ? " " : "") << calls[i];
    os << "], frozen [";
    for (size_t i = 0; i < frozen.size(); ++i) os << (i ? " " : "") << frozen[i];
    os << "], sometimes_unused " << sometimes_unused << ", skipped_in_last " << skipped_in_last
       << ", nograd " << nograd << ", micro " << micro_batches
       << (extra_unused ? ", extra unused" : "") << (recompute ? ", recompute" : "");
    return os.str();
  }
};

ZooSpec random_spec(uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto pick = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  ZooSpec s;
  s.width = pick(3, 8);
  s.blocks = pick(2, 4);
  s.calls.clear();
  for (int64_t b = 0; b < s.blocks; ++b) s.calls.push_back(b);
  for (int64_t r = pick(0, 2); r > 0; --r) {
    s.calls.insert(s.calls.begin() + pick(0, static_cast<int64_t>(s.calls.size())),
                   pick(0, s.blocks - 1));
  }
  s.frozen.clear();
  for (int64_t b = 0; b < s.blocks; ++b) {
    const int64_t f = pick(0, 9);
    s.frozen.push_back(f < 6 ? 0 : f < 8 ? 1 : 2);
  }
  s.sometimes_unused = pick(-1, s.blocks - 1);
  s.skipped_in_last = pick(-s.blocks, s.blocks - 1);  // none half of the time
  s.nograd = static_cast<int>(pick(0, 3));
  s.micro_batches = pick(1, 3);
  s.recompute = pick(0, 1) == 1;
  return s;
}

// What one block computes, shared by both wrap-point types.
class BlockBase : public torch::nn::Module {
 public:
  BlockBase(int64_t width, int frozen, bool recompute) : recompute_(recompute) {
    lin = register_module("lin", torch::nn::Linear(width, width));
    extra = register_module("extra", torch::nn::Linear(width, width));
    up = register_module("up", torch::nn::Linear(width, kMlp));      // tp: colwise
    down = register_module("down", torch::nn::Linear(kMlp, width));  // tp: rowwise
    gain = register_parameter("gain", at::full({}, 1.0));            // 0-dim
    running = register_buffer("running", at::zeros({width}));
    count = register_buffer("count", at::zeros({}, at::kLong));
    flag = register_buffer("flag", at::zeros({2}, at::kBool));
    wide = register_buffer("wide", at::full({3}, 0.1, at::kDouble));
    half = register_buffer("half", at::full({width}, 0.3, at::kBFloat16));
    if (frozen >= 1) {
      lin->weight.requires_grad_(false);
      down->weight.requires_grad_(false);  // a frozen slice: its input's gradient still flows
    }
    if (frozen >= 2) {
      for (auto& p : parameters()) p.requires_grad_(false);
    }
  }

 protected:
  std::pair<at::Tensor, at::Tensor> compute(const at::Tensor& x, bool use_extra) {
    {
      at::NoGradGuard no_grad;  // buffers change with every forward, as BatchNorm's do
      running.mul_(0.5).add_(0.125);
      count.add_(1);
      flag.logical_not_();
      wide.mul_(1.5).add_(1.0 / 3);
      half.mul_(0.75).add_(0.0625);
    }
    auto region = [this, use_extra](const std::vector<at::Tensor>& in) {
      at::Tensor y = at::tanh(lin(in[0]) * gain + in[1]);
      y = y + mlp(y);
      if (use_extra) y = y + 0.5 * at::sigmoid(extra(y));
      return std::vector<at::Tensor>{in[0] + y, (y * y).mean()};
    };
    if (!recompute_) {
      auto out = region({x, running});
      return {out[0], out[1]};
    }
    // The buffer as this call read it: a later call (reuse) changes it before the recompute.
    std::vector<at::Tensor> params = lin->parameters();
    for (const auto& p : up->parameters()) params.push_back(p);
    for (const auto& p : down->parameters()) params.push_back(p);
    params.push_back(gain);
    if (use_extra) {
      for (const auto& p : extra->parameters()) params.push_back(p);
    }
    auto out = recompute(region, {x, running.clone()}, params);
    return {out[0], out[1]};
  }

  // up then down, through the tensor-parallel styles when the block is sliced.
  at::Tensor mlp(const at::Tensor& y) {
    if (tp == nullptr) return down(at::relu(up(y)));
    return tp->linear(at::relu(tp->linear(y, up->weight, up->bias)), down->weight, down->bias);
  }

  bool recompute_ = false;

 public:
  torch::nn::Linear lin{nullptr}, extra{nullptr}, up{nullptr}, down{nullptr};
  at::Tensor gain, running, count, flag, wide, half;
  std::shared_ptr<const TensorParallelism> tp;  // set by ZooNetImpl::parallelize
};

// A user struct holding tensors: found through its for_each_tensor.
struct BlockOut {
  at::Tensor hidden;
  std::map<std::string, at::Tensor> aux;
  template <typename F>
  void for_each_tensor(F&& f) {
    f(hidden);
    for (auto& kv : aux) f(kv.second);
  }
};

class StructBlockImpl : public BlockBase {
 public:
  using BlockBase::BlockBase;
  BlockOut forward(const at::Tensor& x, bool use_extra) {
    auto [h, aux] = compute(x, use_extra);
    return {h, {{"energy", aux}}};
  }
};

class PairBlockImpl : public BlockBase {
 public:
  using BlockBase::BlockBase;
  std::pair<at::Tensor, std::optional<at::Tensor>> forward(const at::Tensor& x, bool use_extra) {
    auto [h, aux] = compute(x, use_extra);
    return {h, aux};
  }
};

class ZooNetImpl : public torch::nn::Module {
 public:
  explicit ZooNetImpl(const ZooSpec& spec) : spec_(spec) {
    inp = register_module("inp", torch::nn::Linear(kIn, spec.width));
    for (int64_t b = 0; b < spec.blocks; ++b) {
      const std::string name = "blocks" + std::to_string(b);
      if (b % 2 == 0) {
        structs.emplace_back(spec.width, spec.frozen[b], spec.recompute);
        register_module(name, structs.back());
      } else {
        pairs.emplace_back(spec.width, spec.frozen[b], spec.recompute);
        register_module(name, pairs.back());
      }
    }
    head = register_module("head", torch::nn::Linear(spec.width, kClasses));
    temperature = register_parameter("temperature", at::full({}, 0.75));  // 0-dim, the root's
    steps = register_buffer("steps", at::zeros({}, at::kInt));
  }

  // Logits and the blocks' auxiliary term. `last_micro`: the sometimes-unused block skips.
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& x, bool last_micro) {
    {
      at::NoGradGuard no_grad;
      steps.add_(1);
    }
    at::Tensor h = inp(x);
    at::Tensor aux = at::zeros({}, h.options());
    for (int64_t b : spec_.calls) {
      if (b == spec_.skipped_in_last && last_micro) continue;
      const bool use_extra = !spec_.extra_unused && !(b == spec_.sometimes_unused && last_micro);
      if (b % 2 == 0) {
        BlockOut o = structs[b / 2]->forward(h, use_extra);
        h = o.hidden;
        aux = aux + o.aux.at("energy");
      } else {
        auto [hidden, energy] = pairs[b / 2]->forward(h, use_extra);
        h = hidden;
        aux = aux + *energy;
      }
    }
    return {head(h) * temperature, aux};
  }

  // Slices every block's MLP pair over `tp`'s group (before a strategy wraps the net).
  void parallelize(const std::shared_ptr<TensorParallelism>& tp) {
    tp->apply(*this, {{"*.up", Style::kColwise}, {"*.down", Style::kRowwise}});
    for (auto& b : structs) b->tp = tp;
    for (auto& b : pairs) b->tp = tp;
  }

  ZooSpec spec_;
  torch::nn::Linear inp{nullptr}, head{nullptr};
  std::vector<Unit<StructBlockImpl>> structs;
  std::vector<Unit<PairBlockImpl>> pairs;
  at::Tensor temperature, steps;
};
TORCH_MODULE(ZooNet);

ZooNet make_net(const ZooSpec& spec) {
  at::manual_seed(2024);
  return ZooNet(spec);
}

at::Tensor loss_of(const std::pair<at::Tensor, at::Tensor>& out, const at::Tensor& target) {
  return at::cross_entropy_loss(out.first, target) + 0.1 * out.second;
}

struct Batch {
  at::Tensor x, y;
};

// Step s, micro-batch m: the whole batch (every rank's rows).
Batch batch(int64_t step, int64_t micro, int64_t rows) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + 10 * step + micro);
  return {at::randn({rows, kIn}, gen), at::randint(0, kClasses, {rows}, gen)};
}

// One optimizer step's forwards and backwards for any wrapped or plain model. `forward` runs
// the model on (x, last_micro); `rows(b)` picks this process's rows of the whole batch.
template <typename Forward, typename Rows, typename NoSync>
void train_step(const ZooSpec& spec, int64_t step, int64_t total_rows, Forward&& forward,
                Rows&& rows, NoSync&& no_sync) {
  auto nograd_forward = [&] {
    at::NoGradGuard no_grad;
    Batch b = rows(batch(step, 99, total_rows));
    forward(b.x, false);
  };
  if (spec.nograd == 1) nograd_forward();
  for (int64_t m = 0; m < spec.micro_batches; ++m) {
    const bool last = m + 1 == spec.micro_batches;
    Batch b = rows(batch(step, m, total_rows));
    [[maybe_unused]] auto guard = no_sync(last);  // held through the backward
    at::Tensor loss = loss_of(forward(b.x, last), b.y) / static_cast<double>(spec.micro_batches);
    if (spec.nograd == 2) nograd_forward();
    loss.backward();
  }
  if (spec.nograd == 3) nograd_forward();
}

void expect_close(const std::string& what, const at::Tensor& got, const at::Tensor& want) {
  if (!got.defined() && !want.defined()) return;  // no gradient on either side
  at::Tensor g = got.defined() ? got : at::zeros_like(want);
  at::Tensor w = want.defined() ? want : at::zeros_like(g);
  ASSERT_EQ(g.sizes(), w.sizes()) << what;
  const double diff = (g.to(at::kDouble) - w.to(at::kDouble)).abs().max().item<double>();
  const double scale = w.to(at::kDouble).abs().max().item<double>();
  EXPECT_LE(diff, 1e-5 + 1e-4 * scale)
      << what << ": max |difference| " << diff << " (reference max |value| " << scale << ")";
}

void expect_equal_buffers(const std::string& what, torch::nn::Module& got,
                          torch::nn::Module& want) {
  auto g = got.named_buffers();
  auto w = want.named_buffers();
  ASSERT_EQ(g.size(), w.size()) << what;
  for (const auto& item : w) {
    const at::Tensor& b = g[item.key()];
    EXPECT_TRUE(b.dtype() == item.value().dtype() && at::equal(b, item.value()))
        << what << ": buffer " << item.key() << " differs from one process's";
  }
}

void sgd_step(const std::vector<at::Tensor>& params, double lr) {
  at::NoGradGuard no_grad;
  for (const auto& p : params) {
    if (p.grad().defined()) p.sub_(p.grad(), lr);
  }
}

void zero_grad(const std::vector<at::Tensor>& params) {
  for (auto p : params) p.mutable_grad().reset();
}

// The reference: one process, the whole batch, no recompute.
ZooSpec without_recompute(ZooSpec spec) {
  spec.recompute = false;
  return spec;
}

struct Reference {
  ZooNet net;
  explicit Reference(const ZooSpec& spec) : net(make_net(without_recompute(spec))) {}
  void step(const ZooSpec& spec, int64_t step, int64_t total_rows) {
    zero_grad(net->parameters());
    train_step(
        spec, step, total_rows, [&](const at::Tensor& x, bool last) { return net(x, last); },
        [](Batch b) { return b; }, [](bool) { return 0; });
  }
};

const double kLr = 0.1;

// A directory every rank sees (rank 0 makes it and broadcasts its name), one per checkpoint.
std::string shared_checkpoint_dir() {
  static std::string root;
  static int count = 0;
  if (root.empty()) {
    at::Tensor buf = at::zeros({256}, at::kByte);
    if (world().rank() == 0) {
      char tmpl[] = "/tmp/dtrain_zoo_XXXXXX";
      const char* made = mkdtemp(tmpl);
      EXPECT_NE(made, nullptr);
      std::memcpy(buf.data_ptr(), tmpl, std::strlen(tmpl));
    }
    world().broadcast(buf, 0).wait();
    root = reinterpret_cast<const char*>(buf.data_ptr());
  }
  return root + "/ckpt" + std::to_string(count++);
}

// Saves `parts` and restores the checkpoint into `fresh` (a model built anew).
void round_trip(const framework::CheckpointParts& parts, const framework::CheckpointParts& fresh,
                const std::string& strategy, const std::string& format) {
  framework::RunConfig config;
  config.parallel.strategy = *choice_from_name<framework::ParallelStrategy>(strategy);
  config.checkpoint.dir = shared_checkpoint_dir();
  config.checkpoint.format = *choice_from_name<framework::CheckpointFormat>(format);
  framework::Checkpointer writer(config);
  const std::string saved = writer.save(parts, framework::TrainerProgress{1, 0, kLr});
  framework::Checkpointer reader(config);
  ASSERT_TRUE(reader.restore(fresh, saved).has_value()) << saved;
  world().barrier().wait();
  if (world().rank() == 0) std::filesystem::remove_all(config.checkpoint.dir);
}

// A no_sync guard for every micro-batch but the last.
template <typename Model>
std::optional<NoSyncGuard> no_sync_unless(bool last, Model& model) {
  std::optional<NoSyncGuard> guard;
  if (!last) guard.emplace(model.no_sync());
  return guard;
}

// This rank's rows of a batch that holds every rank's.
Batch my_rows(const Batch& b) {
  const int64_t r = world().rank();
  return Batch{b.x.narrow(0, r * kPerRank, kPerRank), b.y.narrow(0, r * kPerRank, kPerRank)};
}

// Trains `model` (DDP or FSDP) on this rank's rows beside the reference on all of them, for
// spec.steps steps: after each step's backward, compare_grads(step), then SGD on both.
// `rows` picks this rank's rows of the whole batch of `total` (default: the world's ranks').
template <typename Model, typename CompareGrads>
void train_beside(const ZooSpec& spec, Model& model, Reference& ref, CompareGrads&& compare_grads,
                  int64_t total = world().size() * kPerRank,
                  const std::function<Batch(const Batch&)>& rows = my_rows) {
  for (int64_t s = 0; s < spec.steps; ++s) {
    ref.step(spec, s, total);
    zero_grad(model.parameters());
    train_step(
        spec, s, total, [&](const at::Tensor& x, bool last) { return model(x, last); }, rows,
        [&](bool last) { return no_sync_unless(last, model); });
    compare_grads(s);
    sgd_step(model.parameters(), kLr);
    sgd_step(ref.net->parameters(), kLr);
  }
}

void check_fsdp(const ZooSpec& spec, FSDPOptions options, const std::string& label) {
  SCOPED_TRACE(label + " | " + spec.describe());
  Reference ref(spec);
  FullyShardedDataParallel<ZooNet> model(make_net(spec), world_ptr(), options);
  train_beside(spec, model, ref, [&](int64_t s) {
    // Gradients: every rank's shards gathered into full tensors, against the reference's.
    auto masters = model.state().all_parameters();
    std::vector<at::Tensor> grads;
    for (const auto& m : masters) grads.push_back(m.second.grad());
    auto full = model.state().gather_full(grads);
    auto ref_params = ref.net->named_parameters();
    for (size_t k = 0; k < masters.size(); ++k) {
      const at::Tensor& want = ref_params[masters[k].first];
      if (!want.requires_grad()) {
        EXPECT_FALSE(masters[k].second.grad().defined()) << "frozen " << masters[k].first;
        continue;
      }
      expect_close("step " + std::to_string(s) + " gradient of " + masters[k].first, full[k],
                   want.grad());
    }
  });
  auto params = model.state().full_parameters();
  auto ref_params = ref.net->named_parameters();
  for (const auto& [name, value] : params) {
    expect_close("final parameter " + name, value, ref_params[name]);
  }
  expect_equal_buffers("FSDP", *model.module(), *ref.net);
  for (const char* format : {"sharded", "full"}) {
    FullyShardedDataParallel<ZooNet> fresh(make_net(spec), world_ptr(), options);
    round_trip({model.module().ptr().get(), &model.state(), nullptr, nullptr, nullptr, &world()},
               {fresh.module().ptr().get(), &fresh.state(), nullptr, nullptr, nullptr, &world()},
               "fsdp", format);
    auto restored = fresh.state().full_parameters();
    for (size_t k = 0; k < params.size(); ++k) {
      EXPECT_TRUE(at::equal(restored[k].second, params[k].second))
          << format << " checkpoint: parameter " << params[k].first << " did not come back";
    }
    expect_equal_buffers(std::string("FSDP after a ") + format + " checkpoint", *fresh.module(),
                         *ref.net);
  }
}

void check_ddp(const ZooSpec& spec, const std::string& label) {
  SCOPED_TRACE(label + " | " + spec.describe());
  Reference ref(spec);
  DistributedDataParallel<ZooNet> model(make_net(spec), world_ptr(),
                                        DDPOptions().find_unused_parameters(true));
  train_beside(spec, model, ref, [&](int64_t s) {
    auto ref_params = ref.net->named_parameters();
    for (const auto& item : model.module()->named_parameters()) {
      expect_close("step " + std::to_string(s) + " gradient of " + item.key(), item.value().grad(),
                   ref_params[item.key()].grad());
    }
  });
  auto ref_params = ref.net->named_parameters();
  for (const auto& item : model.module()->named_parameters()) {
    expect_close("final parameter " + item.key(), item.value(), ref_params[item.key()]);
  }
  expect_equal_buffers("DDP", *model.module(), *ref.net);
  DistributedDataParallel<ZooNet> fresh(make_net(spec), world_ptr(),
                                        DDPOptions().find_unused_parameters(true));
  round_trip({model.module().ptr().get(), nullptr, nullptr, nullptr, nullptr, &world()},
             {fresh.module().ptr().get(), nullptr, nullptr, nullptr, nullptr, &world()}, "ddp",
             "full");
  for (const auto& item : model.module()->named_parameters()) {
    EXPECT_TRUE(at::equal(fresh.module()->named_parameters()[item.key()], item.value()))
        << "full checkpoint: parameter " << item.key() << " did not come back";
  }
  expect_equal_buffers("DDP after a full checkpoint", *fresh.module(), *ref.net);
}

std::vector<std::pair<std::string, FSDPOptions>> strategies() {
  std::vector<std::pair<std::string, FSDPOptions>> all = {
      {"full_shard", FSDPOptions().sharding_strategy(ShardingStrategy::kFullShard)},
      {"shard_grad_op", FSDPOptions().sharding_strategy(ShardingStrategy::kShardGradOp)},
      {"no_shard", FSDPOptions().sharding_strategy(ShardingStrategy::kNoShard)},
      {"hybrid_shard",
       FSDPOptions().sharding_strategy(ShardingStrategy::kHybridShard).hybrid_group_size(1)},
  };
  // From 4 ranks on (run by hand: CI runs the zoo at 2 and 3), shard groups of 2 with
  // replicas too: a reduce-scatter, then the replicas' all-reduce in flight behind backward.
  if (world().size() >= 4 && world().size() % 2 == 0) {
    all.push_back(
        {"hybrid_shard (groups of 2)",
         FSDPOptions().sharding_strategy(ShardingStrategy::kHybridShard).hybrid_group_size(2)});
  }
  return all;
}

// The optimizer in backward (FSDPState::set_step_in_backward) on the same pattern: SGD stepped
// on each unit as its gradients are reduced leaves bitwise the parameters of SGD after
// backward, with no gradient left when backward returns. `net` makes each model, FSDP runs
// over `group`, and this rank takes `rows` of batches of `total` rows.
void check_in_backward_on(const ZooSpec& spec, FSDPOptions options,
                          const std::function<ZooNet()>& net,
                          const std::shared_ptr<comm::Communicator>& group, int64_t total,
                          const std::function<Batch(const Batch&)>& rows) {
  FullyShardedDataParallel<ZooNet> after(net(), group, options);
  FullyShardedDataParallel<ZooNet> during(net(), group, options);
  during.state().set_step_in_backward([](const std::vector<at::Tensor>& ps) { sgd_step(ps, kLr); });
  for (int64_t s = 0; s < spec.steps; ++s) {
    for (auto* model : {&after, &during}) {
      zero_grad(model->parameters());
      train_step(
          spec, s, total, [&](const at::Tensor& x, bool last) { return (*model)(x, last); }, rows,
          [&](bool last) { return no_sync_unless(last, *model); });
    }
    for (const auto& p : during.parameters()) {
      EXPECT_FALSE(p.grad().defined()) << "step " << s << ": a gradient outlived its unit's step";
    }
    sgd_step(after.parameters(), kLr);
  }
  const auto want = after.state().full_parameters();
  const auto got = during.state().full_parameters();
  ASSERT_EQ(got.size(), want.size());
  for (size_t k = 0; k < got.size(); ++k) {
    EXPECT_TRUE(at::equal(got[k].second, want[k].second)) << "final parameter " << got[k].first;
  }
  expect_equal_buffers("FSDP, optimizer in backward", *during.module(), *after.module());
}

void check_in_backward(const ZooSpec& spec, FSDPOptions options, const std::string& label) {
  SCOPED_TRACE(label + ", optimizer in backward | " + spec.describe());
  check_in_backward_on(
      spec, options, [&] { return make_net(spec); }, world_ptr(), world().size() * kPerRank,
      my_rows);
}

// --- tensor parallelism ------------------------------------------------------------------------

// The mesh of world / tp data-parallel ranks x tp (its splits are collective: one per degree).
DeviceMesh& mesh_with_tp(int tp) {
  static std::map<int, std::unique_ptr<DeviceMesh>> meshes;
  auto& mesh = meshes[tp];
  if (!mesh)
    mesh = std::make_unique<DeviceMesh>(world_ptr(), MeshShape{1, world().size() / tp, tp, 1});
  return *mesh;
}

// A zoo net with its MLP pairs sliced over the tp group of a mesh; each data-parallel rank
// takes its rows of the batch, the ranks of a tp group the same ones.
struct TpZoo {
  DeviceMesh& mesh;
  std::shared_ptr<TensorParallelism> tp;
  TpZoo(int degree) : mesh(mesh_with_tp(degree)) {
    tp = std::make_shared<TensorParallelism>(mesh.tp(), /*sequence_parallel=*/false);
  }
  ZooNet net(const ZooSpec& spec) const {
    ZooNet n = make_net(spec);
    n->parallelize(tp);
    return n;
  }
  int64_t total() const { return mesh.dp_size() * kPerRank; }
  std::function<Batch(const Batch&)> rows() const {
    const int64_t d = mesh.dp_rank();
    return [d](const Batch& b) {
      return Batch{b.x.narrow(0, d * kPerRank, kPerRank), b.y.narrow(0, d * kPerRank, kPerRank)};
    };
  }
  std::string label(const std::string& what) const {
    return what + " over " + std::to_string(mesh.dp_size()) + " x tp " +
           std::to_string(mesh.shape().tp);
  }
};

// FSDP over the data-parallel ranks of the tp-sliced zoo net: gradients (FSDP's shards gathered
// over the data-parallel group, then the slices over the tp group) and final parameters against
// one process without TP; buffers bitwise; a full checkpoint restores the slices bitwise.
void check_tp_fsdp(const ZooSpec& spec, int degree, FSDPOptions options, const std::string& name) {
  TpZoo zoo(degree);
  SCOPED_TRACE(zoo.label("FSDP " + name) + " | " + spec.describe());
  Reference ref(spec);
  FullyShardedDataParallel<ZooNet> model(zoo.net(spec), zoo.mesh.dp(), options);
  train_beside(
      spec, model, ref,
      [&](int64_t s) {
        auto masters = model.state().all_parameters();
        std::vector<at::Tensor> grads;
        for (const auto& m : masters) grads.push_back(m.second.grad());
        auto full = model.state().gather_full(grads);
        auto ref_params = ref.net->named_parameters();
        for (size_t k = 0; k < masters.size(); ++k) {
          const std::string& n = masters[k].first;
          const at::Tensor& want = ref_params[n];
          if (!want.requires_grad()) {
            EXPECT_FALSE(masters[k].second.grad().defined()) << "frozen " << n;
            continue;
          }
          expect_close("step " + std::to_string(s) + " gradient of " + n, zoo.tp->full(n, full[k]),
                       want.grad());
        }
      },
      zoo.total(), zoo.rows());
  auto params = model.state().full_parameters();
  auto ref_params = ref.net->named_parameters();
  for (const auto& [n, value] : params) {
    expect_close("final parameter " + n, zoo.tp->full(n, value), ref_params[n]);
  }
  expect_equal_buffers("FSDP x TP", *model.module(), *ref.net);
  for (const char* format : {"sharded", "full"}) {
    FullyShardedDataParallel<ZooNet> fresh(zoo.net(spec), zoo.mesh.dp(), options);
    round_trip({model.module().ptr().get(), &model.state(), nullptr, nullptr, nullptr, &world(),
                zoo.tp.get()},
               {fresh.module().ptr().get(), &fresh.state(), nullptr, nullptr, nullptr, &world(),
                zoo.tp.get()},
               "fsdp", format);
    auto restored = fresh.state().full_parameters();
    for (size_t k = 0; k < params.size(); ++k) {
      EXPECT_TRUE(at::equal(restored[k].second, params[k].second))
          << format << " checkpoint under TP: parameter " << params[k].first
          << " did not come back";
    }
    expect_equal_buffers(std::string("FSDP x TP after a ") + format + " checkpoint",
                         *fresh.module(), *ref.net);
  }
}

// The optimizer in backward under FSDP x TP: bitwise the parameters of stepping after backward.
void check_tp_in_backward(const ZooSpec& spec, int degree, FSDPOptions options,
                          const std::string& name) {
  TpZoo zoo(degree);
  SCOPED_TRACE(zoo.label("FSDP " + name) + ", optimizer in backward | " + spec.describe());
  check_in_backward_on(
      spec, options, [&] { return zoo.net(spec); }, zoo.mesh.dp(), zoo.total(), zoo.rows());
}

// DDP over the data-parallel ranks of the tp-sliced zoo net, as check_tp_fsdp.
void check_tp_ddp(const ZooSpec& spec, int degree) {
  TpZoo zoo(degree);
  SCOPED_TRACE(zoo.label("DDP") + " | " + spec.describe());
  Reference ref(spec);
  const auto options = DDPOptions().find_unused_parameters(true);
  DistributedDataParallel<ZooNet> model(zoo.net(spec), zoo.mesh.dp(), options);
  train_beside(
      spec, model, ref,
      [&](int64_t s) {
        auto ref_params = ref.net->named_parameters();
        for (const auto& item : model.module()->named_parameters()) {
          const at::Tensor& g = item.value().grad();
          expect_close("step " + std::to_string(s) + " gradient of " + item.key(),
                       g.defined() ? zoo.tp->full(item.key(), g) : g,
                       ref_params[item.key()].grad());
        }
      },
      zoo.total(), zoo.rows());
  auto ref_params = ref.net->named_parameters();
  for (const auto& item : model.module()->named_parameters()) {
    expect_close("final parameter " + item.key(), zoo.tp->full(item.key(), item.value()),
                 ref_params[item.key()]);
  }
  expect_equal_buffers("DDP x TP", *model.module(), *ref.net);
  DistributedDataParallel<ZooNet> fresh(zoo.net(spec), zoo.mesh.dp(), options);
  round_trip(
      {model.module().ptr().get(), nullptr, nullptr, nullptr, nullptr, &world(), zoo.tp.get()},
      {fresh.module().ptr().get(), nullptr, nullptr, nullptr, nullptr, &world(), zoo.tp.get()},
      "ddp", "full");
  for (const auto& item : model.module()->named_parameters()) {
    EXPECT_TRUE(at::equal(fresh.module()->named_parameters()[item.key()], item.value()))
        << "full checkpoint under TP: parameter " << item.key() << " did not come back";
  }
  expect_equal_buffers("DDP x TP after a full checkpoint", *fresh.module(), *ref.net);
}

// A zoo net run plain (no strategy), as train_beside runs wrapped ones: its micro-batches
// accumulate without no_sync.
struct PlainZoo {
  ZooNet net;
  std::pair<at::Tensor, at::Tensor> operator()(const at::Tensor& x, bool last) {
    return net(x, last);
  }
  std::vector<at::Tensor> parameters() const { return net->parameters(); }
};
std::optional<NoSyncGuard> no_sync_unless(bool, PlainZoo&) { return std::nullopt; }

// TP over the whole world, no data parallelism (as the trainer runs tp = world: the model
// plain, every rank on the whole batch), against one process; a full checkpoint restores it.
void check_tp_alone(const ZooSpec& spec) {
  TpZoo zoo(world().size());
  SCOPED_TRACE(zoo.label("TP alone") + " | " + spec.describe());
  Reference ref(spec);
  PlainZoo model{zoo.net(spec)};
  train_beside(
      spec, model, ref,
      [&](int64_t s) {
        auto ref_params = ref.net->named_parameters();
        for (const auto& item : model.net->named_parameters()) {
          const at::Tensor& g = item.value().grad();
          expect_close("step " + std::to_string(s) + " gradient of " + item.key(),
                       g.defined() ? zoo.tp->full(item.key(), g) : g,
                       ref_params[item.key()].grad());
        }
      },
      zoo.total(), zoo.rows());
  auto ref_params = ref.net->named_parameters();
  for (const auto& item : model.net->named_parameters()) {
    expect_close("final parameter " + item.key(), zoo.tp->full(item.key(), item.value()),
                 ref_params[item.key()]);
  }
  expect_equal_buffers("TP", *model.net, *ref.net);
  ZooNet fresh = zoo.net(spec);
  round_trip({model.net.ptr().get(), nullptr, nullptr, nullptr, nullptr, &world(), zoo.tp.get()},
             {fresh.ptr().get(), nullptr, nullptr, nullptr, nullptr, &world(), zoo.tp.get()}, "ddp",
             "full");
  for (const auto& item : model.net->named_parameters()) {
    EXPECT_TRUE(at::equal(fresh->named_parameters()[item.key()], item.value()))
        << "full checkpoint under TP: parameter " << item.key() << " did not come back";
  }
  expect_equal_buffers("TP after a full checkpoint", *fresh, *ref.net);
}

// Every pattern under TP: over the whole world, and where the world is an even number above 2
// on the 2-D mesh of tp 2 under FSDP (full_shard and hybrid_shard over the data-parallel
// group, the optimizer in backward) and DDP; from 8 ranks, replicate x shard x tp.
void check_all_tp(const ZooSpec& spec) {
  check_tp_alone(spec);
  if (world().size() > 2 && world().size() % 2 == 0) {
    check_tp_fsdp(spec, 2, FSDPOptions(), "full_shard");
    check_tp_fsdp(
        spec, 2,
        FSDPOptions().sharding_strategy(ShardingStrategy::kHybridShard).hybrid_group_size(1),
        "hybrid_shard");
    check_tp_in_backward(spec, 2, FSDPOptions(), "full_shard");
    check_tp_ddp(spec, 2);
  }
  // HSDP x TP: replicas of shard groups of 2 over the data-parallel ranks (8 ranks: 2 x 2 x
  // tp 2).
  if (world().size() >= 8 && world().size() % 4 == 0) {
    check_tp_fsdp(
        spec, 2,
        FSDPOptions().sharding_strategy(ShardingStrategy::kHybridShard).hybrid_group_size(2),
        "hybrid_shard (shard groups of 2)");
  }
}

void check_all(const ZooSpec& spec) {
  for (const auto& [name, options] : strategies()) {
    check_fsdp(spec, options, "FSDP " + name);
    check_in_backward(spec, options, "FSDP " + name);
  }
  check_ddp(spec, "DDP");
}

TEST_F(Test, UnitCalledSeveralTimesAccumulatesAndReducesOnce) {
  ZooSpec s;
  s.calls = {0, 1, 0, 2, 0};  // three calls of block 0, interleaved
  check_all(s);
}

TEST_F(Test, NoGradForwardLeavesTheTrainingForwardAlone) {
  for (int where : {1, 2, 3}) {
    ZooSpec s;
    s.nograd = where;
    check_all(s);
  }
}

// Recompute in every block, with reuse, a frozen weight, unused parameters, no_sync
// micro-batches and a no-grad forward between: against one process without recompute.
TEST_F(Test, RecomputedBlocksKeepEveryPatternsGradients) {
  ZooSpec s;
  s.recompute = true;
  s.calls = {0, 1, 0, 2};
  s.frozen = {0, 1, 0};
  s.sometimes_unused = 2;
  s.micro_batches = 2;
  s.nograd = 2;
  check_all(s);
}

TEST_F(Test, NoSyncGradientOfAParameterUnusedInTheLastMicroBatchIsReduced) {
  ZooSpec s;
  s.micro_batches = 3;
  s.sometimes_unused = 1;
  check_all(s);
  // A whole unit that runs in the earlier micro-batches only.
  s.sometimes_unused = -1;
  s.skipped_in_last = 2;
  check_all(s);
}

TEST_F(Test, FrozenParametersAndAllFrozenUnitsTrainTheRest) {
  ZooSpec s;
  s.frozen = {1, 2, 0};
  check_all(s);
  // The all-frozen unit has nothing to reduce: one reduce-scatter for each other unit and
  // the root.
  FullyShardedDataParallel<ZooNet> model(make_net(s), world_ptr());
  const int64_t before = model.state().reductions_launched();
  loss_of(model(at::randn({kPerRank, kIn}), true), at::randint(0, kClasses, {kPerRank})).backward();
  EXPECT_EQ(model.state().reductions_launched() - before, 3);
}

// 0-dim parameters (gain, temperature) and pair/optional/struct outputs are in every model;
// this one is the smallest.
TEST_F(Test, ScalarParametersAndContainerOutputs) {
  ZooSpec s;
  s.blocks = 2;
  s.calls = {0, 1};
  s.frozen = {0, 0};
  check_all(s);
}

// A frozen parameter in every unit must not keep units gathered until the end of backward.
TEST_F(Test, FrozenParametersDoNotHoldUnitsGathered) {
  ZooSpec s;
  s.blocks = 12;
  s.calls.clear();
  s.frozen.clear();
  for (int64_t b = 0; b < s.blocks; ++b) {
    s.calls.push_back(b);
    s.frozen.push_back(1);
  }
  s.steps = 2;
  FSDPOptions options;
  options.limit_all_gathers(2);
  check_fsdp(s, options, "FSDP full_shard, frozen weights");
  FullyShardedDataParallel<ZooNet> model(make_net(s), world_ptr(), options);
  at::Tensor x = at::randn({kPerRank, kIn}), y = at::randint(0, kClasses, {kPerRank});
  loss_of(model(x, true), y).backward();
  if (world().size() > 1) {
    EXPECT_LE(model.state().peak_gathered_units(), options.limit_all_gathers());
  }
}

// Unused parameters in every unit must not keep units gathered until the end of backward, nor
// hold back the reductions after theirs: each unit is complete once its input's gradient is.
TEST_F(Test, UnusedParametersDoNotHoldUnitsGathered) {
  ZooSpec s;
  s.blocks = 12;
  s.calls.clear();
  s.frozen.assign(s.blocks, 0);
  for (int64_t b = 0; b < s.blocks; ++b) s.calls.push_back(b);
  s.extra_unused = true;
  s.steps = 2;
  s.micro_batches = 2;
  FSDPOptions options;
  options.limit_all_gathers(2);
  check_fsdp(s, options, "FSDP full_shard, unused parameters");
  FullyShardedDataParallel<ZooNet> model(make_net(s), world_ptr(), options);
  at::Tensor x = at::randn({kPerRank, kIn}), y = at::randint(0, kClasses, {kPerRank});
  loss_of(model(x, true), y).backward();
  if (world().size() > 1) {
    EXPECT_LE(model.state().peak_gathered_units(), options.limit_all_gathers());
  }
}

// PyTorch's broadcast_buffers=True: before each forward, every rank takes rank 0's buffers
// (float, int64 and bool alike).
TEST_F(Test, DdpForwardStartsFromRankZerosBuffers) {
  ZooSpec s;
  DistributedDataParallel<ZooNet> model(make_net(s), world_ptr(), DDPOptions());
  auto& block = *model.module()->structs[0];
  const int64_t r = world().rank();
  {
    at::NoGradGuard no_grad;
    block.running.fill_(static_cast<double>(r + 1));
    block.count.fill_(10 * r);
    block.flag.fill_(r % 2 == 1);
  }
  {
    at::NoGradGuard no_grad;  // a forward without backward: evaluation
    model(at::randn({kPerRank, kIn}), true);
  }
  // Rank 0's values, then one forward's update (running * 0.5 + 0.125, count + 1, flag
  // negated), on every rank.
  EXPECT_TRUE(at::equal(block.running, at::full({s.width}, 1.0 * 0.5 + 0.125)));
  EXPECT_EQ(block.count.item<int64_t>(), 1);
  EXPECT_TRUE(block.flag.all().item<bool>());
}

// AdamW's two param groups, trainable parameters only, in either order.
std::vector<torch::optim::OptimizerParamGroup> two_groups(
    const std::vector<std::pair<std::string, at::Tensor>>& named, bool blocks_first) {
  std::vector<at::Tensor> blocks, rest;
  for (const auto& [name, t] : named) {
    if (t.requires_grad()) (name.rfind("blocks", 0) == 0 ? blocks : rest).push_back(t);
  }
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(blocks_first ? blocks : rest);
  groups.emplace_back(blocks_first ? rest : blocks);
  return groups;
}

// AdamW's first moment of `p`, undefined before its first step.
at::Tensor exp_avg(torch::optim::Optimizer& opt, const at::Tensor& p) {
  auto it = opt.state().find(p.unsafeGetTensorImpl());
  if (it == opt.state().end()) return at::Tensor();
  return static_cast<torch::optim::AdamWParamState&>(*it->second).exp_avg();
}

void expect_same_moments(const std::string& what,
                         const std::vector<std::pair<std::string, at::Tensor>>& a,
                         torch::optim::Optimizer& opt_a,
                         const std::vector<std::pair<std::string, at::Tensor>>& b,
                         torch::optim::Optimizer& opt_b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t k = 0; k < a.size(); ++k) {
    ASSERT_EQ(a[k].first, b[k].first);
    const at::Tensor x = exp_avg(opt_a, a[k].second), y = exp_avg(opt_b, b[k].second);
    ASSERT_EQ(x.defined(), y.defined()) << what << ": " << a[k].first;
    if (x.defined()) {
      EXPECT_TRUE(at::equal(x, y))
          << what << ": the moment of " << a[k].first << " came back to another parameter";
    }
  }
}

// Optimizer state returns to the parameter it belongs to, by name, when the restoring
// optimizer's param groups are in another order than the saving one's.
TEST_F(Test, OptimizerStateIsRestoredByParameterName) {
  ZooSpec s;
  const int64_t r = world().rank();
  Batch b = batch(0, 0, world().size() * kPerRank);
  const at::Tensor x = b.x.narrow(0, r * kPerRank, kPerRank);
  const at::Tensor y = b.y.narrow(0, r * kPerRank, kPerRank);
  for (const char* format : {"sharded", "full"}) {
    FullyShardedDataParallel<ZooNet> model(make_net(s), world_ptr());
    torch::optim::AdamW opt(two_groups(model.named_parameters(), false),
                            torch::optim::AdamWOptions(0.01));
    loss_of(model(x, true), y).backward();
    opt.step();
    FullyShardedDataParallel<ZooNet> fresh(make_net(s), world_ptr());
    torch::optim::AdamW opt2(two_groups(fresh.named_parameters(), true),
                             torch::optim::AdamWOptions(0.01));
    round_trip({model.module().ptr().get(), &model.state(), &opt, nullptr, nullptr, &world()},
               {fresh.module().ptr().get(), &fresh.state(), &opt2, nullptr, nullptr, &world()},
               "fsdp", format);
    expect_same_moments(std::string("FSDP ") + format, model.named_parameters(), opt,
                        fresh.named_parameters(), opt2);
  }
  DistributedDataParallel<ZooNet> model(make_net(s), world_ptr(), DDPOptions());
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (const auto& item : model.module()->named_parameters()) {
    named.emplace_back(item.key(), item.value());
  }
  torch::optim::AdamW opt(two_groups(named, false), torch::optim::AdamWOptions(0.01));
  loss_of(model(x, true), y).backward();
  opt.step();
  DistributedDataParallel<ZooNet> fresh(make_net(s), world_ptr(), DDPOptions());
  std::vector<std::pair<std::string, at::Tensor>> fresh_named;
  for (const auto& item : fresh.module()->named_parameters()) {
    fresh_named.emplace_back(item.key(), item.value());
  }
  torch::optim::AdamW opt2(two_groups(fresh_named, true), torch::optim::AdamWOptions(0.01));
  round_trip({model.module().ptr().get(), nullptr, &opt, nullptr, nullptr, &world()},
             {fresh.module().ptr().get(), nullptr, &opt2, nullptr, nullptr, &world()}, "ddp",
             "full");
  expect_same_moments("DDP full", named, opt, fresh_named, opt2);
}

// Tensor parallelism on the patterns: a block called three times (each call's column-wise input
// all-reduced in backward), a frozen row-wise slice, a parameter unused in the last no_sync
// micro-batch, a no-grad forward between forward and backward, recompute (whose forward
// repeats the row-wise all-reduce in backward).
TEST_F(Test, TensorParallelReuseFrozenUnusedAndNoGrad) {
  ZooSpec s;
  s.calls = {0, 1, 0, 2, 0};
  s.frozen = {0, 1, 2};
  s.sometimes_unused = 1;
  s.micro_batches = 2;
  s.nograd = 2;
  check_all_tp(s);
}

TEST_F(Test, TensorParallelRecomputeAndAUnitSkippedInTheLastMicroBatch) {
  ZooSpec s;
  s.recompute = true;
  s.calls = {0, 1, 0, 2};
  s.frozen = {0, 1, 0};
  s.skipped_in_last = 2;
  s.micro_batches = 3;
  s.nograd = 1;
  check_all_tp(s);
}

TEST_F(Test, RandomModels) {
  uint64_t first = 1, count = 6;
  if (const char* seeds = std::getenv("DTRAIN_ZOO_SEEDS")) {
    std::string s(seeds);
    const auto colon = s.find(':');
    first = std::stoull(s.substr(0, colon));
    count = colon == std::string::npos ? 1 : std::stoull(s.substr(colon + 1));
  }
  for (uint64_t seed = first; seed < first + count; ++seed) {
    SCOPED_TRACE("zoo seed " + std::to_string(seed));
    check_all(random_spec(seed));
    if (seed % 3 == 1) check_all_tp(random_spec(seed));  // a third of them under TP too
    if (::testing::Test::HasFailure()) break;  // the first failing seed is the one to read
  }
}

}  // namespace
}  // namespace dtrain::sharding

int main(int argc, char** argv) { return dtrain::testing::multirank_main(argc, argv); }
