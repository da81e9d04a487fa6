// Using a trained language model: completions (greedy or sampled, with a KV cache so that each
// new token costs one position's forward, not the whole sequence's) and the likelihood of a
// text (its perplexity), for dtrain-generate (framework/generate_main.cc).
//
// A CausalLM is a TransformerLM or a Llama. Sampling follows Hugging Face's generate(): logits
// divided by the temperature, then top-k, then top-p (the smallest set of tokens whose
// probabilities reach p, the most likely always kept), then a draw; temperature 0 is greedy.
// Scoring runs windows of the model's context over the text, each new window starting half a
// context after the previous one and scoring only the tokens the previous did not, so every
// token after the first is predicted from at least half a context of text before it.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "framework/models/kv_cache.h"
#include "framework/models/llama.h"
#include "framework/models/transformer_lm.h"

namespace dtrain::framework {

class CausalLM {
 public:
  explicit CausalLM(TransformerLM m) : model_(std::move(m)) {}
  explicit CausalLM(LlamaForCausalLM m) : model_(std::move(m)) {}

  // tokens [B, T] -> logits [B, T, V], every position (no cache).
  at::Tensor forward(const at::Tensor& tokens);
  at::Tensor forward_cached(const at::Tensor& tokens, KVCache& cache);
  // Positions the model attends over at most (seq_len, max_position_embeddings).
  int64_t context() const;
  int64_t vocab_size() const;
  torch::nn::Module& module();
  std::string describe() const;

 private:
  std::variant<TransformerLM, LlamaForCausalLM> model_;
};

struct Sampling {
  double temperature = 0;  // 0: greedy (argmax)
  int64_t top_k = 0;       // 0: all tokens
  double top_p = 1.0;      // 1: all tokens
  uint64_t seed = 0;
};

// The next token from the last position's logits [V].
int64_t sample_next(const at::Tensor& logits, const Sampling& s, at::Generator& gen);

struct GenerateOptions {
  int64_t max_new_tokens = 64;
  Sampling sampling;
  std::optional<int64_t> eos;  // stop after generating it
  bool cache = true;           // false: every step runs the whole sequence (the slow way)
  std::function<void(int64_t)> on_token;  // each new token as it is chosen
};

struct Generation {
  std::vector<int64_t> tokens;  // the new ones
  // Why it stopped: "max_new_tokens" or "eos". (Past the model's context the window slides:
  // each token is predicted from the last `context` ones, as the trainer's own sample is.)
  std::string stopped;
  double seconds = 0;  // the new tokens' (the prompt's forward included)
};

Generation generate(CausalLM& lm, const std::vector<int64_t>& prompt, const GenerateOptions& o);

struct Score {
  double nll_sum = 0;  // natural log
  int64_t tokens = 0;  // predicted tokens (all but the first)
  double mean_nll() const { return tokens > 0 ? nll_sum / static_cast<double>(tokens) : 0; }
  double perplexity() const;
};

Score score(CausalLM& lm, const std::vector<int64_t>& ids);

}  // namespace dtrain::framework
