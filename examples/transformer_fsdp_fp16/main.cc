// Example (b): a user's own small transformer under dtrain's FSDP with fp16 parameters, a
// ShardedGradScaler, gradient accumulation and gradient clipping.
//
// What a PyTorch user writes as
//   for block in model.blocks: fully_shard(block, mp_policy=MixedPrecisionPolicy(fp16...))
//   fully_shard(model); scaler = ShardedGradScaler()
//   for micro in range(k): (with model.no_sync() for all but the last)
//       scaler.scale(loss / k).backward()
//   scaler.unscale_(opt); model.clip_grad_norm_(1.0); scaler.step(opt); scaler.update()
// Run at 2 ranks:  dtrain-launch --nproc-per-node 2 -- ./transformer_fsdp_fp16 [steps]
// The task: next-token prediction on sequences that count up by a per-sequence stride
// (mod the vocabulary), which a tiny model learns in a few dozen steps. fp16 on a CPU without
// fp16 arithmetic is slow, so the model is tiny. Exits 1 if the loss did not fall.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <dtrain/amp/policy.h>
#include <dtrain/amp/sharded_grad_scaler.h>
#include <dtrain/comm/factory.h>
#include <dtrain/core/error.h>
#include <dtrain/core/logging.h>
#include <dtrain/optim/fused.h>
#include <dtrain/sharding/fsdp.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

namespace {

constexpr int64_t kVocab = 32, kSeq = 16, kModel = 64, kHeads = 4, kLayers = 2;

// A Linear's forward through at::linear, which fuses the bias into the matrix multiply for
// inputs of any rank, as Python's F.linear does. LibTorch's Linear::forward computes a 3-D
// input as matmul then += bias, which rounds twice in fp16/bf16.
at::Tensor lin(const torch::nn::Linear& l, const at::Tensor& x) {
  return at::linear(x, l->weight, l->bias);
}

// One pre-norm block: causal self-attention and an MLP.
class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl() {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kModel})));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kModel})));
    qkv = register_module("qkv", torch::nn::Linear(kModel, 3 * kModel));
    proj = register_module("proj", torch::nn::Linear(kModel, kModel));
    fc1 = register_module("fc1", torch::nn::Linear(kModel, 4 * kModel));
    fc2 = register_module("fc2", torch::nn::Linear(4 * kModel, kModel));
  }
  at::Tensor forward(const at::Tensor& x) {
    const int64_t b = x.size(0), t = x.size(1);
    auto heads = lin(qkv, ln1->forward(x)).view({b, t, 3, kHeads, kModel / kHeads});
    at::Tensor q = heads.select(2, 0).transpose(1, 2), k = heads.select(2, 1).transpose(1, 2),
               v = heads.select(2, 2).transpose(1, 2);
    at::Tensor a = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
    at::Tensor h = x + lin(proj, a.transpose(1, 2).reshape({b, t, kModel}));
    return h + lin(fc2, at::gelu(lin(fc1, ln2->forward(h))));
  }

  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc1{nullptr}, fc2{nullptr};
};

// The model. Each block is an FSDP wrap point: declared as sharding::Unit<BlockImpl> instead
// of a plain block, and still called with forward(x). Unwrapped (no FSDP) it is the block.
class TinyLMImpl : public torch::nn::Module {
 public:
  TinyLMImpl() {
    tok = register_module("tok", torch::nn::Embedding(kVocab, kModel));
    pos = register_module("pos", torch::nn::Embedding(kSeq, kModel));
    for (int64_t i = 0; i < kLayers; ++i) {
      blocks.push_back(
          register_module("block" + std::to_string(i), dtrain::sharding::Unit<BlockImpl>()));
    }
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kModel})));
    head = register_module("head", torch::nn::Linear(kModel, kVocab));
  }
  at::Tensor forward(const at::Tensor& tokens) {
    at::Tensor x = tok->forward(tokens) + pos->forward(at::arange(tokens.size(1), at::kLong));
    for (auto& block : blocks) x = block->forward(x);
    return lin(head, ln_f->forward(x));
  }

  torch::nn::Embedding tok{nullptr}, pos{nullptr};
  std::vector<dtrain::sharding::Unit<BlockImpl>> blocks;
  torch::nn::LayerNorm ln_f{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(TinyLM);

// Sequences start + stride * i (mod kVocab), kSeq + 1 long: inputs and next-token targets.
std::pair<at::Tensor, at::Tensor> batch(at::Generator& gen, int64_t n) {
  at::Tensor start = at::randint(0, kVocab, {n, 1}, gen, at::kLong);
  at::Tensor stride = at::randint(1, 4, {n, 1}, gen, at::kLong);
  at::Tensor seq = (start + stride * at::arange(kSeq + 1, at::kLong)).remainder(kVocab);
  return {seq.narrow(1, 0, kSeq), seq.narrow(1, 1, kSeq)};
}

}  // namespace

int main(int argc, char** argv) try {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 30;
  const int accumulate = 2;  // micro-batches per optimizer step
  auto comm = dtrain::comm::create_world();
  dtrain::logging::configure(comm->rank());

  at::manual_seed(0);  // FSDP syncs rank 0's parameters anyway (sync_module_states)
  using dtrain::sharding::AutoWrapPolicy;
  using dtrain::sharding::FSDPOptions;
  dtrain::sharding::FullyShardedDataParallel<TinyLM> model(
      TinyLM(), comm,
      FSDPOptions()
          .mixed_precision(dtrain::amp::MixedPrecisionPolicy::fp16())  // params, grads in fp16
          .auto_wrap(AutoWrapPolicy().module_types({"BlockImpl"})));
  // The optimizer steps this rank's fp32 master shards: dtrain::optim::AdamW is LibTorch's
  // AdamW on ATen's fused kernel (Python's fused=True), which also unscales and skips for the
  // scaler inside its one pass.
  dtrain::optim::AdamW opt(model.parameters(), torch::optim::AdamWOptions(3e-3));
  // fp16 gradients can overflow: the scaler skips such steps, and its inf verdict is agreed
  // over the ranks, since each holds only a shard.
  dtrain::amp::ShardedGradScaler scaler(comm, dtrain::amp::GradScalerOptions().init_scale(1024));

  auto gen = at::make_generator<at::CPUGeneratorImpl>(2000 + comm->rank());
  double first = 0, last = 0;
  for (int step = 0; step < steps; ++step) {
    opt.zero_grad();
    double loss_sum = 0;
    for (int micro = 0; micro < accumulate; ++micro) {
      auto [x, y] = batch(gen, 8);
      // All but the last micro-batch keep their gradients local (no reduce-scatter).
      std::optional<dtrain::sharding::NoSyncGuard> local;
      if (micro + 1 < accumulate) local.emplace(model.no_sync());
      at::Tensor logits = model(x).to(at::kFloat);  // the loss in fp32
      at::Tensor loss =
          at::cross_entropy_loss(logits.reshape({-1, kVocab}), y.reshape(-1)) / accumulate;
      scaler.scale(loss).backward();
      loss_sum += loss.item<double>();
    }
    scaler.unscale_(opt);                            // gradients back to their true size
    const double norm = model.clip_grad_norm_(1.0);  // the norm over every rank's shard
    const bool stepped = scaler.step(opt);           // skipped if any shard had inf/NaN
    scaler.update();
    at::Tensor mean = at::full({1}, loss_sum, at::kDouble);
    comm->all_reduce(mean, dtrain::comm::ReduceOp::kAvg).wait();
    if (step == 0) first = mean.item<double>();
    last = mean.item<double>();
    if (comm->rank() == 0 && (step % 10 == 0 || step + 1 == steps)) {
      std::printf("step %d loss %.4f grad_norm %.3f scale %g%s\n", step + 1, last, norm,
                  scaler.get_scale(), stepped ? "" : " (skipped)");
    }
  }
  comm->barrier().wait();
  if (comm->rank() == 0) {
    std::printf("transformer_fsdp_fp16: %d ranks, loss %.4f -> %.4f\n", comm->size(), first, last);
  }
  return std::isfinite(last) && last < first * 0.8 ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "transformer_fsdp_fp16: %s\n", dtrain::message_of(e).c_str());
  return 1;
}
