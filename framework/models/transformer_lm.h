// TransformerLM: a GPT-style decoder-only language model over byte tokens.
//
// token + learned position embedding -> n_layers x [x + attn(ln1(x)); x + mlp(ln2(x))]
// -> final LayerNorm -> head. Attention is causal multi-head self-attention, through ATen's
// scaled_dot_product_attention (is_causal: flash kernels that accumulate the softmax in fp32
// and keep only its log-sum-exp for backward) or the explicit fp32 softmax, whichever is
// faster for the device, dtype and shape (causal_attention below, framework/models/attention.h;
// model.attention pins one). The MLP is
// Linear -> GELU(tanh) -> Linear. With tie_weights the head reuses the token embedding
// (logits = x @ tok_emb^T): one parameter, registered once, so DDP and optimizers see it once.
// No dropout: runs are deterministic for a seed. Initialization follows GPT-2: N(0, 0.02),
// residual projections scaled by 1/sqrt(2 n_layers), zero biases, LayerNorms at ones and
// zeros. Each parameter draws from a generator of its own, seeded by one number the
// constructor draws from the default generator and by the parameter's name, so a parameter's
// initial value does not depend on the order parameters are initialized in. That is what lets
// deferred_init build the model with placeholders (sharding/deferred_init.h) and FSDP
// initialize it unit by unit (param_init()) into the same bits as the eager constructor. Linear
// layers run through at::linear, which fuses the bias into the matrix multiply as Python's F.linear
// does (LibTorch's torch::nn::functional::linear adds it separately for 3-D inputs, which rounds
// differently). Each block is an FSDP wrap point (BlockUnit), and can recompute its
// activations in backward (recompute_every).
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include "framework/models/configs.h"
#include "framework/models/kv_cache.h"
#include "framework/task.h"
#include "sharding/deferred_init.h"
#include "sharding/fsdp.h"

namespace dtrain::framework {

// Causal attention of q, k, v [B, H, T, D] -> [B, H, T, D]. kFused:
// at::scaled_dot_product_attention(is_causal = true), as Python's F.scaled_dot_product_attention.
// kExplicit: matmul -> mask -> fp32 softmax -> matmul, op for op as bench/reference/model.py's
// explicit path. The two agree within rounding (models_test); which one is faster depends on
// the device, dtype and shape (framework/models/attention.h).
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            AttentionKernel kernel = AttentionKernel::kFused);

class CausalSelfAttentionImpl : public torch::nn::Module {
 public:
  CausalSelfAttentionImpl(int64_t d_model, int64_t n_heads,
                          AttentionSetting attention = AttentionSetting::kAuto);
  at::Tensor forward(const at::Tensor& x);
  // Generation: x [B, T, C] at the positions after the cache's, its keys and values appended
  // to layer `layer` of `cache` (framework/models/kv_cache.h).
  at::Tensor forward_cached(const at::Tensor& x, KVCache& cache, size_t layer);

  torch::nn::Linear qkv{nullptr}, proj{nullptr};

 private:
  int64_t n_heads_;
  AttentionSetting attention_;
};
TORCH_MODULE(CausalSelfAttention);

class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(int64_t d_model, int64_t n_heads, int64_t d_ff,
            AttentionSetting attention = AttentionSetting::kAuto);
  // With `recompute`, through sharding::recompute: only x is kept for backward.
  at::Tensor forward(const at::Tensor& x);
  at::Tensor forward_cached(const at::Tensor& x, KVCache& cache, size_t layer);
  bool recompute = false;

  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  CausalSelfAttention attn{nullptr};
  torch::nn::Linear fc{nullptr}, fc_proj{nullptr};
};
TORCH_MODULE(Block);

// The model's FSDP wrap point: a Block that runs FSDP's pre/post-forward work when a
// FullyShardedDataParallel chose it as a unit (sharding/fsdp.h); a plain Block otherwise.
using BlockUnit = sharding::Unit<BlockImpl>;

class TransformerLMImpl : public torch::nn::Module {
 public:
  explicit TransformerLMImpl(const TransformerLMOptions& options);
  // tokens [B, T] (int64, T <= seq_len) -> logits [B, T, vocab_size]
  at::Tensor forward(const at::Tensor& tokens);
  // Generation: tokens [B, T] that follow the cache's positions -> their logits; the cache
  // (capacity at most seq_len) advances by T. The same logits as forward() on the whole
  // sequence, within rounding (the attention runs the explicit softmax).
  at::Tensor forward_cached(const at::Tensor& tokens, KVCache& cache);

  const TransformerLMOptions& options() const { return options_; }
  // The initializer of this model's parameters, by their names in this module (it holds no
  // reference to the module). The eager constructor applies it to every parameter.
  sharding::ParamInit param_init() const;

  torch::nn::Embedding tok_emb{nullptr}, pos_emb{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};
  torch::nn::Linear head{nullptr};  // only when !tie_weights

 private:
  TransformerLMOptions options_;
  uint64_t init_seed_ = 0;
};
TORCH_MODULE(TransformerLM);

// model.type: transformer's builder (framework/models/builtin.h registers it).
void build_transformer_lm(const BuildContext& ctx, BuiltModel& out);

}  // namespace dtrain::framework
