#include "framework/checkpoint/safetensors.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <memory>
#include <set>

#include "core/error.h"
#include "core/json.h"
#include "framework/checkpoint/atomic_file.h"

namespace dtrain::framework::ckpt {
namespace {

constexpr std::array<std::pair<at::ScalarType, const char*>, 12> kDtypes{{
    {at::kFloat, "F32"},
    {at::kHalf, "F16"},
    {at::kBFloat16, "BF16"},
    {at::kDouble, "F64"},
    {at::kLong, "I64"},
    {at::kInt, "I32"},
    {at::kShort, "I16"},
    {at::kChar, "I8"},
    {at::kByte, "U8"},
    {at::kBool, "BOOL"},
    {at::kFloat8_e4m3fn, "F8_E4M3"},
    {at::kFloat8_e5m2, "F8_E5M2"},
}};

// A file mapped privately (copy-on-write), unmapped when the last tensor viewing it goes.
struct Mapping {
  void* base = MAP_FAILED;
  size_t size = 0;
  ~Mapping() {
    if (base != MAP_FAILED) ::munmap(base, size);
  }
};

std::shared_ptr<Mapping> map_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  DTRAIN_CHECK_AS(CheckpointError, fd >= 0, path, ": cannot open: ", std::strerror(errno));
  struct stat st {};
  const bool ok = ::fstat(fd, &st) == 0;
  auto m = std::make_shared<Mapping>();
  m->size = ok ? static_cast<size_t>(st.st_size) : 0;
  if (ok && m->size > 0) {
    m->base = ::mmap(nullptr, m->size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  }
  const int err = errno;
  ::close(fd);
  DTRAIN_CHECK_AS(CheckpointError, ok, path, ": cannot stat: ", std::strerror(err));
  DTRAIN_CHECK_AS(CheckpointError, m->size >= 8, path, ": ", m->size,
                  " bytes, shorter than the 8-byte header length of a safetensors file");
  DTRAIN_CHECK_AS(CheckpointError, m->base != MAP_FAILED, path,
                  ": cannot map: ", std::strerror(err));
  return m;
}

uint64_t read_u64_le(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

}  // namespace

std::string safetensors_dtype(at::ScalarType t) {
  for (const auto& [type, name] : kDtypes) {
    if (type == t) return name;
  }
  DTRAIN_FAIL(CheckpointError, "safetensors has no dtype for ", t);
}

at::ScalarType safetensors_dtype(const std::string& name) {
  for (const auto& [type, n] : kDtypes) {
    if (name == n) return type;
  }
  DTRAIN_FAIL(CheckpointError, "unknown safetensors dtype '", name, "'");
}

SafeTensors read_safetensors(const std::string& path) {
  std::shared_ptr<Mapping> m = map_file(path);
  const auto* bytes = static_cast<const unsigned char*>(m->base);
  const uint64_t n = read_u64_le(bytes);
  DTRAIN_CHECK_AS(CheckpointError, n <= m->size - 8, path, ": the header claims ", n,
                  " bytes but the file has ", m->size - 8,
                  " after its length (truncated, or "
                  "not a safetensors file)");
  YAML::Node header;
  try {
    header = YAML::Load(std::string(reinterpret_cast<const char*>(bytes + 8), n));
  } catch (const YAML::Exception& e) {
    DTRAIN_FAIL(CheckpointError, path, ": the header is not valid JSON: ", e.what());
  }
  DTRAIN_CHECK_AS(CheckpointError, header.IsMap(), path, ": the header is not a JSON object");
  const uint64_t data_at = 8 + n, data_size = m->size - data_at;
  struct Entry {
    std::string name;
    at::ScalarType dtype;
    std::vector<int64_t> shape;
    uint64_t begin, end;
  };
  std::vector<Entry> entries;
  SafeTensors out;
  for (const auto& kv : header) {
    const std::string name = kv.first.as<std::string>();
    const YAML::Node& v = kv.second;
    if (name == "__metadata__") {
      DTRAIN_CHECK_AS(CheckpointError, v.IsMap(), path, ": __metadata__ is not an object");
      for (const auto& md : v)
        out.metadata[md.first.as<std::string>()] = md.second.as<std::string>();
      continue;
    }
    try {
      DTRAIN_CHECK_AS(CheckpointError, v.IsMap() && v["dtype"] && v["shape"] && v["data_offsets"],
                      "needs dtype, shape and data_offsets");
      Entry e{name, safetensors_dtype(v["dtype"].as<std::string>()), {}, 0, 0};
      for (const auto& d : v["shape"]) {
        const int64_t dim = d.as<int64_t>();
        DTRAIN_CHECK_AS(CheckpointError, dim >= 0, "negative dimension ", dim);
        e.shape.push_back(dim);
      }
      const YAML::Node& off = v["data_offsets"];
      DTRAIN_CHECK_AS(CheckpointError, off.IsSequence() && off.size() == 2,
                      "data_offsets must be [begin, end]");
      e.begin = off[0].as<uint64_t>();
      e.end = off[1].as<uint64_t>();
      entries.push_back(std::move(e));
    } catch (const YAML::Exception& ex) {
      DTRAIN_FAIL(CheckpointError, path, ": tensor '", name, "': ", ex.what());
    } catch (const CheckpointError& ex) {
      DTRAIN_FAIL(CheckpointError, path, ": tensor '", name, "': ", ex.what());
    }
  }
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;  // empty ones first
  });
  uint64_t expected_begin = 0;
  for (const Entry& e : entries) {
    const uint64_t elsize = c10::elementSize(e.dtype);
    uint64_t count = 1;
    for (int64_t d : e.shape) count *= static_cast<uint64_t>(d);
    DTRAIN_CHECK_AS(CheckpointError, e.begin <= e.end && e.end <= data_size, path, ": tensor '",
                    e.name, "': data_offsets [", e.begin, ", ", e.end, "] outside the ", data_size,
                    " bytes of data (truncated file?)");
    DTRAIN_CHECK_AS(CheckpointError, e.end - e.begin == count * elsize, path, ": tensor '", e.name,
                    "': ", e.end - e.begin, " bytes for shape of ", count, " ",
                    safetensors_dtype(e.dtype), " elements (", count * elsize, " bytes)");
    DTRAIN_CHECK_AS(CheckpointError, e.begin == expected_begin, path, ": tensor '", e.name,
                    "' starts at byte ", e.begin, " of the data, not ", expected_begin,
                    " (overlapping tensors or a gap)");
    expected_begin = e.end;
    char* at = static_cast<char*>(m->base) + data_at + e.begin;
    at::Tensor t;
    if (count == 0) {
      t = at::empty(e.shape, at::TensorOptions().dtype(e.dtype));
    } else {
      std::shared_ptr<Mapping> keep = m;
      t = at::from_blob(
          at, e.shape, [keep](void*) mutable { keep.reset(); }, at::TensorOptions().dtype(e.dtype));
      if (reinterpret_cast<uintptr_t>(at) % elsize != 0) t = t.clone();  // misaligned
    }
    out.tensors.emplace_back(e.name, std::move(t));
  }
  DTRAIN_CHECK_AS(CheckpointError, expected_begin == data_size, path, ": ",
                  data_size - expected_begin, " bytes after the last tensor's data");
  return out;
}

SafeTensors read_safetensors_dir(const std::string& dir) {
  const std::string index = dir + "/model.safetensors.index.json";
  if (::access(index.c_str(), F_OK) != 0) return read_safetensors(dir + "/model.safetensors");
  YAML::Node root;
  try {
    root = YAML::LoadFile(index);
  } catch (const YAML::Exception& e) {
    DTRAIN_FAIL(CheckpointError, index, ": not valid JSON: ", e.what());
  }
  DTRAIN_CHECK_AS(CheckpointError, root.IsMap() && root["weight_map"] && root["weight_map"].IsMap(),
                  index, ": no weight_map object");
  std::map<std::string, std::string> want;  // tensor -> shard
  std::set<std::string> shards;
  for (const auto& kv : root["weight_map"]) {
    want[kv.first.as<std::string>()] = kv.second.as<std::string>();
    shards.insert(kv.second.as<std::string>());
  }
  SafeTensors out;
  if (root["metadata"] && root["metadata"].IsMap()) {
    for (const auto& kv : root["metadata"]) {
      out.metadata[kv.first.as<std::string>()] = kv.second.as<std::string>();
    }
  }
  std::set<std::string> found;
  for (const std::string& shard : shards) {
    DTRAIN_CHECK_AS(CheckpointError, shard.find('/') == std::string::npos, index, ": shard '",
                    shard, "' is not a file name in ", dir);
    SafeTensors part = read_safetensors(dir + "/" + shard);
    for (auto& [name, t] : part.tensors) {
      auto it = want.find(name);
      DTRAIN_CHECK_AS(CheckpointError, it != want.end() && it->second == shard, dir, "/", shard,
                      ": holds tensor '", name, "', which ", index,
                      it == want.end() ? " does not list" : " places in " + it->second);
      found.insert(name);
      out.tensors.emplace_back(name, std::move(t));
    }
  }
  for (const auto& [name, shard] : want) {
    DTRAIN_CHECK_AS(CheckpointError, found.count(name) == 1, index, ": tensor '", name,
                    "' is not in ", shard);
  }
  return out;
}

void write_safetensors(const std::string& path,
                       const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  // Largest elements first, then by name: every tensor starts aligned to its element size.
  std::vector<size_t> order(tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const size_t ea = tensors[a].second.element_size(), eb = tensors[b].second.element_size();
    return ea != eb ? ea > eb : tensors[a].first < tensors[b].first;
  });
  std::set<std::string> names;
  std::vector<at::Tensor> data;
  std::string header = "{";
  if (!metadata.empty()) {
    header += "\"__metadata__\":{";
    bool first = true;
    for (const auto& [k, v] : metadata) {
      header += (first ? "" : ",") + json::quote(k) + ":" + json::quote(v);
      first = false;
    }
    header += "}";
  }
  uint64_t offset = 0;
  for (size_t i : order) {
    const auto& [name, t] = tensors[i];
    DTRAIN_CHECK_AS(CheckpointError, name != "__metadata__" && names.insert(name).second, path,
                    ": tensor name '", name, "' is reserved or given twice");
    at::Tensor c = t.detach().cpu().contiguous();
    const uint64_t n = c.nbytes();
    header += (header.size() > 1 ? "," : "") + json::quote(name) + ":{\"dtype\":\"" +
              safetensors_dtype(c.scalar_type()) + "\",\"shape\":[";
    for (int64_t d = 0; d < c.dim(); ++d) header += (d ? "," : "") + std::to_string(c.size(d));
    header +=
        "],\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(offset + n) + "]}";
    offset += n;
    data.push_back(std::move(c));
  }
  header += "}";
  header.append((8 - header.size() % 8) % 8, ' ');
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash);
  const std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  PendingFile f(dir, name);
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(header.size() >> (8 * i));
  f.append(reinterpret_cast<const char*>(len), 8);
  f.append(header.data(), header.size());
  for (const at::Tensor& c : data) {
    if (c.nbytes() > 0) f.append(static_cast<const char*>(c.data_ptr()), c.nbytes());
  }
  f.commit();
}

}  // namespace dtrain::framework::ckpt
