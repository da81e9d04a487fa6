#include "framework/prepare/prepare.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>
#include <unordered_map>
#include <utility>

#include "core/error.h"

namespace dtrain::framework::prepare {
namespace {

namespace fs = std::filesystem;

class BytesTokenizer final : public Tokenizer {
 public:
  std::string name() const override { return "bytes"; }
  int64_t vocab_size() const override { return 256; }
  void encode(std::string_view text, std::vector<uint32_t>& out) const override {
    for (unsigned char c : text) out.push_back(c);
  }
  std::string decode(const std::vector<int>& ids) const override {
    std::string text;
    for (int id : ids) text += static_cast<char>(id & 0xff);
    return text;
  }
};

class SentencePieceTokenizer final : public Tokenizer {
 public:
  explicit SentencePieceTokenizer(const std::string& file) : file_(file) {
    const auto status = sp_.Load(file);
    DTRAIN_CHECK_AS(ConfigError, status.ok(), file, ": not a SentencePiece model (",
                    status.ToString(), ")");
    DTRAIN_CHECK_AS(ConfigError, sp_.eos_id() >= 0, file,
                    ": the SentencePiece model has no end-of-sentence piece, which stands for "
                    "the line break in dtrain's token files");
  }
  std::string name() const override { return "sentencepiece"; }
  int64_t vocab_size() const override { return sp_.GetPieceSize(); }
  // Line by line, each followed by the end-of-sentence id (the line break).
  void encode(std::string_view text, std::vector<uint32_t>& out) const override {
    std::vector<int> ids;
    size_t start = 0;
    while (start < text.size()) {
      size_t end = text.find('\n', start);
      if (end == std::string_view::npos) end = text.size();
      const auto status = sp_.Encode(text.substr(start, end - start), &ids);
      DTRAIN_CHECK(status.ok(), file_,
                   ": SentencePiece could not encode a line: ", status.ToString());
      for (int id : ids) out.push_back(static_cast<uint32_t>(id));
      out.push_back(static_cast<uint32_t>(sp_.eos_id()));
      start = end + 1;
    }
  }
  std::string decode(const std::vector<int>& ids) const override {
    std::string text;
    std::vector<int> line;
    for (int id : ids) {
      if (id == sp_.eos_id()) {
        std::string piece;
        sp_.Decode(line, &piece).IgnoreError();
        text += piece + "\n";
        line.clear();
      } else if (id >= 0 && id < sp_.GetPieceSize()) {
        line.push_back(id);
      }
    }
    std::string rest;
    sp_.Decode(line, &rest).IgnoreError();
    return text + rest;
  }

 private:
  std::string file_;
  sentencepiece::SentencePieceProcessor sp_;
};

// The training lines: every line of the inputs, or every k-th when there are more than
// max_lines (a deterministic sample, spread over all the files).
class LineSample final : public sentencepiece::SentenceIterator {
 public:
  LineSample(std::vector<std::string> files, int64_t stride)
      : files_(std::move(files)), stride_(std::max<int64_t>(1, stride)) {
    advance();
  }
  bool done() const override { return done_; }
  void Next() override { advance(); }
  const std::string& value() const override { return line_; }
  sentencepiece::util::Status status() const override { return {}; }

 private:
  void advance() {
    while (true) {
      if (!in_.is_open() || !std::getline(in_, line_)) {
        if (in_.is_open()) in_.close();
        if (next_file_ >= files_.size()) {
          done_ = true;
          return;
        }
        in_.open(files_[next_file_++]);
        continue;
      }
      if (line_.empty() || n_++ % stride_ != 0) continue;
      return;
    }
  }
  std::vector<std::string> files_;
  int64_t stride_;
  size_t next_file_ = 0;
  std::ifstream in_;
  std::string line_;
  int64_t n_ = 0;
  bool done_ = false;
};

int64_t count_lines(const std::vector<std::string>& files) {
  int64_t n = 0;
  for (const auto& f : files) {
    std::ifstream in(f);
    for (std::string line; std::getline(in, line);) n += !line.empty();
  }
  return n;
}

// A piece of one input: bytes [begin, end), cut after a newline.
struct Chunk {
  size_t input = 0;
  int index = 0;  // within its input
  int64_t begin = 0, end = 0;
};

std::vector<Chunk> cut(const std::vector<std::string>& inputs, int64_t chunk_bytes,
                       int64_t& total) {
  std::vector<Chunk> chunks;
  total = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    std::error_code ec;
    const int64_t size = static_cast<int64_t>(fs::file_size(inputs[i], ec));
    DTRAIN_CHECK_AS(ConfigError, !ec, inputs[i], ": cannot read: ", ec.message());
    total += size;
    std::ifstream in(inputs[i], std::ios::binary);
    int64_t begin = 0;
    int index = 0;
    while (begin < size || (size == 0 && index == 0)) {
      int64_t end = std::min(size, begin + chunk_bytes);
      if (end < size) {  // extend to the end of the line
        in.seekg(end);
        std::string rest;
        std::getline(in, rest);
        end = std::min(size, end + static_cast<int64_t>(rest.size()) + 1);
        in.clear();
      }
      chunks.push_back({i, index++, begin, end});
      begin = end;
      if (size == 0) break;
    }
  }
  return chunks;
}

// The input's file name (without a .txt extension), and the chunk.
std::string shard_stem(const std::string& input) {
  const fs::path p(input);
  return p.extension() == ".txt" ? p.stem().string() : p.filename().string();
}

std::string shard_name(const std::string& input, int index) {
  char suffix[16];
  std::snprintf(suffix, sizeof(suffix), "-%04d.bin", index);
  return shard_stem(input) + suffix;
}

template <typename T>
void write_tokens(const std::string& path, const std::vector<uint32_t>& tokens) {
  std::vector<T> narrow(tokens.begin(), tokens.end());
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(narrow.data()),
              static_cast<std::streamsize>(narrow.size() * sizeof(T)));
    out.flush();
    DTRAIN_CHECK(static_cast<bool>(out), tmp, ": cannot write: ", std::strerror(errno));
  }
  fs::rename(tmp, path);
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

}  // namespace

std::unique_ptr<Tokenizer> bytes_tokenizer() { return std::make_unique<BytesTokenizer>(); }

std::unique_ptr<Tokenizer> load_sentencepiece(const std::string& model_file) {
  return std::make_unique<SentencePieceTokenizer>(model_file);
}

void train_sentencepiece(const std::vector<std::string>& inputs, const std::string& model_prefix,
                         const SentencePieceTraining& o) {
  DTRAIN_CHECK_AS(ConfigError, o.model_type == "bpe" || o.model_type == "unigram",
                  "--model-type: expected bpe or unigram, got '", o.model_type, "'");
  DTRAIN_CHECK_AS(ConfigError, o.vocab_size >= 64 && o.vocab_size <= (int64_t{1} << 31) - 1,
                  "--vocab-size: expected at least 64, got ", o.vocab_size);
  const int64_t lines = count_lines(inputs);
  DTRAIN_CHECK_AS(ConfigError, lines > 0, "the inputs hold no text to train a tokenizer on");
  LineSample sample(inputs, (lines + o.max_lines - 1) / o.max_lines);
  const std::unordered_map<std::string, std::string> args = {
      {"model_prefix", model_prefix},
      {"vocab_size", std::to_string(o.vocab_size)},
      {"model_type", o.model_type},
      {"byte_fallback", "true"},      // any text encodes, unseen characters as bytes
      {"hard_vocab_limit", "false"},  // a small text gets the vocabulary it can fill
      {"character_coverage", "1.0"},
      {"num_threads", std::to_string(std::max(1, o.threads))},
      {"minloglevel", "1"},
  };
  const auto status = sentencepiece::SentencePieceTrainer::Train(args, &sample);
  DTRAIN_CHECK_AS(ConfigError, status.ok(), "SentencePiece could not train a ", o.model_type,
                  " tokenizer of ", o.vocab_size, " pieces on the inputs: ", status.ToString());
}

PrepareResult prepare(const Tokenizer& tokenizer, const PrepareOptions& o,
                      const std::string& tokenizer_file) {
  DTRAIN_CHECK_AS(ConfigError, !o.inputs.empty(), "no input files");
  std::error_code ec;
  fs::create_directories(o.out_dir, ec);
  DTRAIN_CHECK_AS(ConfigError, !ec && fs::is_directory(o.out_dir), o.out_dir,
                  ": cannot make the output folder", ec ? ": " + ec.message() : "");
  for (const auto& in : o.inputs) {
    DTRAIN_CHECK_AS(ConfigError, fs::is_regular_file(in), in, ": not a readable file");
  }
  const auto t0 = std::chrono::steady_clock::now();
  PrepareResult r;
  r.dtype = tokenizer.vocab_size() <= 65536 ? "uint16" : "uint32";
  const std::vector<Chunk> chunks = cut(o.inputs, std::max<int64_t>(1, o.chunk_bytes), r.bytes);
  // Two inputs with the same name would write the same shards.
  for (size_t i = 0; i < o.inputs.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      DTRAIN_CHECK_AS(ConfigError, shard_stem(o.inputs[i]) != shard_stem(o.inputs[j]), o.inputs[j],
                      " and ", o.inputs[i],
                      " have the same file name, and would write the same shards: rename one");
    }
  }
  std::vector<int64_t> tokens_of(chunks.size(), 0);
  std::atomic<size_t> next{0};
  std::mutex mu;
  Progress progress;
  progress.bytes_total = r.bytes;
  std::exception_ptr failure;
  auto work = [&] {
    std::vector<uint32_t> tokens;
    std::string text;
    for (size_t k = next++; k < chunks.size(); k = next++) {
      const Chunk& c = chunks[k];
      try {
        std::ifstream in(o.inputs[c.input], std::ios::binary);
        text.resize(static_cast<size_t>(c.end - c.begin));
        in.seekg(c.begin);
        in.read(text.data(), static_cast<std::streamsize>(text.size()));
        DTRAIN_CHECK(in.gcount() == static_cast<std::streamsize>(text.size()), o.inputs[c.input],
                     ": could not read bytes ", c.begin, "..", c.end,
                     " (did it change while being read?)");
        tokens.clear();
        tokenizer.encode(text, tokens);
        const std::string path = o.out_dir + "/" + shard_name(o.inputs[c.input], c.index);
        if (r.dtype == "uint16") {
          write_tokens<uint16_t>(path, tokens);
        } else {
          write_tokens<uint32_t>(path, tokens);
        }
        tokens_of[k] = static_cast<int64_t>(tokens.size());
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!failure) failure = std::current_exception();
        next = chunks.size();
        return;
      }
      std::lock_guard<std::mutex> lock(mu);
      progress.bytes_done += c.end - c.begin;
      progress.tokens += tokens_of[k];
      progress.seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (o.on_progress) o.on_progress(progress);
    }
  };
  std::vector<std::thread> threads;
  const int jobs = std::max(1, std::min<int>(o.jobs, static_cast<int>(chunks.size())));
  for (int j = 0; j < jobs; ++j) threads.emplace_back(work);
  for (auto& t : threads) t.join();
  if (failure) std::rethrow_exception(failure);
  for (size_t k = 0; k < chunks.size(); ++k) {
    r.shards.push_back({shard_name(o.inputs[chunks[k].input], chunks[k].index), tokens_of[k]});
    r.tokens += tokens_of[k];
  }
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::ostringstream meta;
  meta << "{\n  \"written_by\": \"dtrain-prepare\",\n  \"tokenizer\": "
       << json_string(tokenizer.name())
       << ",\n  \"tokenizer_file\": " << json_string(tokenizer_file)
       << ",\n  \"vocab_size\": " << tokenizer.vocab_size()
       << ",\n  \"dtype\": " << json_string(r.dtype) << ",\n  \"tokens\": " << r.tokens
       << ",\n  \"shards\": [";
  for (size_t k = 0; k < r.shards.size(); ++k) {
    meta << (k ? "," : "") << "\n    {\"file\": " << json_string(r.shards[k].file)
         << ", \"tokens\": " << r.shards[k].tokens << "}";
  }
  meta << "\n  ]\n}\n";
  const std::string meta_path = o.out_dir + "/meta.json";
  {
    std::ofstream out(meta_path + ".tmp", std::ios::trunc);
    out << meta.str();
    out.flush();
    DTRAIN_CHECK(static_cast<bool>(out), meta_path, ": cannot write");
  }
  fs::rename(meta_path + ".tmp", meta_path);
  return r;
}

}  // namespace dtrain::framework::prepare
