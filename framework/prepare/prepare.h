// Preparing data (dtrain-prepare): text files -> token files that data.source: tokens reads
// (framework/data.h TokenFileSource), memory-mapped, in nanoGPT's flat layout.
//
//   text files --(cut at line ends into chunks of about chunk_bytes)--> jobs threads, each
//   encoding one chunk at a time --> OUT/<file stem>-<chunk>.bin (uint16, or uint32 when the
//   vocabulary has more than 65536 tokens), plus OUT/meta.json and, for SentencePiece,
//   OUT/tokenizer.model.
//
// Nothing is misread and nothing is left half-done: every input is checked before any work
// (check_inputs: gzip is read decompressed, other compressed or binary files are refused by
// their content, each file's shards are named from its path so that two inputs of the same
// name never collide), the output folder too (check_output), and the result is built in a
// folder beside it and put in its place whole at the end (staging_dir, commit_output): a
// failure at any point leaves the output folder as it was.
//
// Tokenizers:
//   - bytes: each byte is a token (vocabulary 256), the text exactly, newlines included;
//   - sentencepiece: Google's SentencePiece (Debian's libsentencepiece), a model loaded from a
//     .model file or trained here on the inputs (BPE or unigram, with byte fallback so any text
//     encodes). Each line is encoded on its own and followed by the model's end-of-sentence id,
//     which stands for the line break; blank lines are kept as a lone end-of-sentence.
// meta.json names the tokenizer, its vocabulary size and the token dtype, and lists each
// shard with its token count; the config reader takes data.dtype from it and checks
// model.vocab_size against it, so a run cannot read the tokens as the wrong type or with a
// vocabulary too small.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace dtrain::framework::prepare {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::string name() const = 0;  // "bytes", "sentencepiece"
  virtual int64_t vocab_size() const = 0;
  // Appends the tokens of `text` (whole lines) to `out`.
  virtual void encode(std::string_view text, std::vector<uint32_t>& out) const = 0;
  // Token ids back to text.
  virtual std::string decode(const std::vector<int>& ids) const = 0;
  // The id encode() puts after each line (SentencePiece's end-of-sentence), or -1 when a line
  // break is just its own byte.
  virtual int64_t line_end() const { return -1; }
};

std::unique_ptr<Tokenizer> bytes_tokenizer();
// A SentencePiece model file (ConfigError naming it when it cannot be loaded).
std::unique_ptr<Tokenizer> load_sentencepiece(const std::string& model_file);

struct SentencePieceTraining {
  int64_t vocab_size = 4096;
  std::string model_type = "bpe";  // bpe | unigram
  int threads = 1;
  // At most this many lines are sampled from the inputs to train on.
  int64_t max_lines = 2000000;
};
// Trains a SentencePiece model on `inputs` into `model_prefix`.model (and .vocab). The vocabulary
// may come out smaller than asked for a small text (SentencePiece's hard_vocab_limit off).
void train_sentencepiece(const std::vector<std::string>& inputs, const std::string& model_prefix,
                         const SentencePieceTraining& options);

struct Shard {
  std::string file;  // its name in the output folder
  int64_t tokens = 0;
};

struct Progress {
  int64_t bytes_done = 0, bytes_total = 0, tokens = 0;
  double seconds = 0;
};

// An input as dtrain-prepare reads it.
struct Input {
  std::string path;
  bool gzip = false;  // read decompressed
  int64_t bytes = 0;  // on disk
  std::string stem;   // its shards' names: <stem>-<chunk>.bin, unique among the inputs
};

// Every check on the inputs, before any work; ConfigError naming the file (and what to do)
// for one that is missing, not a regular file, compressed otherwise than with gzip (xz,
// bzip2, zstd, zip, 7z), or not text: a NUL byte, or more than 1% control characters, in its
// first 64 KiB (decompressed for gzip). A file given twice (also through a link) is read once,
// said on stderr. Shard stems are the file names
// without .txt/.gz, or, where names repeat, the paths below the folders the inputs share
// ("a/notes.txt", "b/notes.txt" -> "a_notes", "b_notes").
std::vector<Input> check_inputs(const std::vector<std::string>& files);

// The output folder may be absent, empty, or a dtrain-prepare result (its meta.json says so),
// which the new one replaces whole; ConfigError for anything else, before any work.
void check_output(const std::string& out_dir);
// A new empty folder beside `out_dir` to build the result in.
std::string staging_dir(const std::string& out_dir);
// Puts the finished `staging` folder in `out_dir`'s place (an earlier result removed after).
void commit_output(const std::string& staging, const std::string& out_dir);
// Removes a staging folder (after a failure).
void discard(const std::string& staging);

// The lines of a text file, gzip or not (zlib reads both), for the tokenizer's training.
class LineReader {
 public:
  explicit LineReader(const std::string& path);
  ~LineReader();
  LineReader(const LineReader&) = delete;
  LineReader& operator=(const LineReader&) = delete;
  bool next(std::string& line);  // false at the end

 private:
  void* file_;  // gzFile
  std::string path_;
};

struct PrepareOptions {
  std::vector<Input> inputs;  // from check_inputs
  std::string out_dir;
  int jobs = 1;
  int64_t chunk_bytes = int64_t{32} << 20;
  // Called from the encoding threads (one at a time) as chunks finish.
  std::function<void(const Progress&)> on_progress;
};

struct PrepareResult {
  std::vector<Shard> shards;  // in input order
  std::string dtype;          // uint16 | uint32
  int64_t tokens = 0, bytes = 0;
  double seconds = 0;
};

// Encodes every input into token shards in out_dir (made if needed; each shard written to a
// temporary name and renamed) and writes out_dir/meta.json. A gzip input is decompressed
// whole by one thread and written as one shard. `tokenizer_file` is the name of
// the tokenizer's model in out_dir ("" for bytes), recorded in meta.json.
PrepareResult prepare(const Tokenizer& tokenizer, const PrepareOptions& options,
                      const std::string& tokenizer_file);

}  // namespace dtrain::framework::prepare
