#include "framework/checkpoint_io.h"

#include <caffe2/serialize/in_memory_adapter.h>
#include <caffe2/serialize/inline_container.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <set>

#include "core/error.h"
#include "core/faults.h"

namespace dtrain::framework::ckpt {
namespace {

std::string errno_text(int e) {
  std::string why = std::strerror(e);
  if (e == ENOSPC || e == EFBIG || e == EDQUOT) {
    why += " (the disk is full, or a file-size limit was reached)";
  }
  return why;
}

void write_all(int fd, const char* data, size_t n, const std::string& path) {
  while (n > 0) {
    ssize_t w = ::write(fd, data, n);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) {
      const int e = errno;
      DTRAIN_FAIL(CheckpointError, "checkpoint: writing '", path, "' failed: ", errno_text(e));
    }
    data += w;
    n -= static_cast<size_t>(w);
  }
}

// A pickle of `value` that Python's restricted unpickler accepts: no type tags, and no
// specialized int/float/bool lists (torch.jit._pickle.build_* globals).
c10::IValue plain(const c10::IValue& v) {
  if (v.isIntList() || v.isDoubleList() || v.isBoolList()) {
    c10::impl::GenericList out(c10::AnyType::get());
    for (const auto& x : v.toListRef()) out.push_back(x);
    return out;
  }
  if (v.isTensorList() || v.isList()) {
    c10::impl::GenericList out(c10::AnyType::get());
    for (const auto& x : v.toListRef()) out.push_back(plain(x));
    return out;
  }
  if (v.isGenericDict()) {
    c10::impl::GenericDict out(c10::AnyType::get(), c10::AnyType::get());
    for (const auto& kv : v.toGenericDict()) out.insert(kv.key(), plain(kv.value()));
    return out;
  }
  if (v.isTuple()) {
    std::vector<c10::IValue> items;
    for (const auto& x : v.toTupleRef().elements()) items.push_back(plain(x));
    return c10::ivalue::Tuple::create(std::move(items));
  }
  return v;
}

}  // namespace

namespace {

constexpr uint64_t kP1 = 0x9E3779B185EBCA87ull, kP2 = 0xC2B2AE3D27D4EB4Full,
                   kP3 = 0x165667B19E3779F9ull, kP4 = 0x85EBCA77C2B2AE63ull,
                   kP5 = 0x27D4EB2F165667C5ull;

uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
uint64_t read64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}
uint64_t round64(uint64_t acc, uint64_t input) { return rotl(acc + input * kP2, 31) * kP1; }
uint64_t merge(uint64_t acc, uint64_t v) { return (acc ^ round64(0, v)) * kP1 + kP4; }

}  // namespace

Hasher::Hasher() : v_{kP1 + kP2, kP2, 0, 0 - kP1} {}

void Hasher::update(const char* data, size_t n) {
  const auto* p = reinterpret_cast<const unsigned char*>(data);
  total_ += n;
  if (buffered_ + n < 32) {
    std::memcpy(buffer_ + buffered_, p, n);
    buffered_ += n;
    return;
  }
  if (buffered_ > 0) {
    const size_t fill = 32 - buffered_;
    std::memcpy(buffer_ + buffered_, p, fill);
    for (int i = 0; i < 4; ++i) v_[i] = round64(v_[i], read64(buffer_ + 8 * i));
    p += fill;
    n -= fill;
    buffered_ = 0;
  }
  while (n >= 32) {
    for (int i = 0; i < 4; ++i) v_[i] = round64(v_[i], read64(p + 8 * i));
    p += 32;
    n -= 32;
  }
  std::memcpy(buffer_, p, n);
  buffered_ = n;
}

uint64_t Hasher::digest() const {
  uint64_t h;
  if (total_ >= 32) {
    h = rotl(v_[0], 1) + rotl(v_[1], 7) + rotl(v_[2], 12) + rotl(v_[3], 18);
    for (int i = 0; i < 4; ++i) h = merge(h, v_[i]);
  } else {
    h = v_[2] + kP5;  // the seed (0) + P5
  }
  h += total_;
  const unsigned char* p = buffer_;
  size_t n = buffered_;
  for (; n >= 8; p += 8, n -= 8) h = rotl(h ^ round64(0, read64(p)), 27) * kP1 + kP4;
  if (n >= 4) {
    uint32_t k;
    std::memcpy(&k, p, 4);
    h = rotl(h ^ (static_cast<uint64_t>(k) * kP1), 23) * kP2 + kP3;
    p += 4;
    n -= 4;
  }
  for (; n > 0; ++p, --n) h = rotl(h ^ (*p * kP5), 11) * kP1;
  h ^= h >> 33;
  h *= kP2;
  h ^= h >> 29;
  h *= kP3;
  h ^= h >> 32;
  return h;
}

uint64_t checksum(const char* data, size_t n) {
  Hasher h;
  h.update(data, n);
  return h.digest();
}

std::string hex(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

void sync_dir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;  // nothing to make durable
  ::fsync(fd);
  ::close(fd);
}

namespace {

// A file being written under a temporary name, with its running size and checksum.
class PendingFile {
 public:
  PendingFile(std::string dir, std::string name)
      : dir_(std::move(dir)),
        name_(std::move(name)),
        path_(dir_ + "/" + name_),
        tmp_(path_ + ".tmp." + std::to_string(::getpid())) {
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) {
      const int e = errno;
      DTRAIN_FAIL(CheckpointError, "checkpoint: cannot create '", tmp_, "': ", errno_text(e));
    }
  }
  ~PendingFile() {
    if (fd_ >= 0) {  // an exception: leave nothing behind
      ::close(fd_);
      ::unlink(tmp_.c_str());
    }
  }
  PendingFile(const PendingFile&) = delete;
  PendingFile& operator=(const PendingFile&) = delete;

  void append(const char* data, size_t n) {
    hash_.update(data, n);
    write_all(fd_, data, n, tmp_);
    bytes_ += n;
#ifdef __linux__
    // Start writeback every 16 MiB, so the fsync at the end waits for little.
    constexpr uint64_t kChunk = uint64_t{16} << 20;
    if (bytes_ - flushed_ >= kChunk) {
      ::sync_file_range(fd_, static_cast<off_t>(flushed_), static_cast<off_t>(bytes_ - flushed_),
                        SYNC_FILE_RANGE_WRITE);
      flushed_ = bytes_;
    }
#endif
  }

  // fsync, rename into place, fsync the directory.
  FileInfo commit() {
    if (::fsync(fd_) != 0 || ::close(fd_) != 0) {
      const int e = errno;
      fd_ = -1;
      ::unlink(tmp_.c_str());
      DTRAIN_FAIL(CheckpointError, "checkpoint: syncing '", tmp_, "' failed: ", errno_text(e));
    }
    fd_ = -1;
    if (std::optional<std::string> crash = faults::text("CRASH_BEFORE_RENAME")) {
      const std::string last = dir_.substr(dir_.find_last_of('/') + 1) + "/" + name_;
      if (name_ == *crash || last == *crash) ::raise(SIGKILL);
    }
    if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
      const int e = errno;
      ::unlink(tmp_.c_str());
      DTRAIN_FAIL(CheckpointError, "checkpoint: renaming '", tmp_, "' to '", path_,
                  "' failed: ", errno_text(e));
    }
    sync_dir(dir_);
    return {name_, bytes_, hash_.digest()};
  }

 private:
  std::string dir_, name_, path_, tmp_;
  int fd_ = -1;
  uint64_t bytes_ = 0, flushed_ = 0;
  Hasher hash_;
};

}  // namespace

FileInfo write_file(const std::string& dir, const std::string& name,
                    const std::vector<char>& bytes) {
  PendingFile f(dir, name);
  f.append(bytes.data(), bytes.size());
  return f.commit();
}

std::vector<char> read_raw(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int e = errno;
    DTRAIN_FAIL(CheckpointError, "checkpoint: cannot read '", path, "': ", std::strerror(e));
  }
  struct stat st {};
  ::fstat(fd, &st);
  std::vector<char> bytes(static_cast<size_t>(st.st_size));
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t r = ::read(fd, bytes.data() + done, bytes.size() - done);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;  // a file that shrank: the size check reports it
    done += static_cast<size_t>(r);
  }
  ::close(fd);
  bytes.resize(done);
  return bytes;
}

std::vector<char> read_file(const std::string& dir, const FileInfo& expected) {
  const std::string path = dir + "/" + expected.name;
  std::vector<char> bytes = read_raw(path);
  DTRAIN_CHECK_AS(CheckpointError, bytes.size() == expected.bytes, "checkpoint: '", path, "' has ",
                  bytes.size(), " bytes but was written with ", expected.bytes,
                  " (truncated or replaced); this checkpoint cannot be trusted");
  const uint64_t sum = checksum(bytes.data(), bytes.size());
  DTRAIN_CHECK_AS(CheckpointError, sum == expected.checksum, "checkpoint: '", path,
                  "' fails its checksum (xxh64 ", hex(sum), ", written as ", hex(expected.checksum),
                  "): the file is corrupt; this checkpoint cannot be trusted");
  return bytes;
}

namespace {

// torch.save's zip of `value` (data.pkl and one record per tensor), streamed to `sink`.
void write_archive(const c10::IValue& value,
                   const std::function<size_t(const void*, size_t)>& sink) {
  std::vector<char> data;
  torch::jit::Pickler pickler(
      [&](const char* buf, size_t n) { data.insert(data.end(), buf, buf + n); },
      /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
      /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(plain(value));
  pickler.stop();
  caffe2::serialize::PyTorchStreamWriter writer(sink);
  torch::jit::writeArchiveAndTensors("data", data.data(), data.size(), pickler.tensorData(),
                                     writer);
  writer.writeEndOfFile();
}

}  // namespace

FileInfo write_pickle(const std::string& dir, const std::string& name, const c10::IValue& value) {
  PendingFile f(dir, name);
  // The zip goes straight to the file: tensors are never copied into a buffer. A failed
  // write (a full disk) must not throw through miniz, whose writer would then throw again
  // from its destructor: it is kept, the rest of the archive is dropped, and it is thrown
  // once the writer is done.
  std::exception_ptr failed;
  write_archive(value, [&](const void* p, size_t n) {
    if (failed) return n;
    try {
      f.append(static_cast<const char*>(p), n);
    } catch (...) {
      failed = std::current_exception();
    }
    return n;
  });
  if (failed) std::rethrow_exception(failed);
  return f.commit();
}

std::vector<char> pickle(const c10::IValue& value) {
  std::vector<char> out;
  write_archive(value, [&](const void* p, size_t n) {
    const char* b = static_cast<const char*>(p);
    out.insert(out.end(), b, b + n);
    return n;
  });
  return out;
}

namespace {

// The subset of Python's pickle protocol 2 that torch.save writes for state dicts, optimizer
// states and tensors (and dtrain's pickle() above): containers, numbers, strings, tensors by
// persistent id, collections.OrderedDict (as a dict; its _metadata attribute is dropped).
// LibTorch's own unpickler turns an OrderedDict into None, so a state_dict() saved from
// Python would not load.
class MiniUnpickler {
 public:
  MiniUnpickler(const std::vector<char>& pickle,
                std::function<at::Tensor(const std::string& key, c10::ScalarType)> storage)
      : data_(pickle), storage_(std::move(storage)) {}

  c10::IValue run() {
    while (true) {
      const unsigned char op = byte();
      switch (op) {
        case 0x80:  // PROTO
          byte();
          break;
        case '.':  // STOP
          return pop();
        case '(':  // MARK
          marks_.push_back(stack_.size());
          break;
        case ')':
          stack_.push_back(c10::ivalue::Tuple::create({}));
          break;
        case '}':
          stack_.push_back(dict());
          break;
        case ']':
          stack_.push_back(c10::impl::GenericList(c10::AnyType::get()));
          break;
        case 'N':
          stack_.push_back(c10::IValue());
          break;
        case 0x88:
          stack_.push_back(true);
          break;
        case 0x89:
          stack_.push_back(false);
          break;
        case 'K':
          stack_.push_back(static_cast<int64_t>(byte()));
          break;
        case 'M':
          stack_.push_back(static_cast<int64_t>(le<uint16_t>()));
          break;
        case 'J':
          stack_.push_back(static_cast<int64_t>(static_cast<int32_t>(le<uint32_t>())));
          break;
        case 0x8a: {  // LONG1: little-endian two's complement of n bytes
          const int n = byte();
          uint64_t v = 0;
          for (int i = 0; i < n; ++i) v |= static_cast<uint64_t>(byte()) << (8 * i);
          int64_t sv = static_cast<int64_t>(v);
          if (n > 0 && n < 8 && ((v >> (8 * n - 1)) & 1)) sv -= int64_t{1} << (8 * n);
          stack_.push_back(sv);
          break;
        }
        case 'G': {  // BINFLOAT: big-endian double
          uint64_t bits = 0;
          for (int i = 0; i < 8; ++i) bits = (bits << 8) | byte();
          double d;
          std::memcpy(&d, &bits, 8);
          stack_.push_back(d);
          break;
        }
        case 'X':
          stack_.push_back(text(le<uint32_t>()));
          break;
        case 0x8c:  // SHORT_BINUNICODE
          stack_.push_back(text(byte()));
          break;
        case 'q':
          memo_[byte()] = stack_.back();
          break;
        case 'r':
          memo_[le<uint32_t>()] = stack_.back();
          break;
        case 'h':
          stack_.push_back(memo_.at(byte()));
          break;
        case 'j':
          stack_.push_back(memo_.at(le<uint32_t>()));
          break;
        case 0x85:
          tuple_of(1);
          break;
        case 0x86:
          tuple_of(2);
          break;
        case 0x87:
          tuple_of(3);
          break;
        case 't':
          tuple_of(stack_.size() - pop_mark());
          break;
        case 'c': {  // GLOBAL "module\nname\n", kept as its dotted name
          const std::string module = line(), name = line();
          stack_.push_back(c10::IValue(module + "." + name));
          break;
        }
        case 'Q': {  // BINPERSID ('storage', type, key, location, numel)
          auto id = pop().toTupleRef().elements();
          DTRAIN_CHECK_AS(CheckpointError, id.size() >= 5 && id[0].toStringRef() == "storage",
                          "unsupported persistent id");
          stack_.push_back(storage_(id[2].toStringRef(), storage_dtype(id[1].toStringRef())));
          break;
        }
        case 'R': {  // REDUCE: callable(*args)
          c10::IValue args = pop();
          const std::string callable = pop().toStringRef();
          stack_.push_back(reduce(callable, args.toTupleRef().elements()));
          break;
        }
        case 'b':  // BUILD: drop the state (an OrderedDict's _metadata)
          pop();
          break;
        case 's': {
          c10::IValue v = pop(), k = pop();
          stack_.back().toGenericDict().insert_or_assign(k, v);
          break;
        }
        case 'u': {
          const size_t m = pop_mark();
          auto d = stack_.at(m - 1).toGenericDict();
          for (size_t i = m; i + 1 < stack_.size(); i += 2) {
            d.insert_or_assign(stack_[i], stack_[i + 1]);
          }
          stack_.resize(m);
          break;
        }
        case 'a': {
          c10::IValue v = pop();
          stack_.back().toList().push_back(v);
          break;
        }
        case 'e': {
          const size_t m = pop_mark();
          auto l = stack_.at(m - 1).toList();
          for (size_t i = m; i < stack_.size(); ++i) l.push_back(stack_[i]);
          stack_.resize(m);
          break;
        }
        default:
          DTRAIN_FAIL(CheckpointError, "pickle opcode ", static_cast<int>(op), " at byte ",
                      pos_ - 1, " is not one torch.save writes for state dicts");
      }
    }
  }

 private:
  static c10::impl::GenericDict dict() {
    return c10::impl::GenericDict(c10::AnyType::get(), c10::AnyType::get());
  }
  unsigned char byte() {
    DTRAIN_CHECK_AS(CheckpointError, pos_ < data_.size(), "the pickle ends early");
    return static_cast<unsigned char>(data_[pos_++]);
  }
  template <typename T>
  T le() {
    T v = 0;
    for (size_t i = 0; i < sizeof(T); ++i) v |= static_cast<T>(static_cast<T>(byte()) << (8 * i));
    return v;
  }
  std::string text(size_t n) {
    DTRAIN_CHECK_AS(CheckpointError, pos_ + n <= data_.size(), "the pickle ends early");
    std::string s(data_.data() + pos_, n);
    pos_ += n;
    return s;
  }
  std::string line() {
    std::string s;
    for (char c = static_cast<char>(byte()); c != '\n'; c = static_cast<char>(byte())) s += c;
    return s;
  }
  c10::IValue pop() {
    DTRAIN_CHECK_AS(CheckpointError, !stack_.empty(), "the pickle's stack underflows");
    c10::IValue v = stack_.back();
    stack_.pop_back();
    return v;
  }
  size_t pop_mark() {
    DTRAIN_CHECK_AS(CheckpointError, !marks_.empty(), "the pickle lacks a MARK");
    size_t m = marks_.back();
    marks_.pop_back();
    return m;
  }
  void tuple_of(size_t n) {
    DTRAIN_CHECK_AS(CheckpointError, n <= stack_.size(), "the pickle's stack underflows");
    std::vector<c10::IValue> items(stack_.end() - static_cast<long>(n), stack_.end());
    stack_.resize(stack_.size() - n);
    stack_.push_back(c10::ivalue::Tuple::create(std::move(items)));
  }
  static c10::ScalarType storage_dtype(const std::string& type) {
    static const std::map<std::string, c10::ScalarType> kTypes = {
        {"torch.FloatStorage", at::kFloat}, {"torch.DoubleStorage", at::kDouble},
        {"torch.HalfStorage", at::kHalf},   {"torch.BFloat16Storage", at::kBFloat16},
        {"torch.LongStorage", at::kLong},   {"torch.IntStorage", at::kInt},
        {"torch.ShortStorage", at::kShort}, {"torch.CharStorage", at::kChar},
        {"torch.ByteStorage", at::kByte},   {"torch.BoolStorage", at::kBool}};
    auto it = kTypes.find(type);
    DTRAIN_CHECK_AS(CheckpointError, it != kTypes.end(), "storage type '", type,
                    "' is not supported");
    return it->second;
  }
  c10::IValue reduce(const std::string& callable, const std::vector<c10::IValue>& args) {
    if (callable == "collections.OrderedDict" || callable == "builtins.dict") return dict();
    if (callable == "torch._utils._rebuild_tensor_v2") {
      at::Tensor storage = args.at(0).toTensor();
      std::vector<int64_t> size, stride;
      for (const auto& x : args.at(2).toTupleRef().elements()) size.push_back(x.toInt());
      for (const auto& x : args.at(3).toTupleRef().elements()) stride.push_back(x.toInt());
      return storage.as_strided(size, stride, args.at(1).toInt());
    }
    if (callable == "torch._utils._rebuild_parameter") return args.at(0);
    DTRAIN_FAIL(CheckpointError, "the pickle calls '", callable,
                "', which is not part of a state dict (dtrain reads tensors, containers and "
                "numbers)");
  }

  const std::vector<char>& data_;
  std::function<at::Tensor(const std::string&, c10::ScalarType)> storage_;
  size_t pos_ = 0;
  std::vector<c10::IValue> stack_;
  std::vector<size_t> marks_;
  std::map<uint32_t, c10::IValue> memo_;
};

}  // namespace

c10::IValue unpickle(const std::vector<char>& bytes, const std::string& what) {
  try {
    caffe2::serialize::PyTorchStreamReader reader(
        std::make_shared<caffe2::serialize::MemoryReadAdapter>(bytes.data(),
                                                               static_cast<off_t>(bytes.size())));
    auto [pickle_ptr, pickle_size] = reader.getRecord("data.pkl");
    const char* p = static_cast<const char*>(pickle_ptr.get());
    std::vector<char> pickle(p, p + pickle_size);
    MiniUnpickler u(pickle, [&](const std::string& key, c10::ScalarType dtype) {
      auto [ptr, size] = reader.getRecord("data/" + key);
      const int64_t n = static_cast<int64_t>(size / c10::elementSize(dtype));
      at::Tensor t = at::empty({n}, at::TensorOptions(dtype));
      if (size > 0) std::memcpy(t.data_ptr(), ptr.get(), size);
      return t;
    });
    return u.run();
  } catch (const dtrain::Error& e) {
    DTRAIN_FAIL(CheckpointError, "checkpoint: '", what,
                "' cannot be read: ", detail::strip_location(e.what()));
  } catch (const std::exception& e) {
    DTRAIN_FAIL(CheckpointError, "checkpoint: '", what,
                "' is not a torch.save archive dtrain can read (",
                detail::strip_location(e.what()).substr(0, 300), ")");
  }
}

}  // namespace dtrain::framework::ckpt
