// dtrain-generate: a trained model, used (framework/generate.h).
//
//   dtrain-generate --config run.yaml [--checkpoint DIR] --prompt "The "      a completion
//   dtrain-generate --hf DIR --prompt-ids "1 450 4996" --max-new-tokens 20   a Hugging Face Llama
//   dtrain-generate --config run.yaml --score text.txt                       its perplexity
//
// The model comes from a dtrain checkpoint (full or sharded: --checkpoint, default the newest
// complete one in the config's checkpoint.dir; the config says which model it is) or from a
// Hugging Face LlamaForCausalLM folder (--hf). Text goes through the tokenizer the model was
// trained with: bytes for a corpus, the token files' (dtrain-prepare's meta.json: bytes or
// SentencePiece, run through dtrain-prepare --encode/--decode, which keeps SentencePiece out of
// this process), or --tokenizer; --prompt-ids gives token ids directly.
#include <ATen/ATen.h>
#include <sys/wait.h>
#include <torch/serialize.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "core/cli.h"
#include "core/error.h"
#include "framework/checkpoint/checkpointer.h"
#include "framework/config.h"
#include "framework/generate.h"
#include "framework/models/builtin.h"

namespace {

namespace fs = std::filesystem;
using namespace dtrain::framework;  // NOLINT: a program's main file

// How text becomes ids and back: bytes in-process, or dtrain-prepare for a tokenizer folder or
// a SentencePiece model.
struct Tokenizer {
  std::string with;  // "" for bytes; else what dtrain-prepare --encode/--decode take
  std::string describe() const { return with.empty() ? "bytes" : with; }
};

std::string dtrain_prepare() {
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const fs::path beside = self.parent_path() / "dtrain-prepare";
    if (fs::exists(beside)) return beside.string();
  }
  return "dtrain-prepare";  // on the PATH
}

std::string run_capture(const std::string& cmd, const std::string& input) {
  const std::string in_file =
      (fs::temp_directory_path() / ("dtrain-generate." + std::to_string(::getpid()) + ".txt"))
          .string();
  { std::ofstream(in_file, std::ios::binary) << input; }
  FILE* p = ::popen((cmd + " < '" + in_file + "'").c_str(), "r");
  DTRAIN_CHECK_AS(dtrain::UsageError, p != nullptr, "cannot run ", cmd);
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  const int status = ::pclose(p);
  fs::remove(in_file);
  DTRAIN_CHECK_AS(dtrain::ConfigError, status == 0, cmd, " failed (exit ", WEXITSTATUS(status),
                  "): is dtrain-prepare beside dtrain-generate or on the PATH?");
  return out;
}

std::vector<int64_t> parse_ids(const std::string& text) {
  std::vector<int64_t> ids;
  std::istringstream in(text);
  std::string word;
  while (in >> word) {
    if (word == "|") continue;
    try {
      ids.push_back(std::stoll(word));
    } catch (const std::exception&) {
      throw dtrain::UsageError("'" + word + "' is not a token id");
    }
  }
  return ids;
}

std::vector<int64_t> encode(const Tokenizer& t, const std::string& text) {
  if (t.with.empty()) return std::vector<int64_t>(text.begin(), text.end());
  return parse_ids(run_capture("'" + dtrain_prepare() + "' --encode '" + t.with + "'", text));
}

std::string decode(const Tokenizer& t, const std::vector<int64_t>& ids) {
  if (t.with.empty()) {
    std::string s;
    for (int64_t id : ids) s += static_cast<char>(id & 0xff);
    return s;
  }
  std::string args;
  for (int64_t id : ids) args += " " + std::to_string(id);
  std::string text = run_capture("'" + dtrain_prepare() + "' --decode '" + t.with + "'" + args, "");
  if (!text.empty() && text.back() == '\n') text.pop_back();
  return text;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "dtrain-generate: completes a prompt with a trained model (greedy or sampled, with a KV "
      "cache), or scores a text (perplexity); from a dtrain checkpoint or a Hugging Face Llama"};
  dtrain::cli::setup(app, "dtrain-generate");
  std::string config_path, checkpoint, hf, prompt, prompt_ids, score_file, score_ids, logits_file,
      tokenizer_with;
  std::vector<std::string> overrides;
  bool bytes = false, no_cache = false, quiet = false;
  int64_t max_new = 64;
  GenerateOptions g;
  app.add_option("--config", config_path,
                 "the training config (which model; its data's tokenizer)");
  app.add_option("--set", overrides, "override a config key, as dtrain-train's --set");
  app.add_option("--checkpoint", checkpoint,
                 "a step_* folder (default: the newest complete one in checkpoint.dir)");
  app.add_option("--hf", hf, "a Hugging Face LlamaForCausalLM folder instead of --config");
  app.add_option("--prompt", prompt, "the text to complete");
  app.add_option("--prompt-ids", prompt_ids, "the prompt as token ids (\"1 450 4996\")");
  app.add_option("--max-new-tokens", max_new, "tokens to generate at most (64)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  app.add_option("--temperature", g.sampling.temperature, "0 (the default): greedy")
      ->check(CLI::Range(0.0, 100.0));
  app.add_option("--top-k", g.sampling.top_k, "sample among the k most likely (0: all)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  app.add_option("--top-p", g.sampling.top_p, "sample among the most likely reaching p (1: all)")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--seed", g.sampling.seed, "the sampling's random seed");
  app.add_flag("--no-cache", no_cache, "run the whole sequence for every token (slow; to compare)");
  app.add_option("--score", score_file, "print the perplexity of this text file");
  app.add_option("--score-ids", score_ids, "print the perplexity of these token ids");
  app.add_option("--logits", logits_file,
                 "write the prompt's logits [T, vocab] (fp32) as a torch.save file");
  app.add_option("--tokenizer", tokenizer_with,
                 "a dtrain-prepare folder or SentencePiece .model (default: the training data's)");
  app.add_flag("--bytes", bytes, "bytes are the tokens (a model trained on a corpus)");
  app.add_flag("--quiet", quiet, "print only the completion (or the perplexity)");
  dtrain::cli::parse(app, argc, argv);
  try {
    DTRAIN_CHECK_AS(dtrain::UsageError, config_path.empty() != hf.empty(),
                    "give --config (a dtrain run) or --hf (a Hugging Face Llama folder), one of "
                    "them");
    register_builtin_models();
    std::optional<CausalLM> lm;
    Tokenizer tok;
    if (!hf.empty()) {
      lm.emplace(load_hf_llama(hf));
      if (fs::exists(fs::path(hf) / "tokenizer.model"))
        tok.with = (fs::path(hf) / "tokenizer.model").string();
    } else {
      const RunConfig c = load_config(config_path, overrides);
      if (checkpoint.empty()) {
        DTRAIN_CHECK_AS(dtrain::ConfigError, !c.checkpoint.dir.empty(), config_path,
                        ": checkpoint.dir is not set, so there is no checkpoint to load: give "
                        "--checkpoint <a step_* folder>");
        const auto newest = Checkpointer::newest_complete(c.checkpoint.dir);
        DTRAIN_CHECK_AS(dtrain::ConfigError, newest.has_value(), "no complete checkpoint in '",
                        c.checkpoint.dir, "' (checkpoint.dir of ", config_path,
                        "): train first, or give --checkpoint");
        checkpoint = *newest;
      }
      if (c.model.type == "transformer") {
        lm.emplace(TransformerLM(c.model.as<TransformerLMSettings>().options()));
      } else if (c.model.type == "llama") {
        LlamaOptions o = c.model.as<LlamaSettings>().options;
        lm.emplace(LlamaForCausalLM(o.deferred_init(false)));
      } else {
        DTRAIN_FAIL(dtrain::ConfigError, config_path, ": model.type ", c.model.type,
                    " is not a language model; dtrain-generate takes transformer or llama");
      }
      // The checkpoint's tensors, whole whatever its format, into the model by name.
      const auto tensors = read_model_tensors(checkpoint);
      std::map<std::string, at::Tensor> by_name(tensors.begin(), tensors.end());
      c10::NoGradGuard no_grad;
      for (auto& item : lm->module().named_parameters()) {
        auto it = by_name.find(item.key());
        DTRAIN_CHECK_AS(dtrain::ConfigError,
                        it != by_name.end() && it->second.sizes() == item.value().sizes(),
                        "checkpoint '", checkpoint, "' does not hold ", config_path,
                        "'s model: its '", item.key(), "' is ",
                        it == by_name.end() ? std::string("missing")
                                            : "of shape " + c10::str(it->second.sizes()),
                        ", the config's model has ", c10::str(item.value().sizes()),
                        ". Give the config the run was trained with");
        item.value().copy_(it->second);
      }
      if (c.data.source == DataSource::kCorpus) {
        bytes = bytes || tokenizer_with.empty();
      } else if (!c.data.token_meta.empty()) {
        tok.with = fs::path(c.data.token_meta).parent_path().string();
      }
      if (!quiet)
        std::fprintf(stderr, "dtrain-generate: %s from %s\n", lm->describe().c_str(),
                     checkpoint.c_str());
    }
    if (!tokenizer_with.empty()) tok.with = tokenizer_with;
    if (bytes) tok.with.clear();
    const bool have_text_tokenizer = bytes || !tok.with.empty();
    if (!score_file.empty() || !score_ids.empty()) {
      std::vector<int64_t> ids;
      if (!score_ids.empty()) {
        ids = parse_ids(score_ids);
      } else {
        DTRAIN_CHECK_AS(dtrain::UsageError, have_text_tokenizer,
                        "--score needs the model's tokenizer: give --tokenizer (a dtrain-prepare "
                        "folder or a SentencePiece .model), --bytes, or --score-ids");
        std::ifstream f(score_file, std::ios::binary);
        DTRAIN_CHECK_AS(dtrain::UsageError, static_cast<bool>(f), "--score: cannot read '",
                        score_file, "'");
        ids = encode(tok, std::string((std::istreambuf_iterator<char>(f)),
                                      std::istreambuf_iterator<char>()));
      }
      DTRAIN_CHECK_AS(dtrain::UsageError, ids.size() >= 2, "a text of ", ids.size(),
                      " token(s) has nothing to predict: give at least two");
      const Score s = score(*lm, ids);
      if (quiet) {
        std::printf("%.6f\n", s.perplexity());
      } else {
        std::printf("perplexity %.4f (mean negative log-likelihood %.6f nats over %lld tokens)\n",
                    s.perplexity(), s.mean_nll(), static_cast<long long>(s.tokens));
      }
      return 0;
    }
    std::vector<int64_t> ids;
    if (!prompt_ids.empty()) {
      ids = parse_ids(prompt_ids);
    } else {
      DTRAIN_CHECK_AS(dtrain::UsageError, !prompt.empty(), "give --prompt (text) or --prompt-ids");
      DTRAIN_CHECK_AS(dtrain::UsageError, have_text_tokenizer,
                      "this model's tokenizer is unknown (no tokenizer.model in ", hf,
                      "): give --tokenizer, or --prompt-ids");
      ids = encode(tok, prompt);
    }
    if (!logits_file.empty()) {
      c10::NoGradGuard no_grad;
      lm->module().eval();
      at::Tensor logits = lm->forward(at::tensor(ids, at::kLong).unsqueeze(0))[0].to(at::kFloat);
      std::vector<char> bytes_out = torch::pickle_save(logits.contiguous());
      std::ofstream(logits_file, std::ios::binary)
          .write(bytes_out.data(), static_cast<std::streamsize>(bytes_out.size()));
      if (max_new == 0) return 0;
    }
    g.max_new_tokens = max_new;
    g.cache = !no_cache;
    const Generation out = generate(*lm, ids, g);
    if (have_text_tokenizer && prompt_ids.empty()) {
      std::printf("%s%s\n", quiet ? "" : prompt.c_str(), decode(tok, out.tokens).c_str());
    } else {
      std::string s;
      for (size_t i = 0; i < out.tokens.size(); ++i)
        s += (i ? " " : "") + std::to_string(out.tokens[i]);
      std::printf("%s\n", s.c_str());
    }
    if (!quiet) {
      std::fprintf(stderr,
                   "dtrain-generate: %zu token(s) in %.3f s (%.1f tokens/s, %s), stopped at %s\n",
                   out.tokens.size(), out.seconds,
                   static_cast<double>(out.tokens.size()) / std::max(out.seconds, 1e-9),
                   g.cache ? "KV cache" : "no cache", out.stopped.c_str());
    }
    return 0;
  } catch (...) {
    const auto failure = dtrain::cli::failure_of(std::current_exception());
    std::cerr << "dtrain-generate: " << failure.message << std::endl;
    return failure.code;
  }
}
