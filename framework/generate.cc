#include "framework/generate.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>

#include "core/error.h"

namespace dtrain::framework {

at::Tensor CausalLM::forward(const at::Tensor& tokens) {
  return std::visit([&](auto& m) { return m->forward(tokens); }, model_);
}

at::Tensor CausalLM::forward_cached(const at::Tensor& tokens, KVCache& cache) {
  return std::visit([&](auto& m) { return m->forward_cached(tokens, cache); }, model_);
}

int64_t CausalLM::context() const {
  if (const auto* t = std::get_if<TransformerLM>(&model_)) return (*t)->options().seq_len();
  return std::get<LlamaForCausalLM>(model_)->options().max_position_embeddings();
}

int64_t CausalLM::vocab_size() const {
  if (const auto* t = std::get_if<TransformerLM>(&model_)) return (*t)->options().vocab_size();
  return std::get<LlamaForCausalLM>(model_)->options().vocab_size();
}

torch::nn::Module& CausalLM::module() {
  return std::visit([](auto& m) -> torch::nn::Module& { return *m; }, model_);
}

std::string CausalLM::describe() const {
  int64_t n = 0;
  std::visit(
      [&](const auto& m) {
        for (const auto& p : m->parameters()) n += p.numel();
      },
      model_);
  const std::string kind =
      std::holds_alternative<TransformerLM>(model_) ? "TransformerLM" : "Llama";
  char buf[96];
  std::snprintf(buf, sizeof(buf), "%s %.2fM parameters, context %lld", kind.c_str(),
                static_cast<double>(n) / 1e6, static_cast<long long>(context()));
  return buf;
}

int64_t sample_next(const at::Tensor& logits, const Sampling& s, at::Generator& gen) {
  at::Tensor l = logits.to(at::kFloat).reshape({-1});
  if (s.temperature <= 0) return l.argmax().item<int64_t>();
  l = l / s.temperature;
  if (s.top_k > 0 && s.top_k < l.numel()) {
    const double kth = std::get<0>(l.topk(s.top_k)).min().item<double>();
    l = l.masked_fill(l < kth, -std::numeric_limits<float>::infinity());
  }
  if (s.top_p < 1.0) {
    auto [sorted, order] = l.sort(/*dim=*/0, /*descending=*/true);
    at::Tensor cumulative = at::softmax(sorted, 0).cumsum(0);
    // A token goes once the tokens before it already reach p; the first always stays.
    at::Tensor drop = (cumulative - at::softmax(sorted, 0)) >= s.top_p;
    drop[0] = false;
    at::Tensor remove = at::zeros_like(drop).scatter(0, order, drop);
    l = l.masked_fill(remove, -std::numeric_limits<float>::infinity());
  }
  at::Tensor probs = at::softmax(l, 0);
  return at::multinomial(probs, 1, /*replacement=*/false, gen).item<int64_t>();
}

Generation generate(CausalLM& lm, const std::vector<int64_t>& prompt, const GenerateOptions& o) {
  DTRAIN_CHECK_AS(UsageError, !prompt.empty(), "generate: the prompt holds no token");
  for (int64_t id : prompt) {
    DTRAIN_CHECK_AS(UsageError, id >= 0 && id < lm.vocab_size(), "generate: the prompt's token ",
                    id, " is outside the model's vocabulary of ", lm.vocab_size());
  }
  DTRAIN_CHECK_AS(UsageError, static_cast<int64_t>(prompt.size()) <= lm.context(), "the prompt's ",
                  prompt.size(), " tokens exceed the model's context of ", lm.context(),
                  " positions");
  c10::NoGradGuard no_grad;
  lm.module().eval();
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(o.sampling.seed);
  Generation g;
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<int64_t> all = prompt;
  KVCache cache(lm.context());
  at::Tensor next = at::tensor(prompt, at::kLong).unsqueeze(0);
  g.stopped = "max_new_tokens";
  const int64_t context = lm.context();
  while (static_cast<int64_t>(g.tokens.size()) < o.max_new_tokens) {
    // Past the context the window slides: each token from the last `context` ones, at
    // positions 0 .. context - 1 again (the cache, whose positions shifted, starts over).
    const int64_t start = std::max<int64_t>(0, static_cast<int64_t>(all.size()) - context);
    if (start > 0) {
      cache.clear();
      next =
          at::tensor(std::vector<int64_t>(all.begin() + start, all.end()), at::kLong).unsqueeze(0);
    }
    at::Tensor logits =
        o.cache
            ? lm.forward_cached(next, cache)
            : lm.forward(at::tensor(std::vector<int64_t>(all.begin() + start, all.end()), at::kLong)
                             .unsqueeze(0));
    const int64_t id = sample_next(logits[0][-1], o.sampling, gen);
    g.tokens.push_back(id);
    all.push_back(id);
    if (o.on_token) o.on_token(id);
    if (o.eos && id == *o.eos) {
      g.stopped = "eos";
      break;
    }
    next = at::tensor(std::vector<int64_t>{id}, at::kLong).unsqueeze(0);
  }
  g.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return g;
}

double Score::perplexity() const { return std::exp(mean_nll()); }

Score score(CausalLM& lm, const std::vector<int64_t>& ids) {
  c10::NoGradGuard no_grad;
  lm.module().eval();
  Score s;
  const int64_t n = static_cast<int64_t>(ids.size()), context = lm.context();
  const int64_t stride = std::max<int64_t>(1, context / 2);
  int64_t scored_until = 1;  // tokens [1, scored_until) are scored
  for (int64_t begin = 0; scored_until < n; begin += stride) {
    const int64_t end = std::min(n, begin + context);
    std::vector<int64_t> window(ids.begin() + begin, ids.begin() + end);
    at::Tensor logits = lm.forward(at::tensor(window, at::kLong).unsqueeze(0))[0].to(at::kFloat);
    at::Tensor logp = at::log_softmax(logits, -1);
    const int64_t from = std::max(scored_until, begin + 1);
    if (from < end) {  // token t is predicted at position t - 1
      at::Tensor targets =
          at::tensor(std::vector<int64_t>(ids.begin() + from, ids.begin() + end), at::kLong);
      at::Tensor rows = logp.narrow(0, from - 1 - begin, end - from);
      s.nll_sum -= rows.gather(1, targets.unsqueeze(1)).to(at::kDouble).sum().item<double>();
      s.tokens += end - from;
    }
    scored_until = std::max(scored_until, end);
    if (end == n) break;
  }
  return s;
}

}  // namespace dtrain::framework
