// dtrain-prepare: text files -> token files for data.source: tokens (framework/prepare/prepare.h).
//
//   dtrain-prepare --out data/mytext [--tokenizer sentencepiece|bytes] [--vocab-size 4096]
//                  [--model-type bpe|unigram] [--tokenizer-model m.model] [--jobs N] FILE...
//   dtrain-prepare --decode data/mytext 17 204 9 ...   (token ids back to text)
//
// SentencePiece (the default) trains a tokenizer on the inputs unless --tokenizer-model gives
// one; either way it is copied to OUT/tokenizer.model. FILE may be a glob ("books/*.txt").
// Prints a progress bar (bytes, MB/s, tokens/s) and, at the end, the config lines that train
// on the result.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/cli.h"
#include "core/error.h"
#include "core/glob.h"
#include "framework/prepare/prepare.h"

namespace {

namespace fs = std::filesystem;
namespace prep = dtrain::framework::prepare;

std::string megabytes(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f MB", bytes / 1e6);
  return buf;
}

// A progress line: redrawn in place on a terminal, else printed every few seconds.
class ProgressBar {
 public:
  ProgressBar() : tty_(::isatty(2) != 0) {}
  void update(const prep::Progress& p, bool last = false) {
    const auto now = std::chrono::steady_clock::now();
    if (!last && !tty_ && now - printed_ < std::chrono::seconds(5)) return;
    if (!last && tty_ && now - printed_ < std::chrono::milliseconds(100)) return;
    printed_ = now;
    const double frac = p.bytes_total > 0
                            ? static_cast<double>(p.bytes_done) / static_cast<double>(p.bytes_total)
                            : 1.0;
    const int width = 30, filled = static_cast<int>(frac * width + 0.5);
    const double secs = std::max(p.seconds, 1e-9);
    char line[256];
    std::snprintf(line, sizeof(line), "prepare [%s%s] %3.0f%% %s/%s, %.1f MB/s, %.0fk tokens/s",
                  std::string(static_cast<size_t>(filled), '#').c_str(),
                  std::string(static_cast<size_t>(width - filled), '.').c_str(), frac * 100,
                  megabytes(static_cast<double>(p.bytes_done)).c_str(),
                  megabytes(static_cast<double>(p.bytes_total)).c_str(),
                  static_cast<double>(p.bytes_done) / 1e6 / secs,
                  static_cast<double>(p.tokens) / 1e3 / secs);
    std::fprintf(stderr, tty_ ? "\r%s" : "%s\n", line);
    if (tty_ && last) std::fprintf(stderr, "\n");
  }

 private:
  bool tty_;
  std::chrono::steady_clock::time_point printed_{};
};

// The tokenizer of a prepared folder (its meta.json: bytes, or SentencePiece's tokenizer.model
// beside it) or of a SentencePiece .model file.
std::unique_ptr<prep::Tokenizer> tokenizer_of(const std::string& where) {
  if (fs::is_directory(where)) {
    std::ifstream meta(fs::path(where) / "meta.json");
    const std::string text((std::istreambuf_iterator<char>(meta)),
                           std::istreambuf_iterator<char>());
    if (text.find("\"tokenizer\": \"bytes\"") != std::string::npos) return prep::bytes_tokenizer();
    return prep::load_sentencepiece((fs::path(where) / "tokenizer.model").string());
  }
  return prep::load_sentencepiece(where);
}

// Text on stdin -> its token ids on stdout, space-separated (what dtrain-generate reads).
int encode(const std::string& where) {
  auto tokenizer = tokenizer_of(where);
  const std::string text((std::istreambuf_iterator<char>(std::cin)),
                         std::istreambuf_iterator<char>());
  std::vector<uint32_t> ids;
  tokenizer->encode(text, ids);
  // A prompt ends where its text does: no line break after a last line that has none.
  if (!ids.empty() && (text.empty() || text.back() != '\n') &&
      static_cast<int64_t>(ids.back()) == tokenizer->line_end()) {
    ids.pop_back();
  }
  std::string out;
  for (size_t i = 0; i < ids.size(); ++i) out += (i ? " " : "") + std::to_string(ids[i]);
  std::cout << out << std::endl;
  return 0;
}

int decode(const std::string& where, const std::vector<std::string>& ids) {
  auto tokenizer = tokenizer_of(where);
  std::vector<int> tokens;
  for (const auto& s : ids) {
    if (s == "|") continue;  // the trainer's sample separates its prompt so
    try {
      tokens.push_back(std::stoi(s));
    } catch (const std::exception&) {
      throw dtrain::UsageError("--decode: '" + s + "' is not a token id");
    }
  }
  std::cout << tokenizer->decode(tokens) << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "dtrain-prepare: turns text files into token files (data.source: tokens), with a "
      "SentencePiece tokenizer trained on them (or loaded) or as bytes"};
  dtrain::cli::setup(app, "dtrain-prepare");
  std::vector<std::string> inputs;
  std::string out, tokenizer = "sentencepiece", model_type = "bpe", tokenizer_model, decode_from;
  int64_t vocab_size = 4096;
  int jobs = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  double chunk_mb = 32;
  app.add_option("inputs", inputs, "text files or globs (with --decode: token ids)");
  app.add_option("--out", out, "the folder for the token files, meta.json and tokenizer.model");
  app.add_option("--tokenizer", tokenizer, "sentencepiece (default) or bytes")
      ->check(CLI::IsMember({"sentencepiece", "bytes"}));
  app.add_option("--vocab-size", vocab_size,
                 "SentencePiece: the vocabulary to train (default 4096; a small text may give "
                 "fewer)");
  app.add_option("--model-type", model_type, "SentencePiece: bpe (default) or unigram")
      ->check(CLI::IsMember({"bpe", "unigram"}));
  app.add_option("--tokenizer-model", tokenizer_model,
                 "SentencePiece: use this trained .model instead of training one");
  app.add_option("--jobs", jobs, "files (and pieces of big files) encoded at once")
      ->check(CLI::Range(1, 1024));
  app.add_option("--chunk-mb", chunk_mb, "big files are cut into pieces of about this size")
      ->check(CLI::Range(0.001, 1e6));
  app.add_option("--decode", decode_from,
                 "a prepared folder (or .model): print the text of the token ids given");
  std::string encode_with;
  app.add_option("--encode", encode_with,
                 "a prepared folder (or .model): print the token ids of the text on stdin");
  dtrain::cli::parse(app, argc, argv);
  try {
    if (!decode_from.empty()) return decode(decode_from, inputs);
    if (!encode_with.empty()) return encode(encode_with);
    if (out.empty()) throw dtrain::UsageError("--out: the output folder is required");
    std::vector<std::string> files;
    for (const auto& pattern : inputs) {
      const auto found = dtrain::glob_files(pattern);
      if (found.empty()) throw dtrain::ConfigError("'" + pattern + "' matches no file");
      files.insert(files.end(), found.begin(), found.end());
    }
    if (files.empty()) throw dtrain::UsageError("no input files; give text files or globs");
    // Every check before any work (a tokenizer can train for minutes): the inputs, the output
    // folder. The result is built beside it and put in its place at the end, whole.
    const std::vector<prep::Input> checked = prep::check_inputs(files);
    prep::check_output(out);
    if (!tokenizer_model.empty()) prep::load_sentencepiece(tokenizer_model);  // refuses a non-model
    const std::string staging = prep::staging_dir(out);
    try {
      std::unique_ptr<prep::Tokenizer> tok;
      std::string tokenizer_file;
      if (tokenizer == "bytes") {
        tok = prep::bytes_tokenizer();
      } else {
        tokenizer_file = "tokenizer.model";
        const std::string dest = (fs::path(staging) / tokenizer_file).string();
        if (!tokenizer_model.empty()) {
          fs::copy_file(tokenizer_model, dest, fs::copy_options::overwrite_existing);
        } else {
          std::fprintf(stderr,
                       "dtrain-prepare: training a %lld-piece SentencePiece %s tokenizer on "
                       "%zu file(s)\n",
                       static_cast<long long>(vocab_size), model_type.c_str(), files.size());
          const auto t0 = std::chrono::steady_clock::now();
          prep::SentencePieceTraining t;
          t.vocab_size = vocab_size;
          t.model_type = model_type;
          t.threads = jobs;
          prep::train_sentencepiece(files, (fs::path(staging) / "tokenizer").string(), t);
          std::fprintf(
              stderr, "dtrain-prepare: trained in %.1f s\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        }
        tok = prep::load_sentencepiece(dest);
      }
      ProgressBar bar;
      prep::PrepareOptions o;
      o.inputs = checked;
      o.out_dir = staging;
      o.jobs = jobs;
      o.chunk_bytes = static_cast<int64_t>(chunk_mb * 1e6);
      o.on_progress = [&](const prep::Progress& p) { bar.update(p); };
      const prep::PrepareResult r = prep::prepare(*tok, o, tokenizer_file);
      bar.update({r.bytes, r.bytes, r.tokens, r.seconds}, /*last=*/true);
      prep::commit_output(staging, out);
      std::printf(
          "dtrain-prepare: %lld tokens from %s of text in %zu shard(s) of %s in %s/ (%.1f s; "
          "%.1f MB/s)\n"
          "train on them with:\n"
          "  model:\n    vocab_size: auto   # the tokenizer's: %lld (%s); a larger number works "
          "too\n"
          "  data:\n    source: tokens\n    path: %s/*.bin   # relative to the folder you run "
          "dtrain-train in\n    val_fraction: 0.05\n",
          static_cast<long long>(r.tokens), megabytes(static_cast<double>(r.bytes)).c_str(),
          r.shards.size(), r.dtype.c_str(), out.c_str(), r.seconds,
          static_cast<double>(r.bytes) / 1e6 / std::max(r.seconds, 1e-9),
          static_cast<long long>(tok->vocab_size()), tok->name().c_str(), out.c_str());
    } catch (...) {
      prep::discard(staging);  // the output folder stays as it was
      throw;
    }
    return 0;
  } catch (...) {
    auto failure = dtrain::cli::failure_of(std::current_exception());
    std::cerr << "dtrain-prepare: " << failure.message << std::endl;
    return failure.code;
  }
}
