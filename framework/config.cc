#include "framework/config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <set>
#include <sstream>

#include "comm/backend.h"
#include "core/error.h"
#include "core/glob.h"
#include "framework/hardware.h"
#include "framework/model_registry.h"

namespace dtrain::framework {
namespace {

// Where each value came from: a line of the file, or a --set override.
struct Origin {
  std::string file;
  std::map<std::string, std::string> overrides;  // key path -> "--set key=value"

  std::string where(const std::string& path, const YAML::Mark& mark) const {
    for (const auto& [key, text] : overrides) {
      if (path == key || path.rfind(key + ".", 0) == 0) return text;
    }
    if (mark.line >= 0) return file + ":" + std::to_string(mark.line + 1);
    // A section the file does not have, made by an override of a key inside it.
    for (const auto& [key, text] : overrides) {
      if (!path.empty() && key.rfind(path + ".", 0) == 0) return text;
    }
    return file;
  }
};

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1])});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

}  // namespace

// A mapping being read: records which keys were consumed so the rest can be refused.
struct ConfigSection::Impl {
  Impl(YAML::Node node, std::string path, const Origin& origin, YAML::Mark mark)
      : node(std::move(node)), path(std::move(path)), origin(origin), mark(mark) {
    if (this->node && !this->node.IsNull() && !this->node.IsMap()) {
      fail_at(this->path, this->node.Mark(), "expected a mapping of keys");
    }
  }

  [[noreturn]] void fail_at(const std::string& at, const YAML::Mark& m,
                            const std::string& msg) const {
    DTRAIN_FAIL(ConfigError, origin.where(at, m), also_from(at, m, msg), ": ", at, ": ", msg);
  }

  // A check of one key against another of its section ("d_model 190 must be divisible by
  // n_heads 4", reported at n_heads) names the --set that gave the other one too, so a value
  // from the command line is never blamed on the file's line alone.
  std::string also_from(const std::string& at, const YAML::Mark& m, const std::string& msg) const {
    const std::string section =
        at.substr(0, at.rfind('.') == std::string::npos ? 0 : at.rfind('.'));
    std::string out;
    for (const auto& [key, text] : origin.overrides) {
      if (key == at || key.rfind(section + ".", 0) != 0 || origin.where(at, m) == text) continue;
      const std::string name = key.substr(key.rfind('.') + 1);
      for (size_t pos = msg.find(name); pos != std::string::npos; pos = msg.find(name, pos + 1)) {
        auto word = [&](size_t i) {
          return i < msg.size() &&
                 (std::isalnum(static_cast<unsigned char>(msg[i])) || msg[i] == '_');
        };
        if ((pos == 0 || !word(pos - 1)) && !word(pos + name.size())) {
          out += (out.empty() ? " (with " : ", ") + text;
          break;
        }
      }
    }
    return out.empty() ? out : out + ")";
  }

  template <typename T>
  static std::string type_name() {
    if constexpr (std::is_same_v<T, bool>) return "true or false";
    if constexpr (std::is_integral_v<T>) return "an integer";
    if constexpr (std::is_floating_point_v<T>) return "a number";
    return "a string";
  }

  YAML::Node node;
  std::string path;
  const Origin& origin;
  YAML::Mark mark;
  std::vector<std::string> known;
};

ConfigSection::ConfigSection(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ConfigSection::ConfigSection(ConfigSection&&) noexcept = default;
ConfigSection& ConfigSection::operator=(ConfigSection&&) noexcept = default;
ConfigSection::~ConfigSection() = default;

std::string ConfigSection::key_path(const std::string& key) const {
  return impl_->path.empty() ? key : impl_->path + "." + key;
}

bool ConfigSection::has(const std::string& key) const {
  const YAML::Node& n = impl_->node;
  return n && n.IsMap() && n[key] && !n[key].IsNull();
}

bool ConfigSection::has_map(const std::string& key) const {
  return has(key) && impl_->node[key].IsMap();
}

ConfigSection ConfigSection::section(const std::string& key) {
  impl_->known.push_back(key);
  const YAML::Node& n = impl_->node;
  YAML::Node child = n && n.IsMap() ? n[key] : YAML::Node();
  return ConfigSection(std::make_unique<Impl>(child, key_path(key), impl_->origin,
                                              child ? child.Mark() : impl_->mark));
}

template <typename T>
void ConfigSection::read(const std::string& key, T& out, bool required) {
  impl_->known.push_back(key);
  if (!has(key)) {
    if (required) impl_->fail_at(key_path(key), impl_->mark, "required key is missing");
    return;
  }
  YAML::Node v = impl_->node[key];
  if (!v.IsScalar()) impl_->fail_at(key_path(key), v.Mark(), "expected " + Impl::type_name<T>());
  try {
    out = v.as<T>();
  } catch (const YAML::Exception&) {
    impl_->fail_at(key_path(key), v.Mark(),
                   "expected " + Impl::type_name<T>() + ", got '" + v.Scalar() + "'");
  }
  if constexpr (std::is_floating_point_v<T>) {
    if (!std::isfinite(out)) {
      impl_->fail_at(key_path(key), v.Mark(), "must be a finite number, got '" + v.Scalar() + "'");
    }
  }
}

template void ConfigSection::read<bool>(const std::string&, bool&, bool);
template void ConfigSection::read<int64_t>(const std::string&, int64_t&, bool);
template void ConfigSection::read<double>(const std::string&, double&, bool);
template void ConfigSection::read<std::string>(const std::string&, std::string&, bool);

void ConfigSection::read_list(const std::string& key, std::vector<std::string>& out) {
  impl_->known.push_back(key);
  if (!has(key)) return;
  YAML::Node v = impl_->node[key];
  out.clear();
  if (v.IsScalar()) {
    out.push_back(v.Scalar());
    return;
  }
  if (!v.IsSequence()) impl_->fail_at(key_path(key), v.Mark(), "expected a list of strings");
  for (const auto& item : v) {
    if (!item.IsScalar()) impl_->fail_at(key_path(key), item.Mark(), "expected a list of strings");
    out.push_back(item.Scalar());
  }
}

void ConfigSection::fail(const std::string& key, const std::string& msg) const {
  YAML::Mark m = has(key) ? impl_->node[key].Mark() : impl_->mark;
  impl_->fail_at(key_path(key), m, msg);
}

void ConfigSection::allow(const std::string& key) { impl_->known.push_back(key); }

bool ConfigSection::is_word(const std::string& key, const std::string& word) {
  impl_->known.push_back(key);
  return has(key) && impl_->node[key].IsScalar() && impl_->node[key].Scalar() == word;
}

void ConfigSection::finish() const {
  const YAML::Node& n = impl_->node;
  if (!n || !n.IsMap()) return;
  for (const auto& kv : n) {
    // A --set value can bring a list or mapping as a key (the file's are refused earlier).
    if (!kv.first.IsScalar()) {
      impl_->fail_at(impl_->path, kv.first.Mark(), "a key must be a name, not a list or mapping");
    }
    std::string key = kv.first.Scalar();
    const auto& known = impl_->known;
    if (std::find(known.begin(), known.end(), key) != known.end()) continue;
    std::string list;
    for (const auto& k : known) list += (list.empty() ? "" : ", ") + k;
    const std::string best = nearest_name(key, known);
    std::string hint = best.empty() ? "" : "did you mean '" + best + "'? ";
    impl_->fail_at(key_path(key), kv.first.Mark(),
                   "unknown key; " + hint + "(keys under " +
                       (impl_->path.empty() ? "the top level" : impl_->path) + ": " + list + ")");
  }
}

void read_vocab_size(ConfigSection& s, int64_t& out) {
  if (s.is_word("vocab_size", "auto")) {
    out = kAutoVocab;
    return;
  }
  s.read("vocab_size", out);
  s.check(
      out >= 2, "vocab_size",
      "must be >= 2, or auto (the tokenizer's, from the meta.json dtrain-prepare writes), got " +
          std::to_string(out));
}

std::string nearest_name(const std::string& name, const std::vector<std::string>& known) {
  std::string best;
  size_t best_d = 3;  // suggest only near misses
  for (const auto& k : known) {
    const size_t d = edit_distance(name, k);
    if (d < best_d) {
      best_d = d;
      best = k;
    }
  }
  return best;
}

namespace {

using Section = ConfigSection;

Section make_section(YAML::Node node, std::string path, const Origin& origin, YAML::Mark mark) {
  return Section(std::make_unique<Section::Impl>(std::move(node), std::move(path), origin, mark));
}

void apply_override(YAML::Node& root, const std::string& text, Origin& origin) {
  auto eq = text.find('=');
  DTRAIN_CHECK_AS(ConfigError, eq != std::string::npos && eq > 0, "--set ", text,
                  ": expected key.path=value");
  // "train.lr = 1e-3" (one shell word, spaces around '='): the key is "train.lr".
  std::string path = text.substr(0, eq);
  path.erase(path.find_last_not_of(" \t") + 1);
  path.erase(0, path.find_first_not_of(" \t"));
  DTRAIN_CHECK_AS(ConfigError, !path.empty(), "--set ", text, ": expected key.path=value");
  std::string value = text.substr(eq + 1);
  origin.overrides["" + path] = "--set " + text;
  std::vector<std::string> keys;
  std::stringstream ss(path);
  for (std::string k; std::getline(ss, k, '.');) {
    DTRAIN_CHECK_AS(ConfigError, !k.empty(), "--set ", text, ": empty key in '", path, "'");
    keys.push_back(k);
  }
  YAML::Node parsed;
  try {
    parsed = YAML::Load(value);
  } catch (const YAML::Exception& e) {
    DTRAIN_FAIL(ConfigError, "--set ", text, ": value is not valid YAML: ", e.what());
  }
  // yaml-cpp nodes are handles: walk down with fresh handles so `root` keeps its identity.
  std::vector<YAML::Node> chain{root};
  for (size_t i = 0; i + 1 < keys.size(); ++i) {
    YAML::Node next = chain.back()[keys[i]];
    if (next && !next.IsNull() && !next.IsMap()) {
      DTRAIN_FAIL(ConfigError, "--set ", text, ": ", keys[i], " is not a section");
    }
    chain.push_back(next);
  }
  chain.back()[keys.back()] = parsed;
}

void read_model(Section s, ModelConfig& m) {
  s.read("type", m.type, /*required=*/true);
  if (m.type == kCustomModel) {
    s.finish();  // a module given in code brings its own shape
    return;
  }
  const ModelSpec* spec = find_model(m.type);
  if (spec == nullptr) {
    std::vector<std::string> names = registered_models();
    std::string list;
    for (const auto& n : names) list += n + ", ";
    names.push_back(kCustomModel);
    const std::string best = nearest_name(m.type, names);
    s.fail("type", "unknown model '" + m.type + "'; " +
                       (best.empty() ? "" : "did you mean '" + best + "'? ") + "expected " + list +
                       "or " + kCustomModel + " (a module given in code)" +
                       (list.empty() ? "; no model is registered: call "
                                       "dtrain::framework::register_builtin_models() (or "
                                       "register_model) before load_config"
                                     : ""));
  }
  m.settings = spec->read(s);
  DTRAIN_CHECK(m.settings != nullptr, "model ", m.type, ": its read() returned no settings");
  s.finish();
}

// dtrain-prepare's meta.json in the folder of the first token file, when there is one: the
// token dtype and the tokenizer's vocabulary.
void read_token_meta(Section& s, const std::string& key, const std::string& first_file,
                     DataConfig& d) {
  const std::filesystem::path meta = std::filesystem::path(first_file).parent_path() / "meta.json";
  if (!std::filesystem::exists(meta)) return;
  YAML::Node m;
  try {
    m = YAML::LoadFile(meta.string());
  } catch (const YAML::Exception& e) {
    s.fail(key, meta.string() + " (beside the token files) is not valid JSON: " + e.what());
  }
  if (!m.IsMap() || !m["written_by"] || m["written_by"].as<std::string>("") != "dtrain-prepare") {
    return;  // someone else's meta.json
  }
  std::string dtype;
  int64_t vocab = 0;
  try {
    dtype = m["dtype"].as<std::string>();
    vocab = m["vocab_size"].as<int64_t>();
  } catch (const YAML::Exception& e) {
    s.fail(key, meta.string() + ": dtype or vocab_size missing or malformed (" + e.what() +
                    "); prepare the data again with dtrain-prepare");
  }
  if (s.has("dtype")) {
    s.check(d.dtype == dtype, "dtype",
            d.dtype + ", but " + meta.string() + " (dtrain-prepare) says the tokens are " + dtype +
                ": remove data.dtype");
  }
  d.dtype = dtype;
  d.token_meta = meta.string();
  d.tokenizer_vocab_size = vocab;
}

// " (relative to the folder dtrain-train runs in, /home/me)" for a relative path.
std::string relative_note(const std::string& path) {
  if (path.empty() || path[0] == '/') return "";
  std::error_code ec;
  return " (a relative path: relative to the folder dtrain-train runs in, " +
         std::filesystem::current_path(ec).string() + ", not to the config file)";
}

void read_data(Section s, DataConfig& d) {
  const bool path_given = s.has("path");
  const bool source_given = s.has("source");
  s.read_choice("source", d.source);
  s.read("path", d.path);
  s.read("seed", d.seed);
  s.read("dtype", d.dtype);
  s.read("val_path", d.val_path);
  s.read("val_fraction", d.val_fraction);
  auto token_file = [](const std::string& p) {
    auto ends = [&](const char* e) {
      const std::string x(e);
      return p.size() >= x.size() && p.compare(p.size() - x.size(), x.size(), x) == 0;
    };
    return ends(".bin") || ends(".npy");
  };
  // A path names the data: it selects a corpus (a .bin or .npy path, token files), and never
  // sits unused beside synthetic data.
  if (path_given && !source_given) {
    d.source = token_file(d.path) ? DataSource::kTokens : DataSource::kCorpus;
  }
  s.check(!path_given || d.source != DataSource::kSynthetic, "path",
          "names data, but data.source is synthetic, which would leave it unread: use "
          "data.source: corpus (a text file) or tokens (.bin/.npy files), or remove data.path");
  s.check(d.source != DataSource::kCorpus || !token_file(d.path), "path",
          "'" + d.path +
              "' is a token file (.bin/.npy), which data.source: corpus would read as "
              "text bytes: use data.source: tokens");
  for (const char* key : {"dtype", "val_path", "val_fraction"}) {
    s.check(!s.has(key) || d.source == DataSource::kTokens, key,
            "applies to data.source: tokens, not " + std::string(name_of(d.source)));
  }
  if (d.source == DataSource::kTokens) {
    s.check(path_given, "path", "is required with data.source: tokens (a file or a glob)");
    s.check(d.val_fraction >= 0 && d.val_fraction < 1, "val_fraction",
            "must be in [0, 1): the share of the training windows held out for validation");
    s.check(!(s.has("val_fraction") && s.has("val_path")), "val_fraction",
            "and data.val_path both name the validation split: keep one");
    s.check(d.dtype == "uint16" || d.dtype == "uint32", "dtype",
            "expected uint16 or uint32 (the .bin files' token type), got '" + d.dtype + "'");
    std::string first_file;  // of data.path
    for (const auto& [key, pattern] :
         {std::pair<const char*, const std::string&>{"path", d.path}, {"val_path", d.val_path}}) {
      if (pattern.empty()) continue;
      const auto files = glob_files(pattern);
      s.check(!files.empty(), key,
              "'" + pattern + "' matches no file" + relative_note(pattern) +
                  (key == std::string("path")
                       ? ". Token files come from dtrain-prepare: dtrain-prepare --out <folder> "
                         "<text files> writes <folder>/*.bin and prints the data.path to give"
                       : ""));
      if (&pattern == &d.path) first_file = files.front();
      for (const auto& f : files) {
        s.check(token_file(f), key,
                "'" + f +
                    "' is neither a .bin nor an .npy token file (a text file is "
                    "data.source: corpus)");
      }
    }
    if (!first_file.empty()) read_token_meta(s, "path", first_file, d);
    // The type of a .bin file's tokens is never guessed: uint16 read as uint32 (or the
    // reverse) trains on garbage without an error. dtrain-prepare records it in meta.json,
    // Megatron in its .idx file, nanoGPT in its code; an .npy file in its own header.
    const bool any_bin = [&] {
      for (const auto& f : glob_files(d.path)) {
        if (f.size() >= 4 && f.compare(f.size() - 4, 4, ".bin") == 0) return true;
      }
      return false;
    }();
    s.check(!any_bin || !d.token_meta.empty() || s.has("dtype"), "path",
            "'" + d.path +
                "' holds .bin token files whose token type nothing records (no meta.json from "
                "dtrain-prepare beside them): set data.dtype to the type they were written with "
                "(uint16 for nanoGPT's prepare.py and vocabularies up to 65536, uint32 above), or "
                "prepare them with dtrain-prepare, which records it");
  }
  if (d.source == DataSource::kCorpus) {
    s.check(!std::filesystem::is_directory(d.path), "path",
            "'" + d.path + "' is a directory; give a text file, or use source: synthetic");
    std::ifstream f(d.path);
    s.check(static_cast<bool>(f), "path",
            "corpus file '" + d.path + "' cannot be read" + relative_note(d.path) +
                "; give a text file, or use source: synthetic");
  }
  s.finish();
}

void read_train(Section s, TrainConfig& t) {
  s.read("steps", t.steps, true);
  s.read("batch_size", t.batch_size, true);
  s.read("micro_batches", t.micro_batches);
  s.read("lr", t.lr, true);
  s.read("weight_decay", t.weight_decay);
  s.read("warmup_steps", t.warmup_steps);
  s.read("clip_grad_norm", t.clip_grad_norm);
  s.read("eval_every", t.eval_every);
  s.read("eval_samples", t.eval_samples);
  s.read_choice("optimizer", t.optimizer);
  s.read("momentum", t.momentum);
  s.read("optimizer_in_backward", t.optimizer_in_backward);
  s.read("seed", t.seed);
  s.read("max_nonfinite_steps", t.max_nonfinite_steps);
  {
    Section g = s.section("spike_guard");
    SpikeGuardConfig& sg = t.spike_guard;
    g.read_choice("action", sg.action);
    g.read("factor", sg.factor);
    g.read("steps", sg.steps);
    g.read("window", sg.window);
    g.read("max_rollbacks", sg.max_rollbacks);
    g.check(sg.factor > 1, "factor",
            "must be > 1 (a spike is a loss above factor times its running median)");
    g.check(sg.steps >= 1, "steps", "must be >= 1 (judged steps in a row above the threshold)");
    g.check(sg.window >= 5, "window", "must be >= 5 (the median's steps)");
    g.check(sg.max_rollbacks >= 0, "max_rollbacks", "must be >= 0");
    g.finish();
  }
  s.check(t.steps >= 1, "steps", "must be >= 1, got " + std::to_string(t.steps));
  s.check(t.batch_size >= 1, "batch_size", "must be >= 1, got " + std::to_string(t.batch_size));
  s.check(t.micro_batches >= 1, "micro_batches", "must be >= 1");
  s.check(t.batch_size % t.micro_batches == 0, "micro_batches",
          "batch_size " + std::to_string(t.batch_size) + " must be divisible by micro_batches " +
              std::to_string(t.micro_batches));
  s.check(t.lr > 0, "lr", "must be > 0, got " + std::to_string(t.lr));
  s.check(t.lr <= 10, "lr",
          "must be <= 10, got " + std::to_string(t.lr) +
              " (a step that large diverges; typical AdamW rates are 1e-4 to 3e-3)");
  s.check(t.max_nonfinite_steps >= 1, "max_nonfinite_steps", "must be >= 1");
  s.check(t.weight_decay >= 0, "weight_decay", "must be >= 0");
  s.check(t.warmup_steps >= 0, "warmup_steps", "must be >= 0");
  s.check(t.clip_grad_norm >= 0, "clip_grad_norm", "must be >= 0 (0 turns clipping off)");
  s.check(t.eval_every >= 0, "eval_every", "must be >= 0 (0 turns validation off)");
  s.check(t.eval_samples >= 1, "eval_samples", "must be >= 1");
  s.check(t.momentum >= 0 && t.momentum < 1, "momentum", "must be in [0, 1)");
  s.finish();
}

void read_parallel(Section s, ParallelConfig& p) {
  s.read_choice("strategy", p.strategy);
  s.read_choice("backend", p.backend);
  p.bucket_cap_mb_set = s.has("bucket_cap_mb");
  s.read("bucket_cap_mb", p.bucket_cap_mb);
  s.read("find_unused_parameters", p.find_unused_parameters);
  s.read("broadcast_buffers", p.broadcast_buffers);
  s.read_choice("sharding_strategy", p.sharding_strategy);
  s.read("forward_prefetch", p.forward_prefetch);
  s.read("backward_prefetch", p.backward_prefetch);
  s.read("limit_all_gathers", p.limit_all_gathers);
  s.read_choice("shard_layout", p.shard_layout);
  s.read_list("wrap_modules", p.wrap_modules);
  s.read("wrap_min_params", p.wrap_min_params);
  s.read("hybrid_group_size", p.hybrid_group_size);
  s.read("tp", p.tp);
  s.read("sequence_parallel", p.sequence_parallel);
  s.read("sequence_parallel_regather", p.sequence_parallel_regather);
  s.read("pp", p.pp);
  {
    std::string name = sharding::pp::schedule_name(p.pp_schedule);
    s.read("pp_schedule", name);
    try {
      p.pp_schedule = sharding::pp::parse_schedule(name);
    } catch (const ConfigError& e) {
      s.fail("pp_schedule", detail::strip_location(e.what()));
    }
  }
  s.read("pp_stages_per_rank", p.pp_stages_per_rank);
  {
    std::vector<std::string> split;
    s.read_list("pp_split", split);
    p.pp_split.clear();
    for (const auto& item : split) {
      size_t used = 0;
      int64_t n = 0;
      try {
        n = std::stoll(item, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used == 0 || used != item.size()) {
        s.fail("pp_split",
               "expected a list of layer counts, one per stage (e.g. [3, 5]), got '" + item + "'");
      }
      p.pp_split.push_back(n);
    }
  }
  s.read("timeout_s", p.timeout_s);
  s.check(p.bucket_cap_mb > 0, "bucket_cap_mb",
          "must be > 0, got " + std::to_string(p.bucket_cap_mb));
  s.check(p.limit_all_gathers >= 1, "limit_all_gathers", "must be >= 1");
  s.check(p.wrap_min_params >= 0, "wrap_min_params", "must be >= 0");
  s.check(p.hybrid_group_size >= 0, "hybrid_group_size",
          "must be >= 0 (0: LOCAL_WORLD_SIZE, one node per shard group)");
  s.check(p.tp >= 1, "tp", "must be >= 1 (ranks per tensor-parallel group; 1: off)");
  s.check(!p.sequence_parallel || p.tp > 1, "sequence_parallel",
          "splits the sequence over a tensor-parallel group, and parallel.tp is 1: set "
          "parallel.tp (2 or more), or remove sequence_parallel");
  s.check(p.pp >= 1 && p.pp <= 4096, "pp",
          "must be in [1, 4096] (pipeline stages' ranks; 1: off), got " + std::to_string(p.pp));
  s.check(p.pp_stages_per_rank >= 1 && p.pp_stages_per_rank <= 256, "pp_stages_per_rank",
          "must be in [1, 256], got " + std::to_string(p.pp_stages_per_rank));
  s.check(p.pp > 1 || p.pp_stages_per_rank == 1, "pp_stages_per_rank",
          "places several pipeline stages on each rank, and parallel.pp is 1 (no pipeline): "
          "set parallel.pp (2 or more), or remove pp_stages_per_rank");
  s.check(p.pp > 1 || p.pp_split.empty(), "pp_split",
          "splits the layers over pipeline stages, and parallel.pp is 1 (no pipeline): set "
          "parallel.pp (2 or more), or remove pp_split");
  s.check(p.timeout_s > 0, "timeout_s", "must be > 0");
  s.finish();
}

void read_precision(Section s, ComputeDevice device, PrecisionConfig& p,
                    std::vector<std::string>& warnings) {
  {
    std::string name = name_of(p.policy);
    s.read("policy", name);
    const std::optional<Precision> v = choice_from_name<Precision>(amp::canonical_dtype_name(name));
    if (!v) {
      s.fail("policy", "expected one of " + choice_list<Precision>() +
                           " (or PyTorch's bfloat16, float16, float32), got '" + name + "'");
    }
    p.policy = *v;
  }
  const auto hw = low_precision_support(torch_device(device));
  if (p.policy == Precision::kAuto) {
    // bf16 where the hardware has it, else fp16 with loss scaling where that is native (GPUs
    // before Ampere), else fp32.
    p.policy = hw.bf16 ? Precision::kBf16 : hw.fp16 ? Precision::kFp16 : Precision::kFp32;
    p.chosen_by = std::string("precision.policy auto chose ") + name_of(p.policy) + " on this " +
                  name_of(device) + " (" +
                  (hw.bf16   ? hw.bf16_how
                   : hw.fp16 ? hw.fp16_how
                             : hw.bf16_how) +
                  ")";
    if (p.policy == Precision::kFp16 && !s.section("scaler").has("enabled")) {
      p.scaler.enabled = true;
    }
  }
  p.mixed = amp::MixedPrecisionPolicy::preset(name_of(p.policy));
  auto dtype = [&](const char* key, auto assign) {
    std::string name;
    s.read(key, name);
    if (name.empty()) return;
    try {
      assign(amp::parse_float_dtype(name));
    } catch (const ConfigError&) {
      s.fail(key,
             "expected fp32, bf16, fp16 or fp64 (or PyTorch's bfloat16, float16, float32), "
             "got '" +
                 name + "'");
    }
  };
  dtype("param_dtype", [&](c10::ScalarType t) { p.mixed.param_dtype = t; });
  dtype("reduce_dtype", [&](c10::ScalarType t) { p.mixed.reduce_dtype = t; });
  dtype("buffer_dtype", [&](c10::ScalarType t) { p.mixed.buffer_dtype = t; });
  dtype("output_dtype", [&](c10::ScalarType t) { p.mixed.output_dtype = t; });
  s.read("cast_forward_inputs", p.mixed.cast_forward_inputs);
  s.read("keep_low_precision_grads", p.mixed.keep_low_precision_grads);
  try {
    p.mixed.validate();
  } catch (const ConfigError& e) {
    s.fail("policy", detail::strip_location(e.what()));
  }
  Section sc = s.section("scaler");
  sc.read("enabled", p.scaler.enabled);
  sc.read("init_scale", p.scaler.init_scale);
  sc.read("growth_factor", p.scaler.growth_factor);
  sc.read("backoff_factor", p.scaler.backoff_factor);
  sc.read("growth_interval", p.scaler.growth_interval);
  sc.read("min_scale", p.scaler.min_scale);
  sc.read("max_consecutive_skips", p.scaler.max_consecutive_skips);
  sc.check(p.scaler.init_scale > 0, "init_scale", "must be > 0");
  sc.check(p.scaler.growth_factor > 1, "growth_factor", "must be > 1");
  sc.check(p.scaler.backoff_factor > 0 && p.scaler.backoff_factor < 1, "backoff_factor",
           "must be in (0, 1)");
  sc.check(p.scaler.growth_interval >= 1, "growth_interval", "must be >= 1");
  sc.check(p.scaler.min_scale >= 0 && p.scaler.min_scale <= p.scaler.init_scale, "min_scale",
           "must be in [0, init_scale]");
  sc.check(p.scaler.max_consecutive_skips >= 0, "max_consecutive_skips",
           "must be >= 0 (0: no limit)");
  // A 16-bit dtype the device has no instructions for is emulated: correct, but slow, by a
  // factor measured on this CPU (on a GPU, an emulated bf16 is not measured).
  auto measured = [&](c10::ScalarType t) {
    if (device != ComputeDevice::kCpu) return std::string();
    char ratio[32];
    std::snprintf(ratio, sizeof(ratio), "%.1fx", cpu_matmul_slowdown(t));
    return "a matmul measured now took " + std::string(ratio) + " fp32's time, and ";
  };
  auto uses = [&](c10::ScalarType t) {
    return p.mixed.param_dtype == t || p.mixed.effective_reduce_dtype() == t;
  };
  if (uses(at::kHalf) && !hw.fp16) {
    warnings.push_back("precision uses fp16, which has no hardware path here (" + hw.fp16_how +
                       "): ATen emulates it; " + measured(at::kHalf) +
                       "steps run several times slower than fp32. " +
                       (hw.bf16 ? "Use precision.policy: bf16 (" + hw.bf16_how + ") or auto"
                                : std::string("Use fp32 here, or fp16/bf16 on a GPU")) +
                       ".");
  }
  if (uses(at::kBFloat16) && !hw.bf16) {
    warnings.push_back("precision uses bf16, which has no hardware path here (" + hw.bf16_how +
                       "): ATen emulates it; " + measured(at::kBFloat16) +
                       "steps can be slower than fp32. " +
                       (hw.fp16 ? "fp16 (" + hw.fp16_how + ") is native here; or use fp32."
                                : std::string("Use fp32 here, or bf16 on a GPU with sm_80+.")));
  }
  if (p.mixed.needs_grad_scaler()) {
    sc.check(p.scaler.enabled, "enabled",
             std::string("policy ") + name_of(p.policy) +
                 " computes or reduces in fp16, whose small gradients underflow without loss "
                 "scaling: set precision.scaler.enabled: true");
  } else if (p.scaler.enabled) {
    warnings.push_back(std::string("precision.scaler.enabled is true with policy ") +
                       name_of(p.policy) +
                       ": bf16 and fp32 have fp32's range and need no loss scaling; the scaler "
                       "only adds work");
  }
  sc.finish();
  s.finish();
}

void read_checkpoint(Section s, CheckpointConfig& c) {
  s.read("dir", c.dir);
  s.read("every_steps", c.every_steps);
  s.read("keep", c.keep);
  s.read("resume", c.resume);
  s.read_choice("format", c.format);
  s.read("async", c.async);
  if (s.is_word("on_signal", "off")) {
    c.on_signal_s = 0;
  } else {
    s.read("on_signal", c.on_signal_s);
  }
  s.read("on_interrupt", c.on_interrupt);
  s.read("allow_data_change", c.allow_data_change);
  s.check(c.every_steps >= 0, "every_steps", "must be >= 0 (0: only at the end)");
  s.check(c.keep >= 1, "keep", "must be >= 1");
  s.check(c.on_signal_s >= 0, "on_signal",
          "must be the seconds a save on SIGTERM or SIGUSR1 may take (> 0), or off");
  s.check(!c.on_interrupt || c.on_signal_s > 0, "on_interrupt",
          "saves within checkpoint.on_signal's time, which is off: give on_signal seconds");
  s.finish();
}

void read_logging(Section s, LoggingConfig& l) {
  s.read_choice("level", l.level);
  s.read("every_steps", l.every_steps);
  s.read("all_ranks", l.all_ranks);
  s.read("metrics_file", l.metrics_file);
  s.read("progress_bar", l.progress_bar);
  s.read("sample_tokens", l.sample_tokens);
  s.check(l.sample_tokens >= 0, "sample_tokens", "must be >= 0 (0: no sample)");
  s.read("progress_every_s", l.progress_every_s);
  s.read("numerics", l.numerics);
  s.read("trace", l.trace);
  s.read("trace_start", l.trace_start);
  s.read("trace_steps", l.trace_steps);
  s.check(l.every_steps >= 1, "every_steps", "must be >= 1");
  s.check(l.progress_every_s > 0, "progress_every_s", "must be > 0");
  s.check(l.trace_start >= 1, "trace_start", "must be >= 1 (the first step is 1)");
  s.check(l.trace_steps >= 1, "trace_steps", "must be >= 1");
  s.finish();
}

// What the model's registration says about the rest of the config: the data it trains on and
// the wrap points FSDP may choose.
void check_model_against(const ModelSpec& spec, RunConfig& cfg, Section& top) {
  const std::string type = cfg.model.type;
  // model.vocab_size: auto, the tokenizer's.
  if (spec.data == ModelData::kTokens &&
      spec.tokens(*cfg.model.settings).vocab_size == kAutoVocab) {
    Section model = top.section("model");
    model.check(cfg.data.tokenizer_vocab_size > 0, "vocab_size",
                "auto takes the tokenizer's vocabulary from the meta.json that dtrain-prepare "
                "writes beside its token files, and data.path has none (data.source: " +
                    std::string(name_of(cfg.data.source)) + "): give a number");
    model.check(spec.set_vocab_size != nullptr, "vocab_size",
                "auto is not supported by model.type " + type + ": give a number");
    spec.set_vocab_size(*cfg.model.settings, cfg.data.tokenizer_vocab_size);
  }
  if (spec.data == ModelData::kOwn && cfg.data.source != DataSource::kSynthetic) {
    top.section("data").fail(
        "source",
        "a corpus (data.source: corpus or tokens, or a data.path) feeds a language "
        "model's tokens, but model.type: " +
            type +
            " trains on data of its own: remove data.path and data.source, or use a "
            "language model (model.type: transformer or llama)");
  }
  if (spec.data == ModelData::kTokens && cfg.data.source == DataSource::kTokens &&
      cfg.data.tokenizer_vocab_size > 0) {
    const TokenShape t = spec.tokens(*cfg.model.settings);
    const int64_t want = cfg.data.tokenizer_vocab_size;
    if (!t.pretrained.empty()) {
      // The checkpoint fixes the vocabulary, and so the tokenizer: tokens of another one would
      // train on ids that mean other words, whatever the sizes.
      const std::filesystem::path theirs = std::filesystem::path(t.pretrained) / "tokenizer.model";
      const std::filesystem::path ours =
          std::filesystem::path(cfg.data.token_meta).parent_path() / "tokenizer.model";
      auto bytes = [](const std::filesystem::path& p) {
        std::ifstream f(p, std::ios::binary);
        return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
      };
      const bool both = std::filesystem::exists(theirs) && std::filesystem::exists(ours);
      const std::string how =
          std::filesystem::exists(theirs)
              ? "prepare the text with the checkpoint's tokenizer: dtrain-prepare "
                "--tokenizer-model " +
                    theirs.string() + " --out <folder> <text files>"
              : "prepare the text with the tokenizer the checkpoint was trained with "
                "(dtrain-prepare --tokenizer-model <its .model file>)";
      top.section("data").check(
          t.vocab_size == want && (!both || bytes(theirs) == bytes(ours)), "path",
          "these tokens come from another tokenizer than model.pretrained's checkpoint: " +
              (t.vocab_size != want
                   ? "the checkpoint's vocabulary is " + std::to_string(t.vocab_size) + " (" +
                         t.pretrained + "/config.json), the tokens' " + std::to_string(want) +
                         " (" + cfg.data.token_meta + ")"
                   : "their tokenizer.model files differ (" + theirs.string() + ", " +
                         ours.string() + ")") +
              ". Its ids would stand for other pieces of text. To fix it, " + how);
    }
    top.section("model").check(
        t.vocab_size >= want, "vocab_size",
        std::to_string(t.vocab_size) + " is smaller than the tokenizer's vocabulary of " +
            std::to_string(want) + " (" + cfg.data.token_meta +
            ", written by dtrain-prepare): set model.vocab_size: " + std::to_string(want));
  }
  if (spec.data == ModelData::kTokens && cfg.data.source == DataSource::kCorpus) {
    const TokenShape t = spec.tokens(*cfg.model.settings);
    top.section("model").check(t.vocab_size >= 256, "vocab_size",
                               "must be >= 256 for the byte corpus (data.source: corpus reads "
                               "bytes), got " +
                                   std::to_string(t.vocab_size));
  }
  // After model.vocab_size: auto is resolved.
  if (cfg.parallel.tp > 1) {
    Section p = top.section("parallel");
    p.check(
        spec.tp_problem != nullptr, "tp",
        "model.type " + type + " has no tensor-parallel plan (llama has one); set parallel.tp: 1");
    const std::string problem = spec.tp_problem(*cfg.model.settings, cfg.parallel.tp);
    p.check(problem.empty(), "tp", problem);
    if (cfg.parallel.sequence_parallel && spec.data == ModelData::kTokens) {
      const int64_t seq = spec.tokens(*cfg.model.settings).seq_len;
      p.check(seq % cfg.parallel.tp == 0, "sequence_parallel",
              "splits each sequence of model.seq_len " + std::to_string(seq) + " tokens over " +
                  std::to_string(cfg.parallel.tp) +
                  " ranks, and it does not divide: choose a seq_len that divides by parallel.tp");
    }
  }
  if (cfg.parallel.pp > 1) {
    Section p = top.section("parallel");
    p.check(spec.pipeline_layers != nullptr, "pp",
            "model.type " + type +
                " has no pipeline split (llama has one: its decoder layers); set parallel.pp: 1");
    const std::string problem = spec.pp_problem ? spec.pp_problem(*cfg.model.settings) : "";
    p.check(problem.empty(), "pp", problem);
    try {
      sharding::pp::split_layers(
          spec.pipeline_layers(*cfg.model.settings),
          static_cast<int>(cfg.parallel.pp * cfg.parallel.pp_stages_per_rank),
          cfg.parallel.pp_split);
    } catch (const ConfigError& e) {
      p.fail(cfg.parallel.pp_split.empty() ? "pp" : "pp_split", detail::strip_location(e.what()));
    }
  }
  for (const auto& w : cfg.parallel.wrap_modules) {
    auto short_name = [](std::string n) {
      if (auto colon = n.rfind("::"); colon != std::string::npos) n = n.substr(colon + 2);
      if (n.size() > 4 && n.compare(n.size() - 4, 4, "Impl") == 0) n.resize(n.size() - 4);
      return n;
    };
    bool known = false;
    std::string list;
    for (const auto& p : spec.wrap_points) {
      known = known || short_name(p) == short_name(w);
      list += (list.empty() ? "" : ", ") + p;
    }
    top.section("parallel")
        .check(known, "wrap_modules",
               "'" + w + "' is not a wrap point of model.type " + type + " (" +
                   (list.empty() ? std::string("it has none: the whole model is one unit")
                                 : "it has " + list) +
                   ")");
  }
}

RunConfig parse_node(YAML::Node root, Origin& origin) {
  RunConfig cfg;
  cfg.source = origin.file;
  Section top = make_section(root, "", origin, YAML::Mark());
  if (!root || root.IsNull()) DTRAIN_FAIL(ConfigError, origin.file, ": the config is empty");
  top.read_choice("device", cfg.device);
  read_model(top.section("model"), cfg.model);
  read_data(top.section("data"), cfg.data);
  read_train(top.section("train"), cfg.train);
  read_parallel(top.section("parallel"), cfg.parallel);
  read_precision(top.section("precision"), cfg.device, cfg.precision, cfg.warnings);
  read_checkpoint(top.section("checkpoint"), cfg.checkpoint);
  read_logging(top.section("logging"), cfg.logging);
  if (cfg.parallel.strategy != ParallelStrategy::kFsdp) {
    // PyTorch's DDP mixed precision has param, reduce and buffer dtypes only; dtrain's DDP
    // computes under autocast in param_dtype. The FSDP-only fields are refused, not ignored.
    Section prec = top.section("precision");
    const auto& mp = cfg.precision.mixed;
    const std::string why = " is an FSDP setting that strategy " +
                            std::string(name_of(cfg.parallel.strategy)) +
                            " cannot honour; use parallel.strategy: fsdp, or remove it";
    if (mp.output_dtype) prec.fail("output_dtype", "output_dtype" + why);
    if (mp.cast_forward_inputs) prec.fail("cast_forward_inputs", "cast_forward_inputs" + why);
    if (mp.keep_low_precision_grads) {
      prec.fail("keep_low_precision_grads", "keep_low_precision_grads" + why);
    }
  } else if (cfg.precision.mixed.keep_low_precision_grads &&
             cfg.precision.mixed.effective_reduce_dtype() != at::kFloat) {
    // FSDP's custom-optimizer option: the trainer's fused AdamW and SGD step fp32 master
    // weights with fp32 gradients, so it would fail at the first step.
    Section prec = top.section("precision");
    prec.fail("keep_low_precision_grads",
              "keep_low_precision_grads leaves gradients in the reduce dtype, which the "
              "trainer's fused AdamW and SGD cannot step (they need fp32 gradients); remove it, "
              "or use it through the library with an optimizer that takes low-precision "
              "gradients");
  }
  if (cfg.train.optimizer_in_backward) {
    Section train = top.section("train");
    const std::string why =
        "optimizer_in_backward steps each FSDP unit as soon as its gradients "
        "are reduced, so nothing sees the whole gradient: ";
    train.check(cfg.parallel.strategy == ParallelStrategy::kFsdp, "optimizer_in_backward",
                why +
                    "it needs parallel.strategy: fsdp (DDP's gradients are whole already); "
                    "set it, or remove optimizer_in_backward");
    train.check(cfg.train.clip_grad_norm == 0, "optimizer_in_backward",
                why +
                    "clipping needs the norm of all of it first; remove train.clip_grad_norm "
                    "or optimizer_in_backward");
    train.check(!cfg.precision.scaler.enabled, "optimizer_in_backward",
                why +
                    "a GradScaler must judge all of it before any step; use bf16 or fp32 "
                    "(precision.scaler off), or remove optimizer_in_backward");
  }
  if (cfg.train.spike_guard.action == SpikeAction::kRollback) {
    Section g = top.section("train").section("spike_guard");
    g.check(!cfg.checkpoint.dir.empty() && cfg.checkpoint.every_steps > 0, "action",
            "rollback goes back to the newest checkpoint before a spike, so it needs "
            "checkpoints during the run: set checkpoint.dir and checkpoint.every_steps, or use "
            "action: warn");
  }
  if (cfg.parallel.tp > 1) {
    Section p = top.section("parallel");
    p.check(!cfg.train.optimizer_in_backward || !cfg.parallel.sequence_parallel,
            "sequence_parallel",
            "under sequence parallelism the norms' gradients are summed over the TP group after "
            "backward, and train.optimizer_in_backward steps before that; remove one of them");
  }
  if (cfg.parallel.pp > 1) {
    // Pipeline parallelism: one schedule for every pipeline, checked here (it refuses what it
    // cannot run) rather than at the first step.
    Section p = top.section("parallel");
    p.check(cfg.parallel.strategy != ParallelStrategy::kNone, "pp",
            "pipeline stages run with parallel.strategy ddp (each stage's gradients averaged "
            "over its data-parallel ranks) or fsdp (each stage sharded over them); strategy "
            "none has no data-parallel ranks: set ddp or fsdp, or parallel.pp: 1");
    const auto ss = cfg.parallel.sharding_strategy;
    p.check(cfg.parallel.strategy != ParallelStrategy::kFsdp ||
                ss == sharding::ShardingStrategy::kFullShard ||
                ss == sharding::ShardingStrategy::kShardGradOp,
            "sharding_strategy",
            "a pipeline's stages shard over all of their data-parallel ranks (full_shard; "
            "shard_grad_op is the same there: a stage's parameters are gathered once per step); " +
                std::string(name_of(ss)) +
                " with a pipeline is not built yet: set full_shard, or parallel.pp: 1");
    p.check(!cfg.train.optimizer_in_backward, "pp",
            "train.optimizer_in_backward is FSDP's; the pipeline's stages step after the whole "
            "schedule: remove optimizer_in_backward");
    // Every rank's list holds a few actions per stage and micro-batch: planned here and by
    // every rank, so a size that would take gigabytes is refused first.
    constexpr int64_t kMaxPlanned = int64_t{1} << 22;
    const int64_t planned =
        cfg.parallel.pp * cfg.parallel.pp_stages_per_rank * cfg.train.micro_batches;
    p.check(planned <= kMaxPlanned, "pp",
            "a pipeline of parallel.pp x pp_stages_per_rank stages and train.micro_batches "
            "micro-batches (" +
                std::to_string(planned) + " pairs) is too large to plan (at most " +
                std::to_string(kMaxPlanned) + "): fewer stages or micro-batches");
    try {
      sharding::pp::make_schedule(cfg.parallel.pp_schedule, static_cast<int>(cfg.parallel.pp),
                                  static_cast<int>(cfg.train.micro_batches),
                                  static_cast<int>(cfg.parallel.pp_stages_per_rank));
    } catch (const ConfigError& e) {
      p.fail("pp_schedule", detail::strip_location(e.what()));
    }
  }
  if (const ModelSpec* spec = find_model(cfg.model.type)) check_model_against(*spec, cfg, top);
  if (cfg.parallel.backend == comm::Backend::kNccl && cfg.device != ComputeDevice::kCuda) {
    Section p = top.section("parallel");
    p.fail("backend",
           "nccl needs device: cuda (it moves CUDA tensors only); use gloo or mpi on cpu");
  }
  top.finish();
  return cfg;
}

RunConfig parse_with(YAML::Node root, const std::string& name,
                     const std::vector<std::string>& overrides) {
  Origin origin{name, {}};
  if (!root || root.IsNull()) root = YAML::Node(YAML::NodeType::Map);
  DTRAIN_CHECK_AS(ConfigError, root.IsMap(), name, ": the top level must be a mapping of sections");
  for (const auto& o : overrides) apply_override(root, o, origin);
  return parse_node(root, origin);
}

// yaml-cpp keeps both entries of a key written twice in one mapping, and lookups see the
// first: the second would be silently ignored. Also refuses what would make a walk over the
// document endless: an alias inside the node its anchor names (`a: &x [*x]`, a cycle), and
// aliases that expand to more than kMaxConfigNodes nodes (the "billion laughs").
constexpr size_t kMaxConfigNodes = 100000;

struct DocumentWalk {
  std::string file;
  std::vector<YAML::Node> open;  // the containers around the node being checked
  size_t nodes = 0;
};

void refuse_duplicate_keys(const YAML::Node& node, const std::string& path, DocumentWalk& walk) {
  const std::string where = path.empty() ? std::string("the top level") : path;
  DTRAIN_CHECK_AS(ConfigError, ++walk.nodes <= kMaxConfigNodes, walk.file, ": ", where,
                  ": the document expands to more than ", kMaxConfigNodes,
                  " values (aliases of aliases?); a config is a few dozen keys");
  if (!node.IsSequence() && !node.IsMap()) return;
  for (const auto& outer : walk.open) {
    DTRAIN_CHECK_AS(ConfigError, !outer.is(node), walk.file, ":", node.Mark().line + 1, ": ", where,
                    ": an alias (*name) refers to a node that contains it; YAML anchors must not "
                    "be recursive");
  }
  walk.open.push_back(node);
  if (node.IsSequence()) {
    for (const auto& item : node) refuse_duplicate_keys(item, path, walk);
  } else {
    std::map<std::string, int> seen;  // key -> line (1-based)
    for (const auto& kv : node) {
      const int line = kv.first.Mark().line + 1;
      // A list or mapping as a key ({[a, b]: 1}) names nothing dtrain reads.
      DTRAIN_CHECK_AS(ConfigError, kv.first.IsScalar(), walk.file, ":", line, ": ", where,
                      ": a key must be a name, not a list or mapping");
      const std::string key = kv.first.Scalar();
      const std::string key_path = path.empty() ? key : path + "." + key;
      auto [it, fresh] = seen.emplace(key, line);
      DTRAIN_CHECK_AS(ConfigError, fresh, walk.file, ":", line, ": ", key_path,
                      ": duplicate key (also at line ", it->second,
                      "); YAML would keep only one of them: remove the other");
      refuse_duplicate_keys(kv.second, key_path, walk);
    }
  }
  walk.open.pop_back();
}

}  // namespace

RunConfig parse_config(const std::string& yaml_text, const std::string& name,
                       const std::vector<std::string>& overrides) {
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    // YAML indents with spaces only; a tab makes yaml-cpp speak of map values or blocks.
    std::istringstream lines(yaml_text);
    int number = 0;
    for (std::string line; std::getline(lines, line);) {
      ++number;
      const size_t text_at = line.find_first_not_of(" \t");
      if (number > e.mark.line + 1 || text_at == std::string::npos) continue;
      DTRAIN_CHECK_AS(ConfigError, line.find('\t') >= text_at, name, ":", number,
                      ": indented with a tab; YAML indents with spaces only (yaml-cpp: ", e.msg,
                      ")");
    }
    DTRAIN_FAIL(ConfigError, name, ":", e.mark.line + 1, ": not valid YAML: ", e.msg);
  }
  DTRAIN_CHECK_AS(ConfigError, (root && !root.IsNull()) || !overrides.empty(), name,
                  ": the config is empty; start from configs/default.yaml (configs/README.md "
                  "lists every key)");
  DocumentWalk walk{name, {}, 0};
  refuse_duplicate_keys(root, "", walk);
  return parse_with(root, name, overrides);
}

RunConfig load_config(const std::string& path, const std::vector<std::string>& overrides) {
  DTRAIN_CHECK_AS(ConfigError, !std::filesystem::is_directory(path), "config file '", path,
                  "' is a directory; give a YAML file, e.g. configs/default.yaml");
  std::ifstream f(path);
  DTRAIN_CHECK_AS(ConfigError, static_cast<bool>(f), "config file '", path,
                  "' cannot be read (does it exist?)");
  std::stringstream ss;
  ss << f.rdbuf();
  return parse_config(ss.str(), path, overrides);
}

}  // namespace dtrain::framework
