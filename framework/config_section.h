// ConfigSection: one mapping of a YAML config being read, with the checks and messages every
// section of a dtrain config shares. A registered model (framework/model_registry.h) reads its
// `model:` keys through one, so its errors look like the built-in sections':
//   configs/x.yaml:5: model.n_layer: unknown key; did you mean 'n_layers'? (keys under model: ...)
//   --set model.d_model=0: model.d_model: must be >= 1, got 0
// It records which keys were read; finish() refuses the rest, suggesting the nearest known key.
// The YAML library stays behind it (no yaml-cpp header is needed to use one).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/choices.h"

namespace dtrain::framework {

class ConfigSection {
 public:
  struct Impl;  // framework/config.cc
  explicit ConfigSection(std::unique_ptr<Impl> impl);
  ConfigSection(ConfigSection&&) noexcept;
  ConfigSection& operator=(ConfigSection&&) noexcept;
  ~ConfigSection();

  // The dotted path of `key` in this section ("model.d_model").
  std::string key_path(const std::string& key) const;
  // Whether `key` is present and not null; a mapping.
  bool has(const std::string& key) const;
  bool has_map(const std::string& key) const;
  // The nested section `key` (an empty one when absent); marks `key` read.
  ConfigSection section(const std::string& key);

  // Reads `key` into `out` when present (ConfigError when `required` and absent, or when the
  // value is not a T). T: bool, int64_t, double or std::string.
  template <typename T>
  void read(const std::string& key, T& out, bool required = false);
  // Whether `key` holds exactly the word `word` (e.g. "auto" where a number may stand); marks
  // `key` read.
  bool is_word(const std::string& key, const std::string& word);
  // A list of strings: a YAML sequence of scalars, or one scalar.
  void read_list(const std::string& key, std::vector<std::string>& out);
  // An enum with named choices (core/choices.h): its names are the only ones accepted.
  template <typename E>
  void read_choice(const std::string& key, E& out, bool required = false) {
    std::string name = name_of(out);
    read(key, name, required);
    const std::optional<E> v = choice_from_name<E>(name);
    if (!v) fail(key, "expected one of " + choice_list<E>() + ", got '" + name + "'");
    out = *v;
  }

  // ConfigError "<where>: <section>.<key>: <msg>", where is the key's file:line or --set.
  [[noreturn]] void fail(const std::string& key, const std::string& msg) const;
  void check(bool ok, const std::string& key, const std::string& msg) const {
    if (!ok) fail(key, msg);
  }
  // Marks `key` as one this section knows without reading it (a key another reader owns).
  void allow(const std::string& key);
  // Refuses every key not read or allowed, suggesting the nearest known one.
  void finish() const;

 private:
  std::unique_ptr<Impl> impl_;
};

extern template void ConfigSection::read<bool>(const std::string&, bool&, bool);
extern template void ConfigSection::read<int64_t>(const std::string&, int64_t&, bool);
extern template void ConfigSection::read<double>(const std::string&, double&, bool);
extern template void ConfigSection::read<std::string>(const std::string&, std::string&, bool);

// The known name nearest to `name` (at most two edits away), or "" (for "did you mean").
std::string nearest_name(const std::string& name, const std::vector<std::string>& known);

}  // namespace dtrain::framework
