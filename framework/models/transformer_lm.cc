#include "framework/models/transformer_lm.h"

#include <ATen/ATen.h>
#include <torch/nn/init.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <utility>

#include "core/error.h"
#include "core/logging.h"
#include "framework/task.h"
#include "sharding/recompute.h"

namespace dtrain::framework {

CausalSelfAttentionImpl::CausalSelfAttentionImpl(int64_t d_model, int64_t n_heads,
                                                 AttentionSetting attention)
    : n_heads_(n_heads), attention_(attention) {
  DTRAIN_CHECK_AS(ConfigError, d_model % n_heads == 0, "d_model ", d_model,
                  " must be divisible by n_heads ", n_heads);
  qkv = register_module("qkv", torch::nn::Linear(d_model, 3 * d_model));
  proj = register_module("proj", torch::nn::Linear(d_model, d_model));
}

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            AttentionKernel kernel) {
  if (kernel == AttentionKernel::kFused) {
    return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                            /*is_causal=*/true);
  }
  const int64_t T = q.size(-2), D = q.size(-1);
  at::Tensor att = at::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(D)));
  at::Tensor mask =
      at::ones({T, T}, at::TensorOptions().dtype(at::kBool).device(q.device())).triu(1);
  att = att.masked_fill(mask, -std::numeric_limits<float>::infinity());
  att = at::softmax(att.to(at::kFloat), -1).to(v.scalar_type());
  return at::matmul(att, v);
}

at::Tensor CausalSelfAttentionImpl::forward(const at::Tensor& x) {
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2), H = n_heads_, D = C / H;
  auto parts = at::linear(x, qkv->weight, qkv->bias).split(C, /*dim=*/2);
  auto heads = [&](const at::Tensor& t) { return t.view({B, T, H, D}).transpose(1, 2); };
  const at::Tensor q = heads(parts[0]);
  at::Tensor y =
      causal_attention(q, heads(parts[1]), heads(parts[2]),
                       resolve_attention(attention_, q.device().type(), q.scalar_type(), T, D));
  return at::linear(y.transpose(1, 2).contiguous().view({B, T, C}), proj->weight, proj->bias);
}

at::Tensor CausalSelfAttentionImpl::forward_cached(const at::Tensor& x, KVCache& cache,
                                                   size_t layer) {
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2), H = n_heads_, D = C / H;
  auto parts = at::linear(x, qkv->weight, qkv->bias).split(C, /*dim=*/2);
  auto heads = [&](const at::Tensor& t) { return t.view({B, T, H, D}).transpose(1, 2); };
  auto [k, v] = cache.append(layer, heads(parts[1]), heads(parts[2]));
  at::Tensor y = cached_attention(heads(parts[0]), k, v);
  return at::linear(y.transpose(1, 2).contiguous().view({B, T, C}), proj->weight, proj->bias);
}

BlockImpl::BlockImpl(int64_t d_model, int64_t n_heads, int64_t d_ff, AttentionSetting attention) {
  ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})));
  attn = register_module("attn", CausalSelfAttention(d_model, n_heads, attention));
  ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})));
  fc = register_module("fc", torch::nn::Linear(d_model, d_ff));
  fc_proj = register_module("fc_proj", torch::nn::Linear(d_ff, d_model));
}

at::Tensor BlockImpl::forward(const at::Tensor& x) {
  auto body = [this](const at::Tensor& in) {
    at::Tensor h = in + attn->forward(ln1->forward(in));
    at::Tensor f = at::gelu(at::linear(ln2->forward(h), fc->weight, fc->bias), "tanh");
    return h + at::linear(f, fc_proj->weight, fc_proj->bias);
  };
  if (!recompute) return body(x);
  return sharding::recompute(
      [body](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{body(in[0])}; },
      {x}, parameters())[0];
}

at::Tensor BlockImpl::forward_cached(const at::Tensor& x, KVCache& cache, size_t layer) {
  at::Tensor h = x + attn->forward_cached(ln1->forward(x), cache, layer);
  at::Tensor f = at::gelu(at::linear(ln2->forward(h), fc->weight, fc->bias), "tanh");
  return h + at::linear(f, fc_proj->weight, fc_proj->bias);
}

TransformerLMImpl::TransformerLMImpl(const TransformerLMOptions& o) : options_(o) {
  // The one draw from the default generator; every parameter's own generator derives from it.
  init_seed_ = sharding::draw_init_seed();
  // Deferred: each submodule gives its memory back as soon as it is built, so the transient
  // peak is the largest one (a block or an embedding), never the model.
  auto built = [&](torch::nn::Module& m) {
    if (o.deferred_init()) sharding::defer_parameters(m, c10::kCPU);
  };
  tok_emb = register_module("tok_emb", torch::nn::Embedding(o.vocab_size(), o.d_model()));
  built(*tok_emb);
  pos_emb = register_module("pos_emb", torch::nn::Embedding(o.seq_len(), o.d_model()));
  built(*pos_emb);
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < o.n_layers(); ++i) {
    BlockUnit block(o.d_model(), o.n_heads(), o.d_ff(), o.attention());
    block->recompute = o.recompute_every() > 0 && i % o.recompute_every() == 0;
    built(*block);
    blocks->push_back(block);
  }
  ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.d_model()})));
  if (!o.tie_weights()) {
    head = register_module(
        "head",
        torch::nn::Linear(torch::nn::LinearOptions(o.d_model(), o.vocab_size()).bias(false)));
    built(*head);
  }
  if (o.deferred_init()) {
    built(*ln_f);
    return;
  }
  const sharding::ParamInit init = param_init();
  c10::NoGradGuard no_grad;
  for (auto& p : named_parameters()) init(p.key(), p.value());
}

namespace {

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

}  // namespace

sharding::ParamInit TransformerLMImpl::param_init() const {
  const uint64_t seed = init_seed_;
  const double residual_std = 0.02 / std::sqrt(2.0 * static_cast<double>(options_.n_layers()));
  return [seed, residual_std](const std::string& name, at::Tensor& t) {
    c10::NoGradGuard no_grad;
    const bool norm = name.find("ln") != std::string::npos;  // LayerNorm: ones / zeros
    if (ends_with(name, "bias")) {
      t.zero_();
      return;
    }
    if (norm) {
      t.fill_(1.0);
      return;
    }
    const double stdev = name.find("attn.proj.weight") != std::string::npos ||
                                 name.find("fc_proj.weight") != std::string::npos
                             ? residual_std
                             : 0.02;
    sharding::normal_from(t, stdev, sharding::parameter_generator(seed, name));
  };
}

at::Tensor TransformerLMImpl::forward(const at::Tensor& tokens) {
  const int64_t T = tokens.size(1);
  DTRAIN_CHECK_AS(UsageError, T <= options_.seq_len(), "TransformerLM: sequence of ", T,
                  " tokens is longer than seq_len ", options_.seq_len());
  at::Tensor pos = at::arange(T, at::TensorOptions().dtype(at::kLong).device(tokens.device()));
  // Token embedding first, then positions, as Python evaluates `a + b`: C++ leaves the order
  // of an operator's operands unspecified, and autograd's order (hence DDP's rebuilt buckets
  // and so the sums' order) follows the order the nodes were made in.
  at::Tensor x = tok_emb->forward(tokens);
  x = x + pos_emb->forward(pos);
  for (const auto& block : *blocks) x = block->as<sharding::UnitImpl<BlockImpl>>()->forward(x);
  x = ln_f->forward(x);
  return at::linear(x, options_.tie_weights() ? tok_emb->weight : head->weight);
}

at::Tensor TransformerLMImpl::forward_cached(const at::Tensor& tokens, KVCache& cache) {
  const int64_t T = tokens.size(1), start = cache.length();
  DTRAIN_CHECK_AS(UsageError, start + T <= options_.seq_len(), "TransformerLM: ", start + T,
                  " positions exceed seq_len ", options_.seq_len());
  at::Tensor pos =
      at::arange(start, start + T, at::TensorOptions().dtype(at::kLong).device(tokens.device()));
  at::Tensor x = tok_emb->forward(tokens);
  x = x + pos_emb->forward(pos);
  size_t layer = 0;
  for (const auto& block : *blocks) {
    x = block->as<sharding::UnitImpl<BlockImpl>>()->forward_cached(x, cache, layer++);
  }
  cache.advance(T);
  x = ln_f->forward(x);
  return at::linear(x, options_.tie_weights() ? tok_emb->weight : head->weight);
}

void build_transformer_lm(const BuildContext& ctx, BuiltModel& out) {
  const RunConfig& c = ctx.config;
  const auto& m = c.model.as<TransformerLMSettings>();
  TransformerLMOptions o = m.options();
  // Under FSDP the model is built without memory and each rank initializes one unit at a
  // time, keeping its shards (the same bits as an eager build under this seed).
  const bool deferred =
      ctx.comm && c.parallel.strategy == ParallelStrategy::kFsdp && m.deferred_init;
  o.deferred_init(deferred);
  TransformerLM lm(o);
  if (deferred) {
    sharding::defer_parameters(*lm, ctx.device);  // placeholders on the run's device
  } else {
    lm->to(ctx.device);
  }
  const double n = static_cast<double>(transformer_lm_parameter_count(o));
  const int64_t head_dim = o.d_model() / o.n_heads();
  const c10::ScalarType dtype = c.precision.mixed.param_dtype;
  if (o.attention() == AttentionSetting::kAuto) {
    logging::info("attention: ", choose_attention(ctx.device, dtype, o.seq_len(), head_dim).why,
                  " (model.attention: fused or explicit pins one)");
  } else {
    logging::info("attention: the ", name_of(o.attention()), " kernel (model.attention)");
  }
  logging::info("model: TransformerLM, ", n / 1e6, "M parameters",
                m.recompute_every == 0 ? std::string()
                : m.recompute_every == 1
                    ? std::string(", every block recomputed in backward")
                    : ", one block in every " + std::to_string(m.recompute_every) +
                          " recomputed in backward");
  out.task.description = "TransformerLM " + logging::fixed(n / 1e6, 1) + "M";
  out.task.loss = cross_entropy;
  out.task.per_token_validation = true;
  out.task.make_strategy = [lm, deferred, comm = ctx.comm, c = &c](amp::NumericsMonitor* mon) {
    return make_strategy(lm, comm, *c, mon, deferred ? lm->param_init() : sharding::ParamInit());
  };
}

}  // namespace dtrain::framework
