#include "framework/checkpoint_meta.h"

#include <yaml-cpp/yaml.h>

#include "core/error.h"

namespace dtrain::framework::ckpt {
namespace {

constexpr const char* kFormat = "dtrain-checkpoint";

FileInfo file_of(const YAML::Node& n) {
  return {n["name"].as<std::string>(), n["bytes"].as<uint64_t>(),
          std::stoull(n["xxh64"].as<std::string>(), nullptr, 16)};
}

YAML::Node load(const std::string& text, const std::string& where) {
  try {
    return YAML::Load(text);
  } catch (const YAML::Exception& e) {
    DTRAIN_FAIL(CheckpointError, where, " is not valid (", e.what(), ")");
  }
}

}  // namespace

FileInfo parse_complete(const std::string& text, const std::string& where) {
  return file_of(load(text, where)["meta"]);
}

Meta parse_meta(const std::string& text, const std::string& where) {
  YAML::Node meta = load(text, where);
  DTRAIN_CHECK_AS(CheckpointError, meta["format"].as<std::string>("") == kFormat, where,
                  " is not a dtrain checkpoint's");
  Meta m;
  for (const auto& f : meta["files"]) m.files[f["name"].as<std::string>()] = file_of(f);
  m.mode = meta["mode"].as<std::string>();
  m.world_size = meta["world_size"].as<int>();
  for (const auto& k : meta["optimizer_keys"]) m.optimizer_keys.push_back(k.as<std::string>());
  if (m.mode != "full") {
    const YAML::Node units = meta["units"];
    for (size_t u = 0; u < units.size(); ++u) {
      UnitMeta unit;
      unit.shard_size = units[u]["shard_size"].as<int64_t>();
      const YAML::Node ps = units[u]["params"];
      for (size_t i = 0; i < ps.size(); ++i) {
        unit.params.push_back(
            {ps[i]["name"].as<std::string>(), ps[i]["shape"].as<std::vector<int64_t>>()});
      }
      m.units.push_back(std::move(unit));
    }
    m.shard_ranks = meta["shard_ranks"].as<std::vector<int64_t>>();
  }
  m.step = meta["trainer"]["step"].as<int64_t>();
  m.skipped_steps = meta["trainer"]["skipped_steps"].as<int64_t>();
  m.lr = meta["trainer"]["lr"].as<double>();
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
