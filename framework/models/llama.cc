#include "framework/models/llama.h"

#include <ATen/ATen.h>
#include <sys/stat.h>
#include <yaml-cpp/yaml.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/logging.h"
#include "framework/checkpoint/safetensors.h"
#include "framework/pipeline_strategy.h"
#include "framework/task.h"
#include "sharding/recompute.h"

namespace dtrain::framework {
namespace {

torch::nn::Linear linear(int64_t in, int64_t out) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
}

// cos and sin [T, head_dim] in fp32 (LlamaRotaryEmbedding), then the compute dtype.
std::pair<at::Tensor, at::Tensor> rotary(int64_t T, int64_t dim, double theta,
                                         const at::Tensor& like) {
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(like.device());
  at::Tensor inv_freq =
      1.0 / at::pow(theta, at::arange(0, dim, 2, f32.dtype(at::kLong)).to(at::kFloat) / dim);
  at::Tensor freqs =
      at::arange(T, f32.dtype(at::kLong)).to(at::kFloat).unsqueeze(1) * inv_freq.unsqueeze(0);
  at::Tensor emb = at::cat({freqs, freqs}, -1);
  return {emb.cos().to(like.scalar_type()), emb.sin().to(like.scalar_type())};
}

at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t h = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, h, x.size(-1) - h), x.narrow(-1, 0, h)}, -1);
}

}  // namespace

LlamaRMSNormImpl::LlamaRMSNormImpl(int64_t size, double eps) : eps_(eps) {
  weight = register_parameter("weight", at::ones({size}));
}

at::Tensor LlamaRMSNormImpl::forward(const at::Tensor& x) {
  at::Tensor h = x.to(at::kFloat);
  at::Tensor variance = h.pow(2).mean(-1, /*keepdim=*/true);
  h = h * at::rsqrt(variance + eps_);
  return weight * h.to(x.scalar_type());
}

LlamaAttentionImpl::LlamaAttentionImpl(const LlamaOptions& o) : o_(o) {
  const int64_t d = o.head_size();
  DTRAIN_CHECK_AS(
      ConfigError,
      o.num_key_value_heads() > 0 && o.num_attention_heads() % o.num_key_value_heads() == 0,
      "Llama: num_attention_heads ", o.num_attention_heads(),
      " must be a multiple of num_key_value_heads ", o.num_key_value_heads());
  DTRAIN_CHECK_AS(ConfigError, d % 2 == 0, "Llama: head_dim ", d, " must be even (RoPE)");
  q_proj = register_module("q_proj", linear(o.hidden_size(), o.num_attention_heads() * d));
  k_proj = register_module("k_proj", linear(o.hidden_size(), o.num_key_value_heads() * d));
  v_proj = register_module("v_proj", linear(o.hidden_size(), o.num_key_value_heads() * d));
  o_proj = register_module("o_proj", linear(o.num_attention_heads() * d, o.hidden_size()));
}

at::Tensor LlamaAttentionImpl::forward(const at::Tensor& x) {
  // Under tensor parallelism this rank's heads: q_proj's rows say how many; the input enters
  // the group once for q, k and v (under sequence parallelism: the whole sequence, gathered).
  std::vector<at::Tensor> qkv;
  if (tp) {
    qkv = tp->colwise(x, {q_proj->weight, k_proj->weight, v_proj->weight});
  } else {
    qkv = {at::linear(x, q_proj->weight), at::linear(x, k_proj->weight),
           at::linear(x, v_proj->weight)};
  }
  const int64_t D = o_.head_size(), B = qkv[0].size(0), T = qkv[0].size(1),
                H = q_proj->weight.size(0) / D, KV = k_proj->weight.size(0) / D;
  auto heads = [&](const at::Tensor& t, int64_t n) {
    return t.view({B, T, n, D}).transpose(1, 2);  // [B, n, T, D]
  };
  at::Tensor q = heads(qkv[0], H);
  at::Tensor k = heads(qkv[1], KV);
  at::Tensor v = heads(qkv[2], KV);
  auto [cos, sin] = rotary(T, D, o_.rope_theta(), q);
  q = q * cos + rotate_half(q) * sin;
  k = k * cos + rotate_half(k) * sin;
  if (KV != H) {  // repeat_kv: each K/V head serves H / KV consecutive query heads
    const int64_t rep = H / KV;
    k = k.unsqueeze(2).expand({B, KV, rep, T, D}).reshape({B, H, T, D});
    v = v.unsqueeze(2).expand({B, KV, rep, T, D}).reshape({B, H, T, D});
  }
  at::Tensor att = at::matmul(q, k.transpose(2, 3)) * (1.0 / std::sqrt(static_cast<double>(D)));
  at::Tensor mask =
      at::ones({T, T}, at::TensorOptions().dtype(at::kBool).device(x.device())).triu(1);
  att = att.masked_fill(mask, -std::numeric_limits<float>::infinity());
  att = at::softmax(att, -1, at::kFloat).to(q.scalar_type());
  at::Tensor y = at::matmul(att, v).transpose(1, 2).contiguous().view({B, T, H * D});
  y = at::linear(y, o_proj->weight);
  return tp ? tp->leave(y) : y;
}

at::Tensor LlamaAttentionImpl::forward_cached(const at::Tensor& x, KVCache& cache, size_t layer) {
  const int64_t B = x.size(0), T = x.size(1), H = o_.num_attention_heads(),
                KV = o_.num_key_value_heads(), D = o_.head_size(), start = cache.length();
  auto heads = [&](const at::Tensor& t, int64_t n) { return t.view({B, T, n, D}).transpose(1, 2); };
  at::Tensor q = heads(at::linear(x, q_proj->weight), H);
  at::Tensor k = heads(at::linear(x, k_proj->weight), KV);
  at::Tensor v = heads(at::linear(x, v_proj->weight), KV);
  // The rows of positions [start, start + T): the same values forward() takes for them.
  auto [cos_all, sin_all] = rotary(start + T, D, o_.rope_theta(), q);
  const at::Tensor cos = cos_all.narrow(0, start, T), sin = sin_all.narrow(0, start, T);
  q = q * cos + rotate_half(q) * sin;
  k = k * cos + rotate_half(k) * sin;
  auto [keys, values] = cache.append(layer, k, v);
  if (KV != H) {
    const int64_t rep = H / KV, L = keys.size(2);
    keys = keys.unsqueeze(2).expand({B, KV, rep, L, D}).reshape({B, H, L, D});
    values = values.unsqueeze(2).expand({B, KV, rep, L, D}).reshape({B, H, L, D});
  }
  at::Tensor y = cached_attention(q, keys, values).transpose(1, 2).contiguous().view({B, T, H * D});
  return at::linear(y, o_proj->weight);
}

LlamaMLPImpl::LlamaMLPImpl(const LlamaOptions& o) {
  gate_proj = register_module("gate_proj", linear(o.hidden_size(), o.intermediate_size()));
  up_proj = register_module("up_proj", linear(o.hidden_size(), o.intermediate_size()));
  down_proj = register_module("down_proj", linear(o.intermediate_size(), o.hidden_size()));
}

at::Tensor LlamaMLPImpl::forward(const at::Tensor& x) {
  if (tp && tp->sequence_parallel()) {  // gate and up from the gathered sequence
    const auto gate_up = tp->colwise(x, {gate_proj->weight, up_proj->weight});
    return tp->leave(at::linear(at::silu(gate_up[0]) * gate_up[1], down_proj->weight));
  }
  const at::Tensor in = tp ? tp->enter(x) : x;
  // gate before up, in separate statements: Hugging Face's order, which autograd (and so DDP's
  // rebuilt buckets) follows; C++ leaves the order of `a * b`'s operands unspecified.
  const at::Tensor gate = at::silu(at::linear(in, gate_proj->weight));
  at::Tensor y = at::linear(gate * at::linear(in, up_proj->weight), down_proj->weight);
  return tp ? tp->leave(y) : y;
}

LlamaDecoderLayerImpl::LlamaDecoderLayerImpl(const LlamaOptions& o) {
  self_attn = register_module("self_attn", LlamaAttention(o));
  mlp = register_module("mlp", LlamaMLP(o));
  input_layernorm =
      register_module("input_layernorm", LlamaRMSNorm(o.hidden_size(), o.rms_norm_eps()));
  post_attention_layernorm =
      register_module("post_attention_layernorm", LlamaRMSNorm(o.hidden_size(), o.rms_norm_eps()));
}

at::Tensor LlamaDecoderLayerImpl::forward(const at::Tensor& x) {
  auto body = [this](const at::Tensor& in) {
    at::Tensor h = in + self_attn->forward(input_layernorm->forward(in));
    return h + mlp->forward(post_attention_layernorm->forward(h));
  };
  if (!recompute) return body(x);
  return sharding::recompute(
      [body](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{body(in[0])}; },
      {x}, parameters())[0];
}

at::Tensor LlamaDecoderLayerImpl::forward_cached(const at::Tensor& x, KVCache& cache,
                                                 size_t layer) {
  at::Tensor h = x + self_attn->forward_cached(input_layernorm->forward(x), cache, layer);
  return h + mlp->forward(post_attention_layernorm->forward(h));
}

LlamaModelImpl::LlamaModelImpl(const LlamaOptions& o) {
  // Deferred: each submodule gives its memory back as soon as it is built.
  auto built = [&](torch::nn::Module& m) {
    if (o.deferred_init()) sharding::defer_parameters(m, c10::kCPU);
  };
  embed_tokens =
      register_module("embed_tokens", torch::nn::Embedding(o.vocab_size(), o.hidden_size()));
  built(*embed_tokens);
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < o.num_hidden_layers(); ++i) {
    LlamaLayerUnit layer(o);
    layer->recompute = o.recompute_every() > 0 && i % o.recompute_every() == 0;
    built(*layer);
    layers->push_back(layer);
  }
  norm = register_module("norm", LlamaRMSNorm(o.hidden_size(), o.rms_norm_eps()));
  built(*norm);
}

at::Tensor LlamaModelImpl::forward(const at::Tensor& tokens) {
  at::Tensor x = tp ? tp->embedding(tokens, embed_tokens->weight) : embed_tokens->forward(tokens);
  for (const auto& layer : *layers) {
    x = layer->as<sharding::UnitImpl<LlamaDecoderLayerImpl>>()->forward(x);
  }
  return norm->forward(x);
}

at::Tensor LlamaModelImpl::forward_cached(const at::Tensor& tokens, KVCache& cache) {
  at::Tensor x = embed_tokens->forward(tokens);
  size_t i = 0;
  for (const auto& layer : *layers) {
    x = layer->as<sharding::UnitImpl<LlamaDecoderLayerImpl>>()->forward_cached(x, cache, i++);
  }
  cache.advance(tokens.size(1));
  return norm->forward(x);
}

LlamaForCausalLMImpl::LlamaForCausalLMImpl(const LlamaOptions& o) : o_(o) {
  init_seed_ = sharding::draw_init_seed();
  model = register_module("model", LlamaModel(o));
  if (!o.tie_word_embeddings()) {
    lm_head = register_module("lm_head", linear(o.hidden_size(), o.vocab_size()));
    if (o.deferred_init()) sharding::defer_parameters(*lm_head, c10::kCPU);
  }
  if (o.deferred_init()) return;
  const sharding::ParamInit init = param_init();
  c10::NoGradGuard no_grad;
  for (auto& p : named_parameters()) init(p.key(), p.value());
}

sharding::ParamInit LlamaForCausalLMImpl::param_init() const {
  const uint64_t seed = init_seed_;
  const double range = o_.initializer_range();
  return [seed, range](const std::string& name, at::Tensor& t) {
    c10::NoGradGuard no_grad;
    if (name.find("norm") != std::string::npos) {  // RMSNorm weights
      t.fill_(1.0);
      return;
    }
    sharding::normal_from(t, range, sharding::parameter_generator(seed, name));
  };
}

at::Tensor LlamaForCausalLMImpl::forward(const at::Tensor& tokens) {
  DTRAIN_CHECK_AS(UsageError, tokens.dim() == 2, "Llama: tokens must be [batch, seq], got ",
                  tokens.sizes());
  at::Tensor h = model->forward(tokens);
  return tp_ ? tp_->colwise(h, {head_weight()})[0] : at::linear(h, head_weight());
}

at::Tensor LlamaForCausalLMImpl::forward_stage(const at::Tensor& x, int64_t begin, int64_t end) {
  const int64_t layers = o_.num_hidden_layers();
  DTRAIN_CHECK_AS(UsageError, 0 <= begin && begin < end && end <= layers, "Llama: stage layers [",
                  begin, ", ", end, ") outside the model's ", layers);
  DTRAIN_CHECK_AS(UsageError, !o_.tie_word_embeddings() || (begin == 0 && end == layers),
                  "Llama: a model with tie_word_embeddings cannot be split into pipeline stages "
                  "(its head is the embedding, whose gradient the first and the last stage "
                  "would each hold a part of); set tie_word_embeddings: false");
  at::Tensor h = x;
  if (begin == 0) {
    DTRAIN_CHECK_AS(UsageError, x.dim() == 2, "Llama: tokens must be [batch, seq], got ",
                    x.sizes());
    h = tp_ ? tp_->embedding(x, model->embed_tokens->weight) : model->embed_tokens->forward(x);
  }
  for (int64_t i = begin; i < end; ++i) {
    h = model->layers[static_cast<size_t>(i)]
            ->as<sharding::UnitImpl<LlamaDecoderLayerImpl>>()
            ->forward(h);
  }
  if (end < layers) return h;
  h = model->norm->forward(h);
  return tp_ ? tp_->colwise(h, {head_weight()})[0] : at::linear(h, head_weight());
}

const at::Tensor& LlamaForCausalLMImpl::head_weight() const {
  return o_.tie_word_embeddings() ? model->embed_tokens->weight : lm_head->weight;
}

sharding::Plan LlamaForCausalLMImpl::tp_plan() {
  using sharding::Style;
  return {{"model.embed_tokens", Style::kVocab},
          {"model.layers.*.self_attn.q_proj", Style::kColwise},
          {"model.layers.*.self_attn.k_proj", Style::kColwise},
          {"model.layers.*.self_attn.v_proj", Style::kColwise},
          {"model.layers.*.self_attn.o_proj", Style::kRowwise},
          {"model.layers.*.mlp.gate_proj", Style::kColwise},
          {"model.layers.*.mlp.up_proj", Style::kColwise},
          {"model.layers.*.mlp.down_proj", Style::kRowwise},
          {"lm_head", Style::kColwise}};
}

std::vector<std::string> LlamaForCausalLMImpl::parallelize(
    std::shared_ptr<sharding::TensorParallelism> t) {
  const int64_t n = t->size();
  for (const auto& [key, value] : std::vector<std::pair<const char*, int64_t>>{
           {"num_attention_heads", o_.num_attention_heads()},
           {"num_key_value_heads", o_.num_key_value_heads()},
           {"intermediate_size", o_.intermediate_size()},
           {"vocab_size", o_.vocab_size()}}) {
    DTRAIN_CHECK_AS(ConfigError, value % n == 0, "tensor parallelism over ", n,
                    " ranks (parallel.tp) cuts model.", key, " ", value,
                    " into equal parts, and it does not divide by ", n,
                    ": choose parallel.tp dividing it");
  }
  std::vector<std::string> done = t->apply(*this, tp_plan());
  tp_ = t;
  model->tp = t;
  for (const auto& layer : *model->layers) {
    auto* l = layer->as<sharding::UnitImpl<LlamaDecoderLayerImpl>>();
    l->self_attn->tp = t;
    l->mlp->tp = t;
  }
  return done;
}

at::Tensor LlamaForCausalLMImpl::forward_cached(const at::Tensor& tokens, KVCache& cache) {
  DTRAIN_CHECK_AS(UsageError, tokens.dim() == 2, "Llama: tokens must be [batch, seq], got ",
                  tokens.sizes());
  DTRAIN_CHECK_AS(UsageError, !tp_,
                  "Llama: generation with a KV cache runs on one process, "
                  "not under tensor parallelism");
  at::Tensor h = model->forward_cached(tokens, cache);
  return at::linear(h, o_.tie_word_embeddings() ? model->embed_tokens->weight : lm_head->weight);
}

LlamaForCausalLM load_hf_llama(const std::string& dir) {
  LlamaForCausalLM m(read_hf_llama_config(dir + "/config.json"));
  load_hf_llama_weights(*m, dir);
  return m;
}

namespace {

// A checkpoint folder's tensors by name, each copied into the parameter of that name and shape.
class HfTensors {
 public:
  explicit HfTensors(const std::string& dir) : dir_(dir) {
    for (auto& [name, t] : ckpt::read_safetensors_dir(dir).tensors) tensors_.emplace(name, t);
  }

  void copy_into(const std::string& name, at::Tensor& param) {
    auto it = tensors_.find(name);
    DTRAIN_CHECK_AS(ConfigError, it != tensors_.end(), dir_, ": no tensor '", name,
                    "' in the checkpoint");
    DTRAIN_CHECK_AS(ConfigError, it->second.sizes() == param.sizes(), dir_, ": tensor '", name,
                    "' has shape ", it->second.sizes(), ", the model's is ", param.sizes(),
                    " (config.json does not match the weights)");
    c10::NoGradGuard no_grad;
    param.copy_(it->second);
    used_.insert(name);
  }

  // Every tensor went into a parameter (a tied head may be saved as well: transformers writes
  // it when asked to).
  void expect_all_used(bool tied) const {
    std::vector<std::string> left;
    for (const auto& [name, t] : tensors_) {
      if (!used_.count(name) && !(tied && name == "lm_head.weight")) left.push_back(name);
    }
    DTRAIN_CHECK_AS(ConfigError, left.empty(), dir_, ": tensor '", left.empty() ? "" : left.front(),
                    "' matches no parameter of the model (", left.size(), " left over)");
  }

 private:
  std::string dir_;
  std::map<std::string, at::Tensor> tensors_;  // memory-mapped
  std::set<std::string> used_;
};

}  // namespace

void load_hf_llama_weights(LlamaForCausalLMImpl& model, const std::string& dir) {
  HfTensors tensors(dir);
  for (auto& p : model.named_parameters()) tensors.copy_into(p.key(), p.value());
  tensors.expect_all_used(model.options().tie_word_embeddings());
}

sharding::ParamInit hf_llama_param_init(const std::string& dir) {
  auto tensors = std::make_shared<HfTensors>(dir);
  return [tensors](const std::string& name, at::Tensor& t) { tensors->copy_into(name, t); };
}

void save_hf_llama(const LlamaForCausalLMImpl& model, const std::string& dir) {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& p : model.named_parameters()) tensors.emplace_back(p.key(), p.value());
  save_hf_llama(model.options(), tensors, dir);
}

void save_hf_llama(const LlamaOptions& o,
                   const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                   const std::string& dir) {
  ::mkdir(dir.c_str(), 0755);
  const at::ScalarType dtype = tensors.empty() ? at::kFloat : tensors.back().second.scalar_type();
  ckpt::write_safetensors(dir + "/model.safetensors", tensors, {{"format", "pt"}});
  const char* dtype_name = dtype == at::kBFloat16 ? "bfloat16"
                           : dtype == at::kHalf   ? "float16"
                                                  : "float32";
  std::ostringstream c;
  c.precision(17);
  c << "{\n  \"architectures\": [\"LlamaForCausalLM\"],\n  \"model_type\": \"llama\",\n"
    << "  \"hidden_act\": \"silu\",\n  \"attention_bias\": false,\n  \"mlp_bias\": false,\n"
    << "  \"vocab_size\": " << o.vocab_size() << ",\n  \"hidden_size\": " << o.hidden_size()
    << ",\n  \"intermediate_size\": " << o.intermediate_size()
    << ",\n  \"num_hidden_layers\": " << o.num_hidden_layers()
    << ",\n  \"num_attention_heads\": " << o.num_attention_heads()
    << ",\n  \"num_key_value_heads\": " << o.num_key_value_heads()
    << ",\n  \"head_dim\": " << o.head_size()
    << ",\n  \"max_position_embeddings\": " << o.max_position_embeddings()
    << ",\n  \"rms_norm_eps\": " << o.rms_norm_eps() << ",\n  \"rope_theta\": " << o.rope_theta()
    << ",\n  \"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": " << o.rope_theta()
    << "},\n  \"tie_word_embeddings\": " << (o.tie_word_embeddings() ? "true" : "false")
    << ",\n  \"torch_dtype\": \"" << dtype_name << "\",\n  \"dtype\": \"" << dtype_name
    << "\"\n}\n";
  std::ofstream f(dir + "/config.json");
  f << c.str();
  DTRAIN_CHECK_AS(CheckpointError, static_cast<bool>(f), dir, "/config.json: cannot write");
}

void build_llama(const BuildContext& ctx, BuiltModel& out) {
  const RunConfig& c = ctx.config;
  const auto& m = c.model.as<LlamaSettings>();
  LlamaOptions o = m.options;
  // Under FSDP: placeholders, and each unit initialized (or loaded from the checkpoint) as it
  // is sharded; under a pipeline, each rank's own stages' parameters alone; otherwise the
  // whole model, loaded on every rank (DDP broadcasts rank 0's).
  const bool pipelined = ctx.mesh && ctx.mesh->shape().pp > 1;
  const bool deferred = ctx.comm && (c.parallel.strategy == ParallelStrategy::kFsdp || pipelined) &&
                        o.deferred_init();
  o.deferred_init(deferred);
  LlamaForCausalLM lm(o);
  sharding::ParamInit init;
  if (deferred) {
    sharding::defer_parameters(*lm, ctx.device);
    init = m.pretrained.empty() ? lm->param_init() : hf_llama_param_init(m.pretrained);
  } else {
    if (!m.pretrained.empty()) load_hf_llama_weights(*lm, m.pretrained);
    lm->to(ctx.device);
  }
  // Tensor parallelism: each rank keeps its slices of the whole model (made or loaded whole,
  // or, deferred, each full tensor made and sliced as FSDP reaches its unit), then the
  // strategy runs over the data-parallel ranks.
  std::shared_ptr<sharding::TensorParallelism> tp;
  std::shared_ptr<comm::Communicator> dp = ctx.comm;
  if (ctx.mesh && ctx.mesh->shape().tp > 1) {
    tp = std::make_shared<sharding::TensorParallelism>(ctx.mesh->tp(), c.parallel.sequence_parallel,
                                                       c.parallel.sequence_parallel_regather);
    const auto sliced = lm->parallelize(tp);
    logging::debug("tensor parallel: ", sliced.size(), " parameters sliced over ", tp->size(),
                   " ranks");
    if (init) init = tp->slice_init(init);
    dp = ctx.mesh->dp();
  }
  const double n = static_cast<double>(llama_parameter_count(o));
  const int64_t every = o.recompute_every();
  logging::info("model: Llama, ", n / 1e6, "M parameters",
                m.pretrained.empty() ? std::string() : ", from " + m.pretrained,
                every == 0 ? std::string()
                : every == 1
                    ? std::string(", every layer recomputed in backward")
                    : ", one layer in every " + std::to_string(every) + " recomputed in backward");
  out.task.description = "Llama " + logging::fixed(n / 1e6, 1) + "M";
  if (tp) {
    // The vocabulary-parallel cross-entropy: the logits stay sliced over the TP group.
    out.task.loss = [lm, tp](const at::Tensor& output, const Batch& b) {
      return tp->loss(output.reshape({-1, output.size(-1)}), b.targets.reshape(-1),
                      lm->head_weight());
    };
  } else {
    out.task.loss = cross_entropy;
  }
  out.task.per_token_validation = true;
  if (pipelined) {
    // Pipeline parallelism: stages of decoder layers (framework/pipeline_strategy.h).
    out.task.make_strategy = [lm, init, tp, mesh = ctx.mesh, c = &c,
                              o](amp::NumericsMonitor*) -> std::unique_ptr<Strategy> {
      PipelineModel pm;
      pm.module = lm.ptr();
      pm.init = init;
      pm.layers = o.num_hidden_layers();
      pm.hidden = o.hidden_size();
      pm.forward = [lm](const at::Tensor& x, int64_t begin, int64_t end) mutable {
        return lm->forward_stage(x, begin, end);
      };
      pm.layer_of = [layers = pm.layers](const std::string& name) -> int64_t {
        constexpr char kLayers[] = "model.layers.";
        if (name.rfind(kLayers, 0) == 0) {
          const size_t at = sizeof(kLayers) - 1;
          return std::stoll(name.substr(at, name.find('.', at) - at));
        }
        return name.rfind("model.embed_tokens.", 0) == 0 ? -1 : layers;
      };
      auto s = std::make_unique<PipelineStrategy>(std::move(pm), mesh, *c);
      // Tensor parallelism inside each stage: the mesh's tp groups (the same stages).
      if (tp) s->set_tensor_parallel(tp, [lm] { return lm->head_weight(); });
      return s;
    };
  } else {
    out.task.make_strategy = [lm, init, dp, tp, c = &c](amp::NumericsMonitor* mon) {
      auto s = make_strategy(lm, dp, *c, mon, init);
      if (tp) s->set_tensor_parallel(tp, [lm] { return lm->head_weight(); });
      return s;
    };
  }
  if (!m.save_pretrained.empty()) {
    // The trained parameters as a Hugging Face checkpoint, written by rank 0 (under FSDP every
    // rank gathers them: a collective).
    out.task.on_finish = [o, dir = m.save_pretrained, rank = ctx.rank](Strategy& s) {
      std::vector<std::pair<std::string, at::Tensor>> tensors;
      // A pipeline's ranks hold their own stages' current values: shared first (collective).
      if (s.pipeline() != nullptr) s.pipeline()->share(nullptr);
      if (s.fsdp() != nullptr) {
        tensors = s.fsdp()->full_parameters();
        // Under tensor parallelism, the slices gathered over the TP group too.
        for (auto& [name, t] : tensors) t = s.full_parameter(name, t).cpu();
      } else if (s.tensor_parallel() != nullptr) {  // gathers: every rank takes part
        for (const auto& p : s.module().named_parameters()) {
          tensors.emplace_back(p.key(), s.full_parameter(p.key(), p.value().detach()).cpu());
        }
      } else if (rank == 0) {  // every rank holds them: only the writer copies
        for (const auto& p : s.module().named_parameters()) {
          tensors.emplace_back(p.key(), p.value().detach().cpu());
        }
      }
      if (rank != 0) return;
      save_hf_llama(o, tensors, dir);
      logging::info("model: saved as a Hugging Face checkpoint in ", dir);
    };
  }
}

}  // namespace dtrain::framework
