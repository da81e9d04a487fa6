// Llama: the decoder of Meta's Llama 2 and 3 as Hugging Face's LlamaForCausalLM writes it, op
// for op, so its checkpoints load and save (config.json + model.safetensors, sharded index
// included) and its logits match transformers' within rounding.
//
// tokens -> embed_tokens -> num_hidden_layers x [x + attn(rms1(x)); x + mlp(rms2(x))] -> norm
// -> lm_head. RMSNorm normalizes in fp32 and scales in the input dtype (LlamaRMSNorm).
// Attention is causal with rotary position embeddings (RoPE's half-split rotation,
// inv_freq = theta^(-2i/head_dim), cos and sin computed in fp32 then cast) and grouped-query
// attention: num_key_value_heads heads of K and V, each shared by num_attention_heads /
// num_key_value_heads query heads; the softmax runs in fp32. The MLP is SwiGLU:
// down(silu(gate(x)) * up(x)). No biases. With tie_word_embeddings the head is the embedding.
// Module and parameter names are transformers' ("model.layers.0.self_attn.q_proj.weight"), so
// a state dict maps one to one. Each decoder layer is an FSDP wrap point (LlamaLayerUnit), and
// deferred_init builds the model without parameter memory for FSDP to initialize unit by unit.
// Only the default RoPE is implemented; a config.json asking for scaled RoPE (Llama 3.1's
// "llama3", "linear", "dynamic", "yarn") is refused by name.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <string>
#include <utility>
#include <vector>

#include "framework/models/configs.h"
#include "framework/models/kv_cache.h"
#include "framework/task.h"
#include "sharding/deferred_init.h"
#include "sharding/fsdp.h"
#include "sharding/tensor_parallel_plan.h"

namespace dtrain::framework {

class LlamaRMSNormImpl : public torch::nn::Module {
 public:
  LlamaRMSNormImpl(int64_t size, double eps);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(LlamaRMSNorm);

class LlamaAttentionImpl : public torch::nn::Module {
 public:
  explicit LlamaAttentionImpl(const LlamaOptions& o);
  at::Tensor forward(const at::Tensor& x);
  // Generation: x at the positions after the cache's (RoPE from there), the rotated keys and
  // the values appended to layer `layer` (framework/models/kv_cache.h).
  at::Tensor forward_cached(const at::Tensor& x, KVCache& cache, size_t layer);
  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  // Tensor parallelism (LlamaForCausalLMImpl::parallelize): q, k, v hold this rank's heads.
  std::shared_ptr<const sharding::TensorParallelism> tp;

 private:
  LlamaOptions o_;
};
TORCH_MODULE(LlamaAttention);

class LlamaMLPImpl : public torch::nn::Module {
 public:
  explicit LlamaMLPImpl(const LlamaOptions& o);
  at::Tensor forward(const at::Tensor& x);
  torch::nn::Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
  std::shared_ptr<const sharding::TensorParallelism> tp;
};
TORCH_MODULE(LlamaMLP);

class LlamaDecoderLayerImpl : public torch::nn::Module {
 public:
  explicit LlamaDecoderLayerImpl(const LlamaOptions& o);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor forward_cached(const at::Tensor& x, KVCache& cache, size_t layer);
  LlamaRMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  // Recomputed in backward (sharding/recompute.h): only the layer's input is kept.
  bool recompute = false;
  LlamaAttention self_attn{nullptr};
  LlamaMLP mlp{nullptr};
};
// The FSDP wrap point.
using LlamaLayerUnit = sharding::Unit<LlamaDecoderLayerImpl>;

class LlamaModelImpl : public torch::nn::Module {
 public:
  explicit LlamaModelImpl(const LlamaOptions& o);
  at::Tensor forward(const at::Tensor& tokens);  // hidden states after the final norm
  at::Tensor forward_cached(const at::Tensor& tokens, KVCache& cache);
  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  LlamaRMSNorm norm{nullptr};
  std::shared_ptr<const sharding::TensorParallelism> tp;
};
TORCH_MODULE(LlamaModel);

class LlamaForCausalLMImpl : public torch::nn::Module {
 public:
  explicit LlamaForCausalLMImpl(const LlamaOptions& o);
  // tokens [B, T] (int64) -> logits [B, T, vocab_size]
  at::Tensor forward(const at::Tensor& tokens);
  // Generation: tokens after the cache's positions -> their logits; the cache advances (the
  // same logits as forward() on the whole sequence, within rounding).
  at::Tensor forward_cached(const at::Tensor& tokens, KVCache& cache);
  const LlamaOptions& options() const { return o_; }
  // Pipeline parallelism (sharding/pipeline.h): layers [begin, end) on x, which is the tokens
  // [B, T] when begin is 0 (the embedding runs first) and the hidden states [B, T, hidden]
  // otherwise; when end is num_hidden_layers the final norm and the head run after, giving
  // the logits. Chained over a split of the layers it is forward(). The tied head reads the
  // embedding, so a tied model cannot be split across ranks (the caller refuses it).
  at::Tensor forward_stage(const at::Tensor& x, int64_t begin, int64_t end);
  // Each parameter from a generator of its own (seeded by one draw at construction and its
  // name), as TransformerLM: the eager constructor applies it, and a deferred build given to
  // FSDP gets the same bits unit by unit.
  sharding::ParamInit param_init() const;

  // Tensor parallelism, Megatron's layout as PyTorch's parallelize_module takes it: the
  // embedding vocab-parallel, q/k/v and gate/up colwise, o and down rowwise, the head colwise
  // (tied: the vocab-sliced embedding), each rank holding num_attention_heads / tp query heads
  // and num_key_value_heads / tp K/V heads. Its logits are then this rank's vocabulary slice,
  // for tp->loss (vocabulary-parallel cross-entropy) or tp->gather_vocab.
  static sharding::Plan tp_plan();
  // Applies tp_plan (parameters sliced in place, placeholders too) and sets every layer's tp.
  // ConfigError when the group does not divide the heads, the K/V heads, the MLP's width or the
  // vocabulary. Returns what was sliced, for the log.
  std::vector<std::string> parallelize(std::shared_ptr<sharding::TensorParallelism> tp);
  std::shared_ptr<const sharding::TensorParallelism> tensor_parallel() const { return tp_; }
  // The head's weight: lm_head's, or the embedding's when tied.
  const at::Tensor& head_weight() const;

  LlamaModel model{nullptr};
  torch::nn::Linear lm_head{nullptr};  // only when !tie_word_embeddings

 private:
  LlamaOptions o_;
  uint64_t init_seed_ = 0;
  std::shared_ptr<const sharding::TensorParallelism> tp_;
};
TORCH_MODULE(LlamaForCausalLM);

// Hugging Face checkpoints. `dir` holds config.json and model.safetensors, or shards and
// model.safetensors.index.json. Loading is strict: every parameter found, with its shape,
// and no tensor left over (ConfigError naming the file and tensor otherwise); tensors are
// converted to the parameters' dtype.

LlamaForCausalLM load_hf_llama(const std::string& dir);
void load_hf_llama_weights(LlamaForCausalLMImpl& model, const std::string& dir);
// The checkpoint in `dir` as an initializer: a deferred model given to FSDP with it loads the
// checkpoint one unit at a time, never holding it whole (the files are memory-mapped).
sharding::ParamInit hf_llama_param_init(const std::string& dir);
// Writes config.json and model.safetensors (the parameters in their dtype) into `dir`, which
// transformers' LlamaForCausalLM.from_pretrained(dir) loads.
void save_hf_llama(const LlamaForCausalLMImpl& model, const std::string& dir);
// The same from named tensors (FSDP's gathered parameters), for a model of options `o`.
void save_hf_llama(const LlamaOptions& o,
                   const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                   const std::string& dir);

// model.type: llama's builder (framework/models/builtin.h registers it).
void build_llama(const BuildContext& ctx, BuiltModel& out);

}  // namespace dtrain::framework
