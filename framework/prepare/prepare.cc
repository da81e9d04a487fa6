#include "framework/prepare/prepare.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <set>
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
  int64_t line_end() const override { return sp_.eos_id(); }
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
      if (!in_ || !in_->next(line_)) {
        in_.reset();
        if (next_file_ >= files_.size()) {
          done_ = true;
          return;
        }
        in_ = std::make_unique<LineReader>(files_[next_file_++]);
        continue;
      }
      if (line_.empty() || n_++ % stride_ != 0) continue;
      return;
    }
  }
  std::vector<std::string> files_;
  int64_t stride_;
  size_t next_file_ = 0;
  std::unique_ptr<LineReader> in_;
  std::string line_;
  int64_t n_ = 0;
  bool done_ = false;
};

int64_t count_lines(const std::vector<std::string>& files) {
  int64_t n = 0;
  for (const auto& f : files) {
    LineReader in(f);
    for (std::string line; in.next(line);) n += !line.empty();
  }
  return n;
}

// A whole gzip file, decompressed.
std::string gunzip(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  DTRAIN_CHECK_AS(ConfigError, f != nullptr, path, ": cannot open: ", std::strerror(errno));
  std::string text;
  char buf[1 << 16];
  int n;
  while ((n = gzread(f, buf, sizeof(buf))) > 0) text.append(buf, static_cast<size_t>(n));
  int err = Z_OK;
  const char* msg = n < 0 ? gzerror(f, &err) : nullptr;
  const std::string why = msg != nullptr ? msg : "";
  gzclose(f);
  DTRAIN_CHECK_AS(ConfigError, n == 0, path, ": not a valid gzip file (", why,
                  "): is it truncated? Check it with gzip -t");
  return text;
}

// A piece of one input: bytes [begin, end), cut after a newline.
struct Chunk {
  size_t input = 0;
  int index = 0;  // within its input
  int64_t begin = 0, end = 0;
};

std::vector<Chunk> cut(const std::vector<Input>& inputs, int64_t chunk_bytes, int64_t& total) {
  std::vector<Chunk> chunks;
  total = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const int64_t size = inputs[i].bytes;
    total += size;
    if (inputs[i].gzip) {  // read whole, decompressed, by one thread
      chunks.push_back({i, 0, 0, size});
      continue;
    }
    std::ifstream in(inputs[i].path, std::ios::binary);
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

// A path without its .gz and then .txt extensions.
std::string without_extensions(std::string name) {
  for (const char* ext : {".gz", ".txt"}) {
    const std::string e(ext);
    if (name.size() > e.size() && name.compare(name.size() - e.size(), e.size(), e) == 0) {
      name.resize(name.size() - e.size());
    }
  }
  return name;
}

std::string shard_name(const Input& input, int index) {
  char suffix[16];
  std::snprintf(suffix, sizeof(suffix), "-%04d.bin", index);
  return input.stem + suffix;
}

// What the first bytes of a file say it is: "" for text (or gzip, which `gzip` says), or the
// kind of compressed or binary file it is, and the tool that makes text of it.
std::string compressed_kind(const unsigned char* b, size_t n, bool& gzip) {
  gzip = n >= 2 && b[0] == 0x1f && b[1] == 0x8b;
  auto starts = [&](std::initializer_list<unsigned char> magic) {
    if (n < magic.size()) return false;
    size_t i = 0;
    for (unsigned char m : magic) {
      if (b[i++] != m) return false;
    }
    return true;
  };
  if (starts({0xfd, '7', 'z', 'X', 'Z', 0x00})) return "compressed with xz: decompress it (xz -d)";
  if (starts({'B', 'Z', 'h'})) return "compressed with bzip2: decompress it (bunzip2)";
  if (starts({0x28, 0xb5, 0x2f, 0xfd})) return "compressed with zstd: decompress it (zstd -d)";
  if (starts({'P', 'K', 0x03, 0x04})) return "a zip archive: extract its text files (unzip)";
  if (starts({'7', 'z', 0xbc, 0xaf, 0x27, 0x1c})) return "a 7-Zip archive: extract its text files";
  if (starts({'%', 'P', 'D', 'F'})) return "a PDF: extract its text first (pdftotext)";
  return "";
}

// Text: no NUL byte and at most 1% control characters (other than tab, line and page breaks,
// carriage return, escape and backspace) in `sample`. Else the offset of the first offender.
std::optional<size_t> not_text_at(const std::string& sample) {
  size_t control = 0;
  std::optional<size_t> first;
  for (size_t i = 0; i < sample.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(sample[i]);
    if (c == 0) return i;
    if (c < 0x20 && c != '\t' && c != '\n' && c != '\r' && c != '\f' && c != '\v' && c != 0x1b &&
        c != '\b') {
      if (!first) first = i;
      ++control;
    }
  }
  if (control * 100 > sample.size() && control > 0) return first;
  return std::nullopt;
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

LineReader::LineReader(const std::string& path) : path_(path) {
  file_ = gzopen(path.c_str(), "rb");  // a plain file is read as it is
  DTRAIN_CHECK_AS(ConfigError, file_ != nullptr, path, ": cannot open: ", std::strerror(errno));
  gzbuffer(static_cast<gzFile>(file_), 1 << 17);
}

LineReader::~LineReader() {
  if (file_ != nullptr) gzclose(static_cast<gzFile>(file_));
}

bool LineReader::next(std::string& line) {
  line.clear();
  char buf[1 << 14];
  while (gzgets(static_cast<gzFile>(file_), buf, sizeof(buf)) != nullptr) {
    line += buf;
    if (!line.empty() && line.back() == '\n') {
      line.pop_back();
      return true;
    }
  }
  return !line.empty();
}

std::vector<Input> check_inputs(const std::vector<std::string>& files) {
  std::vector<Input> inputs;
  std::map<std::string, std::string> seen;  // canonical path -> as given
  for (const auto& path : files) {
    std::error_code ec;
    DTRAIN_CHECK_AS(ConfigError, fs::exists(path, ec), path, ": no such file");
    DTRAIN_CHECK_AS(ConfigError, fs::is_regular_file(path, ec), path,
                    ": not a regular file (a folder? give the files in it, or a glob such as "
                    "'",
                    path, "/*.txt')");
    const std::string canonical = fs::weakly_canonical(path, ec).string();
    if (auto it = seen.find(canonical); it != seen.end()) {
      // The same file twice (a glob and a name, or a link such as GFDL -> GFDL-1.3): read once,
      // or its text would count twice.
      std::fprintf(stderr, "dtrain-prepare: %s is the same file as %s: read once\n", path.c_str(),
                   it->second.c_str());
      continue;
    }
    seen[canonical] = path;
    Input in;
    in.path = path;
    in.bytes = static_cast<int64_t>(fs::file_size(path, ec));
    std::ifstream f(path, std::ios::binary);
    DTRAIN_CHECK_AS(ConfigError, static_cast<bool>(f) && !ec, path, ": cannot read");
    unsigned char head[16] = {};
    f.read(reinterpret_cast<char*>(head), sizeof(head));
    const std::string kind = compressed_kind(head, static_cast<size_t>(f.gcount()), in.gzip);
    DTRAIN_CHECK_AS(ConfigError, kind.empty(), path, " is ", kind,
                    " and give dtrain-prepare the text");
    // The content: the first 64 KiB as dtrain-prepare will read them.
    std::string sample(64 << 10, '\0');
    if (in.gzip) {
      gzFile g = gzopen(path.c_str(), "rb");
      DTRAIN_CHECK_AS(ConfigError, g != nullptr, path, ": cannot open");
      const int n = gzread(g, sample.data(), static_cast<unsigned>(sample.size()));
      gzclose(g);
      DTRAIN_CHECK_AS(ConfigError, n >= 0, path,
                      ": starts as gzip but does not decompress: is it truncated? (gzip -t)");
      sample.resize(static_cast<size_t>(n));
    } else {
      f.clear();
      f.seekg(0);
      f.read(sample.data(), static_cast<std::streamsize>(sample.size()));
      sample.resize(static_cast<size_t>(f.gcount()));
    }
    if (const auto at = not_text_at(sample)) {
      DTRAIN_FAIL(
          ConfigError, path, " is not text", in.gzip ? " once decompressed" : "", ": byte ", *at,
          " is a ", sample[*at] == '\0' ? "NUL" : "control character", " (0x",
          [&] {
            char hex[8];
            std::snprintf(hex, sizeof(hex), "%02x", static_cast<unsigned char>(sample[*at]));
            return std::string(hex);
          }(),
          "). dtrain-prepare reads text files (UTF-8 or another ASCII-compatible "
          "encoding), plain or gzip; leave this one out");
    }
    inputs.push_back(std::move(in));
  }
  // Shard stems: file names where they are unique, else the paths below the shared folders.
  std::map<std::string, int> count;
  for (const auto& in : inputs) count[without_extensions(fs::path(in.path).filename().string())]++;
  fs::path shared;
  bool first = true;
  for (const auto& in : inputs) {
    const fs::path dir = fs::absolute(in.path).parent_path();
    if (first) {
      shared = dir;
      first = false;
      continue;
    }
    fs::path common;
    auto a = shared.begin(), b = dir.begin();
    for (; a != shared.end() && b != dir.end() && *a == *b; ++a, ++b) common /= *a;
    shared = common;
  }
  std::set<std::string> taken;
  for (auto& in : inputs) {
    const std::string name = without_extensions(fs::path(in.path).filename().string());
    std::string stem = name;
    if (count[name] > 1) {
      stem = without_extensions(fs::absolute(in.path).lexically_relative(shared).string());
      std::replace(stem.begin(), stem.end(), '/', '_');
    }
    for (int k = 2; taken.count(stem); ++k) stem = name + "_" + std::to_string(k);
    taken.insert(stem);
    in.stem = stem;
  }
  return inputs;
}

void check_output(const std::string& out_dir) {
  std::error_code ec;
  if (!fs::exists(out_dir, ec)) return;
  DTRAIN_CHECK_AS(ConfigError, fs::is_directory(out_dir, ec), "--out ", out_dir,
                  " is a file: give a folder (new, empty, or an earlier dtrain-prepare result)");
  if (fs::is_empty(out_dir, ec)) return;
  std::ifstream meta(fs::path(out_dir) / "meta.json");
  const std::string text((std::istreambuf_iterator<char>(meta)), std::istreambuf_iterator<char>());
  DTRAIN_CHECK_AS(ConfigError, text.find("\"written_by\": \"dtrain-prepare\"") != std::string::npos,
                  "--out ", out_dir,
                  " holds files that dtrain-prepare did not write (no meta.json of its own): "
                  "give a new or empty folder, so that nothing of yours is replaced");
}

std::string staging_dir(const std::string& out_dir) {
  const fs::path out = fs::absolute(fs::path(out_dir).lexically_normal());
  const fs::path parent = out.has_filename() ? out.parent_path() : out.parent_path().parent_path();
  std::error_code ec;
  fs::create_directories(parent, ec);
  DTRAIN_CHECK_AS(ConfigError, !ec, "--out ", out_dir, ": cannot make its folder ", parent.string(),
                  ": ", ec.message());
  const std::string staging =
      (parent / ("." + out.filename().string() + ".preparing." + std::to_string(::getpid())))
          .string();
  fs::remove_all(staging, ec);
  fs::create_directory(staging, ec);
  DTRAIN_CHECK_AS(ConfigError, !ec, "--out ", out_dir, ": cannot write in ", parent.string(), ": ",
                  ec.message());
  return staging;
}

void commit_output(const std::string& staging, const std::string& out_dir) {
  std::error_code ec;
  const fs::path out(out_dir);
  const std::string old = staging + ".replaced";
  const bool had = fs::exists(out, ec);
  if (had) {
    fs::rename(out, old, ec);
    DTRAIN_CHECK_AS(ConfigError, !ec, "--out ", out_dir, ": cannot replace it: ", ec.message());
  }
  fs::rename(staging, out, ec);
  if (ec) {
    if (had) fs::rename(old, out);
    DTRAIN_FAIL(ConfigError, "--out ", out_dir, ": cannot put the result in place: ", ec.message());
  }
  if (had) fs::remove_all(old, ec);
}

void discard(const std::string& staging) {
  std::error_code ec;
  fs::remove_all(staging, ec);
}

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
  if (!status.ok()) {
    // SentencePiece names its own options (--character_coverage); say it in dtrain-prepare's.
    const std::string said = status.ToString();
    const auto at = said.find("required_chars. ");
    if (at != std::string::npos) {
      long long asked = 0, needed = 0;
      if (std::sscanf(said.c_str() + at + 16, "%lld vs %lld", &asked, &needed) == 2) {
        DTRAIN_FAIL(ConfigError, "--vocab-size ", asked,
                    " is too small for these inputs: SentencePiece keeps every distinct "
                    "character as a piece, and with its special pieces they need ",
                    needed, ". Give --vocab-size ", needed, " or more");
      }
    }
    DTRAIN_FAIL(ConfigError, "SentencePiece could not train a ", o.model_type, " tokenizer of ",
                o.vocab_size, " pieces on the inputs (--vocab-size, --model-type): ", said);
  }
}

PrepareResult prepare(const Tokenizer& tokenizer, const PrepareOptions& o,
                      const std::string& tokenizer_file) {
  DTRAIN_CHECK_AS(ConfigError, !o.inputs.empty(), "no input files");
  std::error_code ec;
  fs::create_directories(o.out_dir, ec);
  DTRAIN_CHECK_AS(ConfigError, !ec && fs::is_directory(o.out_dir), o.out_dir,
                  ": cannot make the output folder", ec ? ": " + ec.message() : "");
  std::set<std::string> stems;
  for (const auto& in : o.inputs) {
    DTRAIN_CHECK(!in.stem.empty() && stems.insert(in.stem).second, in.path,
                 ": its shard name is empty or taken (the inputs come from check_inputs)");
  }
  const auto t0 = std::chrono::steady_clock::now();
  PrepareResult r;
  r.dtype = tokenizer.vocab_size() <= 65536 ? "uint16" : "uint32";
  const std::vector<Chunk> chunks = cut(o.inputs, std::max<int64_t>(1, o.chunk_bytes), r.bytes);
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
        const Input& input = o.inputs[c.input];
        if (input.gzip) {
          text = gunzip(input.path);
        } else {
          std::ifstream in(input.path, std::ios::binary);
          text.resize(static_cast<size_t>(c.end - c.begin));
          in.seekg(c.begin);
          in.read(text.data(), static_cast<std::streamsize>(text.size()));
          DTRAIN_CHECK(in.gcount() == static_cast<std::streamsize>(text.size()), input.path,
                       ": could not read bytes ", c.begin, "..", c.end,
                       " (did it change while being read?)");
        }
        tokens.clear();
        tokenizer.encode(text, tokens);
        const std::string path = o.out_dir + "/" + shard_name(input, c.index);
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
