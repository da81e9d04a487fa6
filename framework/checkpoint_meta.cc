#include "framework/checkpoint_meta.h"

#include <yaml-cpp/yaml.h>

#include <climits>
#include <cmath>
#include <limits>

#include "core/error.h"

namespace dtrain::framework::ckpt {
namespace {

constexpr const char* kFormat = "dtrain-checkpoint";
constexpr int kVersion = 1;

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
  m.mode = r.text(root, "", "mode");
  if (m.mode != "full" && m.mode != "sharded") {
    r.fail("mode", "'" + m.mode + "' is neither full nor sharded");
  }
  m.world_size = static_cast<int>(r.integer(root, "", "world_size", 1, INT_MAX));
  const YAML::Node keys = r.sequence(root, "", "optimizer_keys");
  for (size_t i = 0; i < keys.size(); ++i) {
    m.optimizer_keys.push_back(r.scalar<std::string>(keys[i], Reader::at("optimizer_keys", i)));
  }
  if (m.mode == "sharded") {
    const YAML::Node units = r.sequence(root, "", "units");
    for (size_t u = 0; u < units.size(); ++u) {
      const std::string path = Reader::at("units", u);
      UnitMeta unit;
      // Positions in the flat buffer are divided by it (which shard file holds them).
      unit.shard_size =
          r.integer(units[u], path, "shard_size", 1, std::numeric_limits<int64_t>::max());
      const YAML::Node ps = r.sequence(units[u], path, "params");
      for (size_t i = 0; i < ps.size(); ++i) {
        const std::string ppath = Reader::at(path + ".params", i);
        UnitParamMeta param;
        param.name = r.text(ps[i], ppath, "name");
        const YAML::Node shape = r.sequence(ps[i], ppath, "shape");
        for (size_t d = 0; d < shape.size(); ++d) {
          const int64_t n = r.scalar<int64_t>(shape[d], Reader::at(ppath + ".shape", d));
          if (n < 0) r.fail(Reader::at(ppath + ".shape", d), "a size cannot be negative");
          param.shape.push_back(n);
        }
        unit.params.push_back(std::move(param));
      }
      m.units.push_back(std::move(unit));
    }
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
  }
  const YAML::Node trainer = r.field(root, "", "trainer");
  m.step = r.integer(trainer, "trainer", "step", 0, std::numeric_limits<int64_t>::max());
  m.skipped_steps =
      r.integer(trainer, "trainer", "skipped_steps", 0, std::numeric_limits<int64_t>::max());
  m.lr = r.get<double>(trainer, "trainer", "lr");
  if (!std::isfinite(m.lr)) r.fail("trainer.lr", "must be a finite number");
  const int64_t most = std::numeric_limits<int64_t>::max();
  if (trainer["consecutive_skips"]) {
    m.consecutive_skips = r.integer(trainer, "trainer", "consecutive_skips", 0, most);
  }
  if (trainer["nonfinite_run"])
    m.nonfinite_run = r.integer(trainer, "trainer", "nonfinite_run", 0, most);
  return m;
}

Meta read_meta(const std::string& dir) {
  const std::vector<char> complete = read_raw(dir + "/COMPLETE");
  const FileInfo info = parse_complete(std::string(complete.begin(), complete.end()),
                                       "checkpoint '" + dir + "': COMPLETE");
  const std::vector<char> meta = read_file(dir, info);
  return parse_meta(std::string(meta.begin(), meta.end()), "checkpoint '" + dir + "': meta.json");
}

}  // namespace dtrain::framework::ckpt
