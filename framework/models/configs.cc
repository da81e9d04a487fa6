#include "framework/models/configs.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <fstream>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "core/error.h"

namespace dtrain::framework {

int64_t transformer_lm_parameter_count(const TransformerLMOptions& o) {
  const int64_t d = o.d_model(), f = o.d_ff();
  int64_t block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d);
  int64_t total = o.vocab_size() * d + o.seq_len() * d + o.n_layers() * block + 2 * d;
  if (!o.tie_weights()) total += d * o.vocab_size();
  return total;
}

TransformerLMOptions TransformerLMSettings::options() const {
  return TransformerLMOptions()
      .vocab_size(vocab_size)
      .seq_len(seq_len)
      .d_model(d_model)
      .n_layers(n_layers)
      .n_heads(n_heads)
      .d_ff(d_ff)
      .tie_weights(tie_weights)
      .recompute_every(recompute_every)
      .attention(attention);
}

MLPOptions MLPSettings::options() const {
  return MLPOptions()
      .in_features(in_features)
      .hidden(hidden)
      .depth(depth)
      .out_features(out_features);
}

int64_t llama_parameter_count(const LlamaOptions& o) {
  const int64_t h = o.hidden_size(), q = o.num_attention_heads() * o.head_size(),
                kv = o.num_key_value_heads() * o.head_size(), v = o.vocab_size();
  const int64_t layer = h * q + 2 * h * kv + q * h + 3 * h * o.intermediate_size() + 2 * h;
  return v * h + o.num_hidden_layers() * layer + h + (o.tie_word_embeddings() ? 0 : v * h);
}

LlamaOptions read_hf_llama_config(const std::string& path) {
  YAML::Node c;
  try {
    c = YAML::LoadFile(path);
  } catch (const YAML::Exception& e) {
    DTRAIN_FAIL(ConfigError, path, ": cannot read: ", e.what());
  }
  DTRAIN_CHECK_AS(ConfigError, c.IsMap(), path, ": not a JSON object");
  auto get = [&](const char* key, auto fallback) {
    using T = decltype(fallback);
    if (!c[key] || c[key].IsNull()) return fallback;
    try {
      return c[key].template as<T>();
    } catch (const YAML::Exception& e) {
      DTRAIN_FAIL(ConfigError, path, ": ", key, ": ", e.what());
    }
  };
  const std::string type = get("model_type", std::string("llama"));
  DTRAIN_CHECK_AS(ConfigError, type == "llama", path, ": model_type '", type, "' is not llama");
  DTRAIN_CHECK_AS(ConfigError, get("hidden_act", std::string("silu")) == "silu", path,
                  ": hidden_act must be silu");
  DTRAIN_CHECK_AS(ConfigError, !get("attention_bias", false) && !get("mlp_bias", false), path,
                  ": attention_bias and mlp_bias are not supported");
  double theta = get("rope_theta", 10000.0);
  std::string rope_type = "default";
  for (const char* section : {"rope_parameters", "rope_scaling"}) {
    const YAML::Node r = c[section];
    if (!r || !r.IsMap()) continue;
    if (r["rope_theta"]) theta = r["rope_theta"].as<double>();
    if (r["rope_type"]) rope_type = r["rope_type"].as<std::string>();
    if (r["type"]) rope_type = r["type"].as<std::string>();
  }
  DTRAIN_CHECK_AS(ConfigError, rope_type == "default", path, ": rope type '", rope_type,
                  "' is not supported (only the default RoPE)");
  LlamaOptions o;
  o.vocab_size(get("vocab_size", int64_t{32000}))
      .hidden_size(get("hidden_size", int64_t{4096}))
      .intermediate_size(get("intermediate_size", int64_t{11008}))
      .num_hidden_layers(get("num_hidden_layers", int64_t{32}))
      .num_attention_heads(get("num_attention_heads", int64_t{32}))
      .max_position_embeddings(get("max_position_embeddings", int64_t{2048}))
      .rms_norm_eps(get("rms_norm_eps", 1e-6))
      .rope_theta(theta)
      .tie_word_embeddings(get("tie_word_embeddings", false))
      .head_dim(get("head_dim", int64_t{0}));
  o.num_key_value_heads(get("num_key_value_heads", o.num_attention_heads()));
  return o;
}

namespace {

std::unique_ptr<ModelSettings> read_transformer(ConfigSection& s) {
  auto m = std::make_unique<TransformerLMSettings>();
  read_vocab_size(s, m->vocab_size);
  s.read("seq_len", m->seq_len);
  s.read("d_model", m->d_model);
  s.read("n_layers", m->n_layers);
  s.read("n_heads", m->n_heads);
  s.read("d_ff", m->d_ff);
  s.read("tie_weights", m->tie_weights);
  m->recompute_every = read_recompute(s);
  s.read("deferred_init", m->deferred_init);
  s.read_choice("attention", m->attention);
  for (auto [key, v] : {std::pair<const char*, int64_t>{"seq_len", m->seq_len},
                        {"d_model", m->d_model},
                        {"n_layers", m->n_layers},
                        {"n_heads", m->n_heads},
                        {"d_ff", m->d_ff}}) {
    s.check(v >= 1, key, "must be >= 1, got " + std::to_string(v));
  }
  s.check(m->d_model % m->n_heads == 0, "n_heads",
          "d_model " + std::to_string(m->d_model) + " must be divisible by n_heads " +
              std::to_string(m->n_heads));
  return m;
}

// Bytes saved for backward per micro-batch: ~16 d_model-wide values per block in the compute
// dtype, the attention's own (the fused kernel's log-sum-exp, one fp32 value per head and
// token; the explicit one's T x T probabilities, in fp32 and in a 16-bit compute dtype, per
// head: framework/models/attention.h says which the run uses), and the logits with their fp32 loss
// copies and gradients (16 bytes per vocabulary entry besides the logits themselves). A recomputed
// block (i % K == 0) keeps its input only (the residual stream: the compute dtype under FSDP, fp32
// under autocast). The peak holds the kept blocks' activations at the start of backward, or, while
// the last recomputed block (K (r - 1)) runs again, its own and those of the (K - 1)(r - 1) kept
// blocks below it. Within 1% of a measured fp32 step (memory_estimate_test).
double transformer_activations(const RunConfig& c, const TransformerLMSettings& m,
                               int64_t recompute_every) {
  const double cb = compute_bytes(c);
  const double d = static_cast<double>(m.d_model), t = static_cast<double>(m.seq_len);
  const AttentionKernel kernel =
      resolve_attention(m.attention, torch_device(c.device), c.precision.mixed.param_dtype,
                        m.seq_len, m.d_model / m.n_heads);
  const double attention = kernel == AttentionKernel::kFused ? 4 : t * (4 + (cb != 4 ? cb : 0));
  const double block = 16 * d * cb + static_cast<double>(m.n_heads) * attention;
  double live_blocks = static_cast<double>(m.n_layers), kept_inputs = 0;
  if (recompute_every > 0) {
    const int64_t r = (m.n_layers - 1) / recompute_every + 1;
    live_blocks =
        static_cast<double>(std::max(m.n_layers - r, (recompute_every - 1) * (r - 1) + 1));
    kept_inputs = static_cast<double>(r);
  }
  const double input = c.parallel.strategy == ParallelStrategy::kFsdp ? cb : 4;
  const double per_token =
      live_blocks * block + kept_inputs * d * input + static_cast<double>(m.vocab_size) * (cb + 16);
  return micro_batch_samples(c) * t * per_token;
}

ModelMemory transformer_memory(const RunConfig& c) {
  const auto& m = c.model.as<TransformerLMSettings>();
  ModelMemory e;
  e.parameters = transformer_lm_parameter_count(m.options());
  const double d = static_cast<double>(m.d_model), ff = static_cast<double>(m.d_ff);
  e.largest_unit = 4 * d + 4 * d * d + 4 * d + 2 * d * ff + ff + d;
  e.root = static_cast<double>(e.parameters) - e.largest_unit * static_cast<double>(m.n_layers);
  e.activations = transformer_activations(c, m, m.recompute_every);
  e.activations_other_recompute = transformer_activations(c, m, m.recompute_every == 0 ? 1 : 0);
  const AttentionKernel kernel =
      resolve_attention(m.attention, torch_device(c.device), c.precision.mixed.param_dtype,
                        m.seq_len, m.d_model / m.n_heads);
  e.activations_note = kernel == AttentionKernel::kFused
                           ? "attention: the fused kernel"
                           : "attention: the explicit softmax, T x T probabilities kept";
  e.deferred_under_fsdp = m.deferred_init;
  return e;
}

std::unique_ptr<ModelSettings> read_mlp(ConfigSection& s) {
  auto m = std::make_unique<MLPSettings>();
  s.read("in_features", m->in_features);
  s.read("hidden", m->hidden);
  s.read("depth", m->depth);
  s.read("out_features", m->out_features);
  for (auto [key, v] : {std::pair<const char*, int64_t>{"in_features", m->in_features},
                        {"hidden", m->hidden},
                        {"depth", m->depth},
                        {"out_features", m->out_features}}) {
    s.check(v >= 1, key, "must be >= 1, got " + std::to_string(v));
  }
  return m;
}

// Each hidden layer is a unit; the output layer stays in the root. Saved for backward: the
// input and GELU output of each hidden layer and the logits, in fp32.
ModelMemory mlp_memory(const RunConfig& c) {
  const auto& m = c.model.as<MLPSettings>();
  ModelMemory e;
  int64_t n = 0, width = m.in_features;
  for (int64_t i = 0; i < m.depth; ++i) {
    n += width * m.hidden + m.hidden;
    e.largest_unit = std::max(e.largest_unit, static_cast<double>(width * m.hidden + m.hidden));
    width = m.hidden;
  }
  e.root = static_cast<double>(width * m.out_features + m.out_features);
  e.parameters = n + static_cast<int64_t>(e.root);
  e.activations =
      micro_batch_samples(c) * static_cast<double>(2 * m.hidden * m.depth + m.out_features) * 4;
  return e;
}

std::unique_ptr<ModelSettings> read_llama(ConfigSection& s) {
  auto m = std::make_unique<LlamaSettings>();
  LlamaOptions& o = m->options;
  s.read("pretrained", m->pretrained);
  s.read("save_pretrained", m->save_pretrained);
  s.read("seq_len", m->seq_len);
  bool deferred = true;
  s.read("deferred_init", deferred);
  const int64_t recompute_every = read_recompute(s);
  const char* shape_keys[] = {
      "vocab_size",          "hidden_size",         "intermediate_size",  "num_hidden_layers",
      "num_attention_heads", "num_key_value_heads", "head_dim",           "max_position_embeddings",
      "rms_norm_eps",        "rope_theta",          "tie_word_embeddings"};
  if (!m->pretrained.empty()) {
    for (const char* key : shape_keys) {
      s.check(!s.has(key), key,
              "comes from the pretrained checkpoint's config.json (" + m->pretrained +
                  "/config.json); remove it, or remove model.pretrained");
      s.allow(key);
    }
    s.allow("initializer_range");
    s.check(!s.has("initializer_range"), "initializer_range",
            "does not apply: the pretrained checkpoint gives the initial values");
    const std::string json = m->pretrained + "/config.json";
    s.check(std::ifstream(json).good(), "pretrained",
            "'" + m->pretrained +
                "' has no readable config.json: give a Hugging Face LlamaForCausalLM directory "
                "(config.json and model.safetensors, or its shards and index)");
    try {
      o = read_hf_llama_config(json);
    } catch (const ConfigError& e) {
      s.fail("pretrained", e.what());
    }
  } else {
    int64_t vocab = o.vocab_size(), hidden = o.hidden_size(), inter = o.intermediate_size(),
            layers = o.num_hidden_layers(), heads = o.num_attention_heads(), kv = -1,
            head_dim = o.head_dim(), positions = o.max_position_embeddings();
    double eps = o.rms_norm_eps(), theta = o.rope_theta(), range = o.initializer_range();
    bool tie = o.tie_word_embeddings();
    read_vocab_size(s, vocab);
    s.read("hidden_size", hidden);
    s.read("intermediate_size", inter);
    s.read("num_hidden_layers", layers);
    s.read("num_attention_heads", heads);
    s.read("num_key_value_heads", kv);
    s.read("head_dim", head_dim);
    s.read("max_position_embeddings", positions);
    s.read("rms_norm_eps", eps);
    s.read("rope_theta", theta);
    s.read("tie_word_embeddings", tie);
    s.read("initializer_range", range);
    if (kv < 0) kv = heads;  // LlamaConfig: num_key_value_heads defaults to the heads
    for (auto [key, v] : {std::pair<const char*, int64_t>{"hidden_size", hidden},
                          {"intermediate_size", inter},
                          {"num_hidden_layers", layers},
                          {"num_attention_heads", heads},
                          {"num_key_value_heads", kv},
                          {"max_position_embeddings", positions}}) {
      s.check(v >= 1, key, "must be >= 1, got " + std::to_string(v));
    }
    s.check(head_dim >= 0, "head_dim", "must be >= 0 (0: hidden_size / num_attention_heads)");
    s.check(head_dim > 0 || hidden % heads == 0, "num_attention_heads",
            "hidden_size " + std::to_string(hidden) + " must be divisible by num_attention_heads " +
                std::to_string(heads) + " (or give head_dim)");
    s.check(heads % kv == 0, "num_key_value_heads",
            "must divide num_attention_heads " + std::to_string(heads) +
                " (grouped-query "
                "attention shares each K/V head among a whole number of query heads), got " +
                std::to_string(kv));
    s.check(eps > 0, "rms_norm_eps", "must be > 0");
    s.check(theta > 0, "rope_theta", "must be > 0");
    s.check(range > 0, "initializer_range", "must be > 0");
    o.vocab_size(vocab)
        .hidden_size(hidden)
        .intermediate_size(inter)
        .num_hidden_layers(layers)
        .num_attention_heads(heads)
        .num_key_value_heads(kv)
        .head_dim(head_dim)
        .max_position_embeddings(positions)
        .rms_norm_eps(eps)
        .rope_theta(theta)
        .tie_word_embeddings(tie)
        .initializer_range(range);
  }
  s.check(m->seq_len >= 1 && m->seq_len <= o.max_position_embeddings(), "seq_len",
          "must be in [1, max_position_embeddings " + std::to_string(o.max_position_embeddings()) +
              "], got " + std::to_string(m->seq_len));
  o.deferred_init(deferred);
  o.recompute_every(recompute_every);
  return m;
}

// Saved for backward per token and layer, in the compute dtype: the two RMSNorms' inputs and
// outputs (4 h); q, k and v (q + 2 kv), q and k rotated (q + kv), k and v repeated for the
// query heads (2 q) and the attention output (q); the SwiGLU's gate, up, silu(gate) and
// product (4 I); and the softmax's probabilities in fp32 (and their cast in 16 bits). Then the
// logits with their fp32 loss copies. Derived from the forward, as the TransformerLM's was.
ModelMemory llama_memory(const RunConfig& c) {
  const auto& m = c.model.as<LlamaSettings>();
  const LlamaOptions& o = m.options;
  ModelMemory e;
  e.parameters = llama_parameter_count(o);
  const double h = static_cast<double>(o.hidden_size()),
               q = static_cast<double>(o.num_attention_heads() * o.head_size()),
               kv = static_cast<double>(o.num_key_value_heads() * o.head_size()),
               inter = static_cast<double>(o.intermediate_size()),
               t = static_cast<double>(m.seq_len);
  e.largest_unit = h * q + 2 * h * kv + q * h + 3 * h * inter + 2 * h;
  e.root = static_cast<double>(e.parameters) -
           e.largest_unit * static_cast<double>(o.num_hidden_layers());
  const double cb = compute_bytes(c);
  const double scores = static_cast<double>(o.num_attention_heads()) * t * (4 + (cb != 4 ? cb : 0));
  const double layer = (4 * h + 5 * q + 3 * kv + 4 * inter) * cb + scores;
  // model.recompute: the layers that keep their activations at the peak, and the recomputed
  // ones' inputs (the residual stream in fp32), as the TransformerLM's.
  auto activations = [&](int64_t every) {
    const int64_t n = o.num_hidden_layers();
    double live = static_cast<double>(n), kept = 0;
    if (every > 0) {
      const int64_t r = (n - 1) / every + 1;
      live = static_cast<double>(std::max(n - r, (every - 1) * (r - 1) + 1));
      kept = static_cast<double>(r);
    }
    const double input = c.parallel.strategy == ParallelStrategy::kFsdp ? cb : 4;
    return micro_batch_samples(c) * t *
           (live * layer + kept * h * input + static_cast<double>(o.vocab_size()) * (cb + 16));
  };
  e.activations = activations(o.recompute_every());
  e.activations_other_recompute = activations(o.recompute_every() == 0 ? 1 : 0);
  e.deferred_under_fsdp = o.deferred_init();
  e.embedding = static_cast<double>(o.vocab_size()) * h;
  e.head_activations = micro_batch_samples(c) * t * static_cast<double>(o.vocab_size()) * (cb + 16);
  return e;
}

}  // namespace

ModelSpec transformer_lm_config() {
  ModelSpec s;
  s.name = "transformer";
  s.summary = "a GPT-2-style decoder (LayerNorm, learned positions, GELU MLP)";
  s.data = ModelData::kTokens;
  s.read = read_transformer;
  s.tokens = [](const ModelSettings& m) {
    const auto& t = dynamic_cast<const TransformerLMSettings&>(m);
    return TokenShape{t.vocab_size, t.seq_len, {}};
  };
  s.set_vocab_size = [](ModelSettings& m, int64_t v) {
    dynamic_cast<TransformerLMSettings&>(m).vocab_size = v;
  };
  s.wrap_points = {"Block"};
  s.memory = transformer_memory;
  s.depth_key = "n_layers";
  s.set_depth = [](ModelSettings& m, int64_t depth) {
    dynamic_cast<TransformerLMSettings&>(m).n_layers = depth;
  };
  return s;
}

ModelSpec mlp_config() {
  ModelSpec s;
  s.name = "mlp";
  s.summary = "a GELU MLP classifier of synthetic data";
  s.data = ModelData::kOwn;
  s.read = read_mlp;
  s.wrap_points = {"Linear"};
  s.memory = mlp_memory;
  s.depth_key = "depth";
  s.set_depth = [](ModelSettings& m, int64_t depth) {
    dynamic_cast<MLPSettings&>(m).depth = depth;
  };
  return s;
}

ModelSpec llama_config() {
  ModelSpec s;
  s.name = "llama";
  s.summary = "a Llama-style decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention)";
  s.data = ModelData::kTokens;
  s.read = read_llama;
  s.tokens = [](const ModelSettings& m) {
    const auto& l = dynamic_cast<const LlamaSettings&>(m);
    return TokenShape{l.options.vocab_size(), l.seq_len, l.pretrained};
  };
  s.set_vocab_size = [](ModelSettings& m, int64_t v) {
    dynamic_cast<LlamaSettings&>(m).options.vocab_size(v);
  };
  s.wrap_points = {"LlamaDecoderLayer"};
  s.memory = llama_memory;
  s.depth_key = "num_hidden_layers";
  s.set_depth = [](ModelSettings& m, int64_t depth) {
    dynamic_cast<LlamaSettings&>(m).options.num_hidden_layers(depth);
  };
  s.pipeline_layers = [](const ModelSettings& m) {
    return dynamic_cast<const LlamaSettings&>(m).options.num_hidden_layers();
  };
  s.pp_problem = [](const ModelSettings& m) -> std::string {
    if (!dynamic_cast<const LlamaSettings&>(m).options.tie_word_embeddings()) return "";
    return "a Llama with tie_word_embeddings shares its embedding with its head, which a "
           "pipeline puts on the first and the last stage: set model.tie_word_embeddings: false "
           "to pipeline it";
  };
  s.tp_problem = [](const ModelSettings& m, int64_t tp) {
    const auto& l = dynamic_cast<const LlamaSettings&>(m);
    const LlamaOptions& o = l.options;
    // The plan (LlamaForCausalLMImpl::tp_plan) cuts heads, KV heads, the FFN width and the
    // vocabulary into tp equal parts.
    for (const auto& [key, value] : std::vector<std::pair<const char*, int64_t>>{
             {"num_attention_heads", o.num_attention_heads()},
             {"num_key_value_heads", o.num_key_value_heads()},
             {"intermediate_size", o.intermediate_size()},
             {"vocab_size", o.vocab_size()}}) {
      if (value % tp != 0) {
        return "tensor parallelism over " + std::to_string(tp) + " ranks cuts model." + key + " (" +
               std::to_string(value) + ") into equal parts, and " + std::to_string(value) +
               " does not divide by " + std::to_string(tp) +
               ": choose a parallel.tp that divides num_attention_heads, num_key_value_heads, "
               "intermediate_size and vocab_size";
      }
    }
    return std::string();
  };
  return s;
}

void register_builtin_model_configs() {
  static std::once_flag once;
  std::call_once(once, [] {
    register_model(transformer_lm_config());
    register_model(mlp_config());
    register_model(llama_config());
  });
}

}  // namespace dtrain::framework
