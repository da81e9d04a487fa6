#include "framework/checkpoint/pickle.h"

#include <caffe2/serialize/in_memory_adapter.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickler.h>

#include <array>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <set>

#include "core/error.h"
#include "framework/checkpoint/atomic_file.h"

namespace dtrain::framework::ckpt {
namespace {

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
