#include "framework/checkpoint/meta.h"

#include <yaml-cpp/yaml.h>

#include <climits>
#include <cmath>
#include <cstdio>
#include <limits>
#include <sstream>

#include "core/error.h"
#include "core/json.h"

namespace dtrain::framework::ckpt {
namespace {

constexpr int64_t kMost = std::numeric_limits<int64_t>::max();

// --- writing ----------------------------------------------------------------------------

std::string ints(const std::vector<int64_t>& v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
  return out + "]";
}

// Every digit: the parser gets back the same double.
std::string number(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  return buf;
}

std::string spike_json(const SpikeRecord& sp) {
  std::string out = "{\"history\": [";
  for (size_t i = 0; i < sp.history.size(); ++i) {
    out += (i ? ", [" : "[") + std::to_string(sp.history[i].first) + ", " +
           number(sp.history[i].second) + "]";
  }
  out += "], \"streak\": " + std::to_string(sp.streak) +
         ", \"streak_start\": " + std::to_string(sp.streak_start) +
         ", \"skipped_batches\": " + ints(sp.skipped_batches) + ", \"spikes\": [";
  for (size_t i = 0; i < sp.spikes.size(); ++i) {
    out += (i ? ", [" : "[") + std::to_string(sp.spikes[i].first) + ", " +
           std::to_string(sp.spikes[i].second) + "]";
  }
  return out + "]}";
}

std::string file_json(const FileInfo& f) {
  return "{\"name\": " + json::quote(f.name) + ", \"bytes\": " + std::to_string(f.bytes) +
         ", \"xxh64\": \"" + hex(f.checksum) + "\"}";
}

// --- reading ----------------------------------------------------------------------------

// Typed access to a parsed metadata file. Every lookup checks the node's kind before using
// it (yaml-cpp throws its own exceptions, not dtrain's, on a scalar where a mapping was
// expected, on a missing key or on a bad conversion), and every failure is a
// CheckpointError naming the file and the key: a damaged or hand-edited file is refused
// like a corrupt one.
class Reader {
 public:
  explicit Reader(std::string where) : where_(std::move(where)) {}

  [[noreturn]] void fail(const std::string& path, const std::string& msg) const {
    DTRAIN_FAIL(CheckpointError, where_, ": ", path.empty() ? "" : path + ": ", msg,
                "; this checkpoint cannot be trusted");
  }

  YAML::Node load(const std::string& text) const {
    try {
      return YAML::Load(text);
    } catch (const YAML::Exception& e) {
      DTRAIN_FAIL(CheckpointError, where_, " is not valid (", e.what(), ")");
    }
  }

  // `map[key]`, which must exist; `map` must be a mapping.
  YAML::Node field(const YAML::Node& map, const std::string& path, const std::string& key) const {
    if (!map.IsMap()) fail(path, "expected a mapping");
    YAML::Node v = map[key];  // `map` is const: a lookup does not insert the key
    if (!v.IsDefined() || v.IsNull()) fail(join(path, key), "missing");
    return v;
  }

  YAML::Node sequence(const YAML::Node& map, const std::string& path,
                      const std::string& key) const {
    YAML::Node v = field(map, path, key);
    if (!v.IsSequence()) fail(join(path, key), "expected a list");
    return v;
  }

  template <typename T>
  T scalar(const YAML::Node& v, const std::string& path) const {
    if (!v.IsScalar()) fail(path, "expected a single value");
    try {
      return v.as<T>();
    } catch (const YAML::Exception&) {
      fail(path, "'" + v.Scalar() + "' is not " + kind<T>());
    }
  }

  template <typename T>
  T get(const YAML::Node& map, const std::string& path, const std::string& key) const {
    return scalar<T>(field(map, path, key), join(path, key));
  }

  int64_t integer(const YAML::Node& map, const std::string& path, const std::string& key,
                  int64_t min, int64_t max) const {
    const int64_t v = get<int64_t>(map, path, key);
    if (v < min || v > max) {
      fail(join(path, key), std::to_string(v) + " is outside [" + std::to_string(min) + ", " +
                                std::to_string(max) + "]");
    }
    return v;
  }

  std::string text(const YAML::Node& map, const std::string& path, const std::string& key) const {
    return get<std::string>(map, path, key);
  }

  FileInfo file(const YAML::Node& n, const std::string& path) const {
    FileInfo f;
    f.name = text(n, path, "name");
    // A plain name in the checkpoint's directory, never a path out of it.
    if (f.name.empty() || f.name == "." || f.name == ".." ||
        f.name.find_first_of(std::string("/\\\0", 3)) != std::string::npos) {
      fail(join(path, "name"), "'" + f.name + "' is not a file name");
    }
    f.bytes = get<uint64_t>(n, path, "bytes");
    const std::string hex = text(n, path, "xxh64");
    if (hex.empty() || hex.size() > 16)
      fail(join(path, "xxh64"), "'" + hex + "' is not a checksum");
    for (char c : hex) {
      int d = c >= '0' && c <= '9'   ? c - '0'
              : c >= 'a' && c <= 'f' ? c - 'a' + 10
              : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                     : -1;
      if (d < 0) fail(join(path, "xxh64"), "'" + hex + "' is not a checksum");
      f.checksum = f.checksum << 4 | static_cast<uint64_t>(d);
    }
    return f;
  }

  // A list of sizes, none negative.
  std::vector<int64_t> shape(const YAML::Node& map, const std::string& path) const {
    const YAML::Node v = sequence(map, path, "shape");
    std::vector<int64_t> out;
    for (size_t d = 0; d < v.size(); ++d) {
      const int64_t n = scalar<int64_t>(v[d], at(path + ".shape", d));
      if (n < 0) fail(at(path + ".shape", d), "a size cannot be negative");
      out.push_back(n);
    }
    return out;
  }

  UnitMeta unit(const YAML::Node& n, const std::string& path) const {
    UnitMeta unit;
    unit.name = text(n, path, "name");
    unit.numel = integer(n, path, "numel", 0, kMost);
    // Positions in the flat buffer are divided by it (which shard file holds them).
    unit.shard_size = integer(n, path, "shard_size", 1, kMost);
    unit.shard_group_size = integer(n, path, "shard_group_size", 1, INT_MAX);
    if (n["layout"]) {
      unit.layout = text(n, path, "layout");
      if (unit.layout != "flat" && unit.layout != "per_parameter") {
        fail(join(path, "layout"), "'" + unit.layout + "' is neither per_parameter nor flat");
      }
    }
    const bool per_parameter = unit.layout == "per_parameter";
    const YAML::Node ps = sequence(n, path, "params");
    for (size_t i = 0; i < ps.size(); ++i) {
      const std::string ppath = at(path + ".params", i);
      UnitParamMeta e{text(ps[i], ppath, "name"), shape(ps[i], ppath),
                      integer(ps[i], ppath, "offset", 0, kMost),
                      integer(ps[i], ppath, "numel", 0, kMost)};
      if (per_parameter) {
        // A file's chunk of the parameter lies inside the file.
        e.chunk = integer(ps[i], ppath, "chunk", 0, unit.shard_size);
        e.shard_at = integer(ps[i], ppath, "shard_at", 0, unit.shard_size - e.chunk);
        if (e.chunk < (e.numel + unit.shard_group_size - 1) / unit.shard_group_size) {
          fail(join(ppath, "chunk"), std::to_string(e.chunk) + " elements in each of " +
                                         std::to_string(unit.shard_group_size) +
                                         " files cannot hold " + std::to_string(e.numel));
        }
      }
      if (ps[i]["tp_dim"]) {
        e.tp_dim = integer(ps[i], ppath, "tp_dim", 0, static_cast<int64_t>(e.shape.size()) - 1);
      }
      unit.params.push_back(std::move(e));
    }
    return unit;
  }

  static std::string join(const std::string& path, const std::string& key) {
    return path.empty() ? key : path + "." + key;
  }
  static std::string at(const std::string& path, size_t i) {
    return path + "[" + std::to_string(i) + "]";
  }

 private:
  template <typename T>
  static std::string kind() {
    if constexpr (std::is_integral_v<T>) {
      return std::is_unsigned_v<T> ? "a non-negative integer" : "an integer";
    }
    if constexpr (std::is_floating_point_v<T>) return "a number";
    return "a string";
  }

  std::string where_;
};

}  // namespace

FileInfo parse_complete(const std::string& text, const std::string& where) {
  Reader r(where);
  const YAML::Node root = r.load(text);
  FileInfo meta = r.file(r.field(root, "", "meta"), "meta");
  if (meta.name != "meta.json") r.fail("meta.name", "'" + meta.name + "' is not meta.json");
  return meta;
}

Meta parse_meta(const std::string& text, const std::string& where) {
  Reader r(where);
  const YAML::Node root = r.load(text);
  // A key a mapping lacks is an undefined node, which throws on every question but this one.
  const YAML::Node format = root.IsMap() ? root["format"] : YAML::Node();
  DTRAIN_CHECK_AS(CheckpointError,
                  format.IsDefined() && format.IsScalar() && format.Scalar() == kFormat, where,
                  " is not a dtrain checkpoint's");
  const YAML::Node version = root["version"];
  if (version.IsDefined() && !version.IsNull()) {
    const int64_t v = r.scalar<int64_t>(version, "version");
    DTRAIN_CHECK_AS(CheckpointError, v == kVersion, where, " is version ", v,
                    " of dtrain's checkpoint format; this dtrain reads version ", kVersion,
                    " only");
  }
  Meta m;
  const YAML::Node files = r.sequence(root, "", "files");
  for (size_t i = 0; i < files.size(); ++i) {
    FileInfo f = r.file(files[i], Reader::at("files", i));
    if (m.files.count(f.name)) r.fail(Reader::at("files", i), "'" + f.name + "' listed twice");
    m.files[f.name] = f;
  }
  m.strategy = r.text(root, "", "strategy");
  m.mode = r.text(root, "", "mode");
  if (m.mode != "full" && m.mode != "sharded") {
    r.fail("mode", "'" + m.mode + "' is neither full nor sharded");
  }
  m.world_size = static_cast<int>(r.integer(root, "", "world_size", 1, INT_MAX));
  const YAML::Node params = r.sequence(root, "", "parameters");
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string path = Reader::at("parameters", i);
    m.parameters.push_back({r.text(params[i], path, "name"), r.shape(params[i], path),
                            r.text(params[i], path, "dtype")});
  }
  const YAML::Node keys = r.sequence(root, "", "optimizer_keys");
  for (size_t i = 0; i < keys.size(); ++i) {
    m.optimizer_keys.push_back(r.scalar<std::string>(keys[i], Reader::at("optimizer_keys", i)));
  }
  if (m.mode == "sharded") {
    const YAML::Node units = r.sequence(root, "", "units");
    for (size_t u = 0; u < units.size(); ++u)
      m.units.push_back(r.unit(units[u], Reader::at("units", u)));
  }
  // Which file holds which slice (sharded); written for every checkpoint.
  const YAML::Node ranks = r.sequence(root, "", "shard_ranks");
  if (ranks.size() != static_cast<size_t>(m.world_size)) {
    r.fail("shard_ranks", "has " + std::to_string(ranks.size()) + " entries for world_size " +
                              std::to_string(m.world_size));
  }
  for (size_t i = 0; i < ranks.size(); ++i) {
    const int64_t s = r.scalar<int64_t>(ranks[i], Reader::at("shard_ranks", i));
    if (s < 0 || s >= m.world_size) r.fail(Reader::at("shard_ranks", i), "not a rank");
    m.shard_ranks.push_back(s);
  }
  // Tensor parallelism: absent without it.
  const YAML::Node tp = root["tp"];
  if (tp.IsDefined() && !tp.IsNull()) {
    m.tp = static_cast<int>(r.integer(root, "", "tp", 1, m.world_size));
    const YAML::Node tp_ranks = r.sequence(root, "", "tp_ranks");
    if (tp_ranks.size() != static_cast<size_t>(m.world_size)) {
      r.fail("tp_ranks", "has " + std::to_string(tp_ranks.size()) + " entries for world_size " +
                             std::to_string(m.world_size));
    }
    for (size_t i = 0; i < tp_ranks.size(); ++i) {
      const int64_t t = r.scalar<int64_t>(tp_ranks[i], Reader::at("tp_ranks", i));
      if (t < 0 || t >= m.tp) r.fail(Reader::at("tp_ranks", i), "not a tp rank");
      m.tp_ranks.push_back(t);
    }
  }
  const YAML::Node trainer = r.field(root, "", "trainer");
  m.step = r.integer(trainer, "trainer", "step", 0, kMost);
  m.skipped_steps = r.integer(trainer, "trainer", "skipped_steps", 0, kMost);
  m.lr = r.get<double>(trainer, "trainer", "lr");
  if (!std::isfinite(m.lr)) r.fail("trainer.lr", "must be a finite number");
  if (trainer["consecutive_skips"]) {
    m.consecutive_skips = r.integer(trainer, "trainer", "consecutive_skips", 0, kMost);
  }
  if (trainer["nonfinite_run"])
    m.nonfinite_run = r.integer(trainer, "trainer", "nonfinite_run", 0, kMost);
  if (trainer["spike_guard"]) {
    const std::string at = "trainer.spike_guard";
    const YAML::Node g = r.field(trainer, "trainer", "spike_guard");
    SpikeRecord& sp = m.spike;
    const YAML::Node history = r.sequence(g, at, "history");
    for (size_t i = 0; i < history.size(); ++i) {
      const std::string path = Reader::at(at + ".history", i);
      if (!history[i].IsSequence() || history[i].size() != 2) r.fail(path, "expected [step, loss]");
      const int64_t step = r.scalar<int64_t>(history[i][0], path);
      const double loss = r.scalar<double>(history[i][1], path);
      if (step < 1 || step > m.step || !std::isfinite(loss)) {
        r.fail(path, "not a step of this checkpoint with a finite loss");
      }
      sp.history.emplace_back(step, loss);
    }
    sp.streak = r.integer(g, at, "streak", 0, m.step);
    sp.streak_start = r.integer(g, at, "streak_start", 0, m.step);
    const YAML::Node skipped = r.sequence(g, at, "skipped_batches");
    for (size_t i = 0; i < skipped.size(); ++i) {
      const int64_t d = r.scalar<int64_t>(skipped[i], Reader::at(at + ".skipped_batches", i));
      if (d < 0 || (!sp.skipped_batches.empty() && d <= sp.skipped_batches.back())) {
        r.fail(Reader::at(at + ".skipped_batches", i), "expected ascending data steps");
      }
      sp.skipped_batches.push_back(d);
    }
    const YAML::Node spikes = r.sequence(g, at, "spikes");
    for (size_t i = 0; i < spikes.size(); ++i) {
      const std::string path = Reader::at(at + ".spikes", i);
      if (!spikes[i].IsSequence() || spikes[i].size() != 2) r.fail(path, "expected [first, last]");
      const int64_t first = r.scalar<int64_t>(spikes[i][0], path);
      const int64_t last = r.scalar<int64_t>(spikes[i][1], path);
      if (first < 1 || last < first) r.fail(path, "not a range of steps");
      sp.spikes.emplace_back(first, last);
    }
  }
  if (trainer["data_position"]) {
    const std::string at = "trainer.data_position";
    const YAML::Node d = r.field(trainer, "trainer", "data_position");
    DataPosition pos;
    m.data_step = r.integer(d, at, "data_step", 0, kMost);
    pos.epoch = r.integer(d, at, "epoch", 0, kMost);
    pos.position = r.integer(d, at, "position", 0, kMost);
    m.data = pos;
  }
  const YAML::Node job = root["job"];
  if (job.IsDefined() && !job.IsNull()) {
    if (!job.IsMap()) r.fail("job", "expected a mapping");
    for (const auto& kv : job) {
      const std::string key = r.scalar<std::string>(kv.first, "job");
      m.job[key] = r.scalar<std::string>(kv.second, Reader::join("job", key));
    }
  }
  return m;
}

std::string write_meta(const Meta& m) {
  std::ostringstream o;
  o << "{\"format\": " << json::quote(kFormat) << ", \"version\": " << kVersion
    << ", \"step\": " << m.step << ", \"world_size\": " << m.world_size
    << ", \"strategy\": " << json::quote(m.strategy) << ", \"mode\": " << json::quote(m.mode)
    << ",\n \"trainer\": {\"step\": " << m.step << ", \"skipped_steps\": " << m.skipped_steps
    << ", \"lr\": " << number(m.lr) << ", \"consecutive_skips\": " << m.consecutive_skips
    << ", \"nonfinite_run\": " << m.nonfinite_run << ", \"spike_guard\": " << spike_json(m.spike)
    << ", \"data\": "
    << (m.data ? "\"a function of the step and data_position\"" : "\"a function of the step\"");
  if (m.data) {
    o << ", \"data_position\": {\"data_step\": " << m.data_step << ", \"epoch\": " << m.data->epoch
      << ", \"position\": " << m.data->position << "}";
  }
  o << "},\n \"parameters\": [";
  for (size_t i = 0; i < m.parameters.size(); ++i) {
    const ParamMeta& p = m.parameters[i];
    o << (i ? ", " : "") << "{\"name\": " << json::quote(p.name) << ", \"shape\": " << ints(p.shape)
      << ", \"dtype\": " << json::quote(p.dtype) << "}";
  }
  o << "],\n \"optimizer_keys\": [";
  for (size_t k = 0; k < m.optimizer_keys.size(); ++k) {
    o << (k ? ", " : "") << json::quote(m.optimizer_keys[k]);
  }
  o << "],\n";
  if (m.mode == "sharded") {
    o << " \"units\": [";
    for (size_t u = 0; u < m.units.size(); ++u) {
      const UnitMeta& l = m.units[u];
      o << (u ? ",\n  " : "") << "{\"name\": " << json::quote(l.name)
        << ", \"layout\": " << json::quote(l.layout) << ", \"numel\": " << l.numel
        << ", \"shard_size\": " << l.shard_size << ", \"shard_group_size\": " << l.shard_group_size
        << ", \"params\": [";
      for (size_t i = 0; i < l.params.size(); ++i) {
        const UnitParamMeta& e = l.params[i];
        o << (i ? ", " : "") << "{\"name\": " << json::quote(e.name)
          << ", \"shape\": " << ints(e.shape) << ", \"offset\": " << e.offset
          << ", \"numel\": " << e.numel;
        if (l.layout == "per_parameter") {
          o << ", \"chunk\": " << e.chunk << ", \"shard_at\": " << e.shard_at;
        }
        if (e.tp_dim >= 0) o << ", \"tp_dim\": " << e.tp_dim;
        o << "}";
      }
      o << "]}";
    }
    o << "],\n";
  }
  if (!m.job.empty()) {
    o << " \"job\": {";
    size_t k = 0;
    for (const auto& [key, value] : m.job) {
      o << (k++ ? ",\n  " : "") << json::quote(key) << ": " << json::quote(value);
    }
    o << "},\n";
  }
  if (m.tp > 1) o << " \"tp\": " << m.tp << ", \"tp_ranks\": " << ints(m.tp_ranks) << ",\n";
  o << " \"shard_ranks\": " << ints(m.shard_ranks) << ",\n \"files\": [";
  size_t i = 0;
  for (const auto& [name, f] : m.files) o << (i++ ? ",\n  " : "") << file_json(f);
  o << "]}\n";
  return o.str();
}

std::string write_complete(const FileInfo& meta) { return "{\"meta\": " + file_json(meta) + "}\n"; }

Meta read_meta(const std::string& dir) {
  const std::vector<char> complete = read_raw(dir + "/COMPLETE");
  const FileInfo info = parse_complete(std::string(complete.begin(), complete.end()),
                                       "checkpoint '" + dir + "': COMPLETE");
  const std::vector<char> meta = read_file(dir, info);
  return parse_meta(std::string(meta.begin(), meta.end()), "checkpoint '" + dir + "': meta.json");
}

}  // namespace dtrain::framework::ckpt
