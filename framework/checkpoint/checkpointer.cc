#include "framework/checkpoint/checkpointer.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <sys/stat.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <future>
#include <map>
#include <optional>
#include <sstream>
#include <thread>

#include "amp/grad_scaler.h"
#include "amp/numerics.h"
#include "comm/communicator.h"
#include "comm/types.h"
#include "core/choices.h"
#include "core/error.h"
#include "core/logging.h"
#include "framework/checkpoint/atomic_file.h"
#include "framework/checkpoint/hash.h"
#include "framework/checkpoint/meta.h"
#include "framework/checkpoint/optim_state.h"
#include "framework/checkpoint/pickle.h"
#include "sharding/fsdp_state.h"
#include "sharding/reducer.h"
#include "sharding/tensor_parallel_plan.h"

namespace dtrain::framework {
namespace {

namespace fs = std::filesystem;
using ckpt::FileInfo;

const std::vector<std::string> kStateKeys = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq",
                                             "momentum_buffer"};

std::string step_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "step_%08lld", static_cast<long long>(step));
  return buf;
}

std::string rank_file(const char* kind, int rank) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%s_%05d.pt", kind, rank);
  return buf;
}

// --- collectives (no-ops for one process) -------------------------------------------------
int rank_of(const CheckpointParts& p) { return p.comm ? p.comm->rank() : 0; }
int world_of(const CheckpointParts& p) { return p.comm ? p.comm->size() : 1; }

// The host really waits (under NCCL, Work::wait only makes the current stream wait): what
// follows a barrier here reads or removes files other ranks wrote before it.
void barrier(const CheckpointParts& p) {
  if (p.comm && p.comm->size() > 1) {
    comm::Work w = p.comm->barrier();
    w.wait();
    w.synchronize();
  }
}

int64_t broadcast_value(const CheckpointParts& p, int64_t v) {
  if (!p.comm || p.comm->size() == 1) return v;
  at::Tensor t = at::full({1}, v, at::TensorOptions(at::kLong).device(p.comm->device()));
  p.comm->broadcast(t, 0).wait();
  return t.item<int64_t>();
}

// Every rank's (bytes, checksum) of its own files, on every rank.
std::vector<int64_t> gather_values(const CheckpointParts& p, const std::vector<int64_t>& mine) {
  if (!p.comm || p.comm->size() == 1) return mine;
  const auto opts = at::TensorOptions(at::kLong).device(p.comm->device());
  at::Tensor in = at::tensor(mine, at::kLong).to(p.comm->device());
  at::Tensor all = at::empty({static_cast<int64_t>(mine.size()) * p.comm->size()}, opts);
  p.comm->all_gather(in, all).wait();
  all = all.cpu();
  return std::vector<int64_t>(all.data_ptr<int64_t>(), all.data_ptr<int64_t>() + all.numel());
}

// A restore error every rank has agreed on (agree()): no rank is left waiting in a collective.
class AgreedCheckpointError : public CheckpointError {
 public:
  using CheckpointError::CheckpointError;
};
// The same for a checkpoint of another job (other data, tokenizer or model): a config error,
// which no older checkpoint of the same folder would cure.
class AgreedConfigError : public ConfigError {
 public:
  using ConfigError::ConfigError;
};

// Collective: every rank says whether reading failed (`error`, empty when not), and whether
// for a checkpoint of another job (`other_job`) rather than a damaged one. When any failed,
// every rank throws the first failing rank's message (another job's before a damaged file's),
// so each one reports the cause rather than a connection its peer closed.
void agree(const CheckpointParts& p, const std::string& error, bool other_job = false) {
  const int64_t code = error.empty() ? 0 : other_job ? 2 : 1;
  if (!p.comm || p.comm->size() == 1) {
    if (code == 2) throw AgreedConfigError(error);
    if (code == 1) throw AgreedCheckpointError(error);
    return;
  }
  const std::vector<int64_t> failed = gather_values(p, {code});
  auto it = std::find(failed.begin(), failed.end(), 2);
  const bool config = it != failed.end();
  if (!config) it = std::find(failed.begin(), failed.end(), 1);
  if (it == failed.end()) return;
  const int first = static_cast<int>(it - failed.begin());
  const auto opts = at::TensorOptions(at::kLong).device(p.comm->device());
  at::Tensor len = at::full({1}, static_cast<int64_t>(error.size()), opts);
  p.comm->broadcast(len, first).wait();
  at::Tensor text = at::zeros({len.cpu().item<int64_t>()}, at::kByte);
  if (p.comm->rank() == first) std::memcpy(text.data_ptr(), error.data(), error.size());
  text = text.to(p.comm->device());
  p.comm->broadcast(text, first).wait();
  text = text.cpu();
  std::string message(static_cast<const char*>(text.data_ptr()), text.numel());
  if (config) throw AgreedConfigError(message);  // the same on every rank: said once
  if (p.comm->rank() != first) message += " (found by rank " + std::to_string(first) + ")";
  throw AgreedCheckpointError(message);
}

// --- the model's tensors --------------------------------------------------------------------
// Sharded checkpoints: a buffer's key in the shard files.
constexpr char kBufferPrefix[] = "buffer|";

struct Named {
  std::string name;
  at::Tensor tensor;
};

// Parameters (full values: FSDP gathers, collectively), then buffers, by module name.
std::vector<Named> model_tensors(const CheckpointParts& p) {
  std::vector<Named> out;
  if (p.fsdp != nullptr) {
    for (auto& [name, t] : p.fsdp->full_parameters()) out.push_back({name, t});
  } else {
    for (const auto& item : p.module->named_parameters()) {
      out.push_back({item.key(), item.value().detach()});
    }
  }
  if (p.tp != nullptr) {
    for (auto& t : out) t.tensor = p.tp->full(t.name, t.tensor);  // collective per slice
  }
  for (const auto& item : p.module->named_buffers()) {
    out.push_back({item.key(), item.value().detach()});
  }
  return out;
}

// The model's parameters by name, in the model's order (FSDP: its fp32 masters). Checkpoints
// hold optimizer state in this order; the optimizer's own order (its param groups, which a
// user may build in any order) is mapped to it by tensor identity, and saved names map it
// back, so state always returns to the parameter it belongs to.
std::vector<std::pair<std::string, at::Tensor>> model_parameters(const CheckpointParts& p) {
  if (p.fsdp != nullptr) return p.fsdp->all_parameters();
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : p.module->named_parameters()) out.emplace_back(item.key(), item.value());
  return out;
}

// For each model parameter, its index in the optimizer's order (-1: the optimizer does not
// hold it). Every tensor the optimizer holds must be one of the model's parameters.
std::vector<int64_t> optimizer_slots(const CheckpointParts& p) {
  const auto model = model_parameters(p);
  const std::vector<at::Tensor> held = optimizer_parameters(*p.optimizer);
  std::map<const c10::TensorImpl*, int64_t> index;
  for (size_t j = 0; j < held.size(); ++j) index[held[j].unsafeGetTensorImpl()] = j;
  std::vector<int64_t> slots;
  for (const auto& [name, t] : model) {
    auto it = index.find(t.unsafeGetTensorImpl());
    slots.push_back(it == index.end() ? -1 : it->second);
    if (it != index.end()) index.erase(it);
  }
  DTRAIN_CHECK_AS(
      CheckpointError, index.empty(), "checkpoint: the optimizer holds ", index.size(),
      " tensor(s) that are not parameters of the model",
      p.fsdp != nullptr ? " (under FSDP, give it model.parameters(): the masters)" : "");
  return slots;
}

// Optimizer order -> model order, and back.
std::vector<ParamState> to_model_order(const std::vector<ParamState>& by_optimizer,
                                       const std::vector<int64_t>& slots) {
  std::vector<ParamState> out(slots.size());
  for (size_t i = 0; i < slots.size(); ++i) {
    if (slots[i] >= 0) out[i] = by_optimizer.at(static_cast<size_t>(slots[i]));
  }
  return out;
}

std::vector<ParamState> to_optimizer_order(const std::vector<ParamState>& by_model,
                                           const std::vector<int64_t>& slots, size_t held) {
  std::vector<ParamState> out(held);
  for (size_t i = 0; i < slots.size(); ++i) {
    if (slots[i] >= 0) out[static_cast<size_t>(slots[i])] = by_model[i];
  }
  return out;
}

std::vector<at::Tensor> key_parts(const std::vector<ParamState>& states, const std::string& key) {
  std::vector<at::Tensor> parts;
  for (const auto& s : states) parts.push_back(s.count(key) ? s.at(key) : at::Tensor());
  return parts;
}

bool has_key(const std::vector<ParamState>& states, const std::string& key) {
  return std::any_of(states.begin(), states.end(),
                     [&](const ParamState& s) { return s.count(key) > 0; });
}

c10::impl::GenericDict tensor_dict() {
  return c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get());
}

at::Tensor rng_state_of(c10::Device device) {
  return at::globalContext().defaultGenerator(device).get_state();
}

int cuda_devices() { return static_cast<int>(at::detail::getCUDAHooks().deviceCount()); }

c10::impl::GenericDict as_dict(const c10::IValue& v, const std::string& what) {
  DTRAIN_CHECK_AS(CheckpointError, v.isGenericDict(), "checkpoint: '", what,
                  "' does not hold a dict");
  return v.toGenericDict();
}

// name -> tensor of a dict (string keys), for lookups.
std::map<std::string, at::Tensor> tensors_of(const c10::impl::GenericDict& d) {
  std::map<std::string, at::Tensor> out;
  for (const auto& kv : d) {
    if (kv.key().isString() && kv.value().isTensor()) {
      out[kv.key().toStringRef()] = kv.value().toTensor();
    }
  }
  return out;
}

// What a tensor of the model needs from a checkpoint: its name, shape and dtype.
struct Wanted {
  std::string name;
  std::vector<int64_t> shape;
  c10::ScalarType dtype = at::kFloat;
};

// The saved tensor for one wanted: present, of the same shape, and of a dtype that converts
// without loss of meaning (floating for floating: a buffer comes back in the model's own,
// buffer_dtype where the policy sets one; any other dtype exactly, as BatchNorm's int64
// num_batches_tracked or a bool mask), or CheckpointError naming it.
at::Tensor match_one(const std::map<std::string, at::Tensor>& saved, const Wanted& w,
                     const std::string& file) {
  auto it = saved.find(w.name);
  DTRAIN_CHECK_AS(CheckpointError, it != saved.end(), "'", file, "' has no tensor '", w.name,
                  "', which the model has: was it saved from another model? Nothing was "
                  "loaded.");
  DTRAIN_CHECK_AS(CheckpointError, it->second.sizes().vec() == w.shape, "'", file, "': '", w.name,
                  "' has shape ", it->second.sizes(), " but the model's is ",
                  at::IntArrayRef(w.shape), ". Nothing was loaded.");
  const c10::ScalarType got = it->second.scalar_type();
  DTRAIN_CHECK_AS(CheckpointError,
                  c10::isFloatingType(w.dtype) ? c10::isFloatingType(got) : got == w.dtype, "'",
                  file, "': '", w.name, "' has dtype ", got, " but the model's is ", w.dtype,
                  ". Nothing was loaded.");
  return it->second;
}

// `saved[name]` for every wanted, in order: every one matches (match_one) before anything
// is used.
std::vector<at::Tensor> match(const std::map<std::string, at::Tensor>& saved,
                              const std::vector<Wanted>& want, const std::string& file) {
  std::vector<at::Tensor> out;
  for (const auto& w : want) out.push_back(match_one(saved, w, file));
  return out;
}

}  // namespace

void save_state_dict(torch::nn::Module& module, const std::string& path) {
  auto d = tensor_dict();
  for (const auto& item : module.named_parameters())
    d.insert(item.key(), item.value().detach().cpu());
  for (const auto& item : module.named_buffers()) d.insert(item.key(), item.value().detach().cpu());
  const fs::path p(path);
  const std::string dir = p.has_parent_path() ? p.parent_path().string() : ".";
  ckpt::write_pickle(dir, p.filename().string(), d);
}

void load_state_dict(torch::nn::Module& module, const std::string& path) {
  auto saved = tensors_of(as_dict(ckpt::unpickle(ckpt::read_raw(path), path), path));
  std::vector<Wanted> want;
  std::vector<at::Tensor> targets;
  for (const auto& item : module.named_parameters()) {
    want.push_back({item.key(), item.value().sizes().vec(), item.value().scalar_type()});
    targets.push_back(item.value());
  }
  for (const auto& item : module.named_buffers()) {
    want.push_back({item.key(), item.value().sizes().vec(), item.value().scalar_type()});
    targets.push_back(item.value());
  }
  std::vector<at::Tensor> values = match(saved, want, path);
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < targets.size(); ++i) targets[i].copy_(values[i]);
}

Checkpointer::Checkpointer(RunConfig config) : config_(std::move(config)) {}

std::optional<std::string> Checkpointer::newest_complete(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return std::nullopt;
  std::vector<std::string> found;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("step_", 0) == 0 && fs::exists(e.path() / "COMPLETE", ec)) found.push_back(name);
  }
  if (found.empty()) return std::nullopt;
  std::sort(found.begin(), found.end());
  return dir + "/" + found.back();
}

namespace {

// --- save, step by step ---------------------------------------------------------------------

// Rank 0: the step folder. Saving into one that exists (a run restarted from an older
// checkpoint passes this step again): its COMPLETE marker goes first, so no marker ever stands
// over files being rewritten, and a killed writer's temporary files with it.
void prepare_step_dir(const std::string& root, const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  DTRAIN_CHECK_AS(CheckpointError, !ec, "checkpoint.dir: cannot create '", dir,
                  "': ", ec.message());
  fs::remove(fs::path(dir) / "COMPLETE", ec);
  // A killed writer's temporary files, and the lists of files a crashed save left (a stale
  // list would vouch for files being rewritten).
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.find(".tmp.") != std::string::npos || name.rfind("files_", 0) == 0) {
      fs::remove(e.path(), ec);
    }
  }
  ckpt::sync_dir(dir);
  ckpt::sync_dir(root);
}

// Tensors copied out of the training state into buffers of their own (Checkpointer::save's
// staging), so that files can be written while training changes the originals. Each buffer
// is kept by its key and reused by the next save of the same shape; a CUDA tensor goes to
// pinned memory without blocking, and finish() waits for those copies once. Without buffers
// (a save written before training goes on), CPU tensors are used as they are.
class Stager {
 public:
  explicit Stager(std::map<std::string, at::Tensor>* buffers) : buffers_(buffers) {}

  at::Tensor tensor(const std::string& key, const at::Tensor& t) {
    if (!t.defined()) return t;
    if (buffers_ == nullptr) return t.is_cpu() ? t : t.cpu();
    at::Tensor& b = (*buffers_)[key];
    if (b.defined() && b.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) {  // adopted
      bytes_ += b.nbytes();
      return b;
    }
    if (!b.defined() || b.sizes() != t.sizes() || b.scalar_type() != t.scalar_type() ||
        !b.is_contiguous()) {
      b = at::empty(t.sizes(), t.options().device(c10::kCPU).pinned_memory(t.is_cuda()));
    }
    if (t.is_cuda()) {
      b.copy_(t, /*non_blocking=*/true);
      cuda_ = true;
    } else {
      b.copy_(t);
    }
    bytes_ += b.nbytes();
    return b;
  }

  // Every tensor inside `v` (dicts and lists, to any depth) staged under `key`'s path.
  c10::IValue value(const std::string& key, const c10::IValue& v) {
    if (v.isTensor()) return tensor(key, v.toTensor());
    if (v.isGenericDict()) {
      const auto d = v.toGenericDict();
      c10::impl::GenericDict out(d.keyType(), d.valueType());
      for (const auto& kv : d) {
        const c10::IValue& k = kv.key();
        const std::string name = k.isString() ? k.toStringRef()
                                 : k.isInt()  ? std::to_string(k.toInt())
                                              : std::string("?");
        out.insert(k, value(key + "/" + name, kv.value()));
      }
      return out;
    }
    if (v.isList()) {
      const auto l = v.toList();
      c10::impl::GenericList out(l.elementType());
      for (size_t i = 0; i < l.size(); ++i)
        out.push_back(value(key + "[" + std::to_string(i) + "]", l.get(i)));
      return out;
    }
    return v;
  }

  // The buffer kept for `key` (undefined when none, or when nothing is kept: a save written
  // before training goes on), for code that writes its staged copy in place.
  at::Tensor buffer(const std::string& key) const {
    if (buffers_ == nullptr) return {};
    auto it = buffers_->find(key);
    return it == buffers_->end() ? at::Tensor() : it->second;
  }
  // `t`, made for this checkpoint alone (no one else writes it), kept as `key`'s buffer.
  at::Tensor adopt(const std::string& key, const at::Tensor& t) {
    if (buffers_ != nullptr && t.is_cpu()) (*buffers_)[key] = t;
    return t;
  }

  // Waits for the copies from the GPU.
  void finish() {
    if (cuda_)
      at::detail::getCUDAHooks().deviceSynchronize(at::detail::getCUDAHooks().current_device());
  }
  int64_t bytes() const { return bytes_; }

 private:
  std::map<std::string, at::Tensor>* buffers_;
  bool cuda_ = false;
  int64_t bytes_ = 0;
};

// Every rank: its RNG states and its numerics history (rank_<r>.pt).
c10::IValue rank_state(const CheckpointParts& p) {
  auto d = tensor_dict();
  d.insert("rng_cpu", rng_state_of(c10::Device(c10::kCPU)));
  c10::impl::GenericList cuda(c10::AnyType::get());
  for (int i = 0; i < cuda_devices(); ++i) {
    cuda.push_back(rng_state_of(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i))));
  }
  d.insert("rng_cuda", cuda);
  if (p.monitor != nullptr) {
    std::vector<double> flat;
    for (const auto& [s, v] : p.monitor->scale_history()) {
      flat.push_back(static_cast<double>(s));
      flat.push_back(v);
    }
    d.insert("scale_history", at::tensor(flat, at::kDouble).reshape({-1, 2}));
  }
  if (p.ddp != nullptr && !p.ddp->rebuilt_order().empty()) {
    d.insert("ddp_bucket_order", at::tensor(p.ddp->rebuilt_order(), at::kLong));
  }
  return d;
}

// The optimizer's state in the model's order (model_parameters), and the keys it has.
struct OptimizerExport {
  std::vector<int64_t> slots;  // optimizer_slots
  std::vector<ParamState> states;
  std::vector<std::string> keys;
};

OptimizerExport export_in_model_order(const CheckpointParts& p) {
  OptimizerExport o;
  if (p.optimizer == nullptr) return o;
  o.slots = optimizer_slots(p);
  o.states = to_model_order(export_optimizer_state(*p.optimizer), o.slots);
  for (const auto& k : kStateKeys) {
    if (has_key(o.states, k)) o.keys.push_back(k);
  }
  return o;
}

// Sharded, every rank: its slice of each unit's masters and optimizer state, and its buffers
// (shard_<r>.pt).
c10::IValue shard_dict(const CheckpointParts& p, const OptimizerExport& o, Stager& stager,
                       const std::string& file) {
  auto d = tensor_dict();
  std::vector<at::Tensor> masters;
  for (const auto& m : p.fsdp->all_parameters()) masters.push_back(m.second);
  const auto layouts = p.fsdp->layouts();
  // Each unit's flat shard is made for the file: written straight into its staging buffer.
  auto put = [&](const std::string& what, const std::vector<at::Tensor>& parts) {
    std::vector<at::Tensor> into;
    for (const auto& l : layouts) into.push_back(stager.buffer(file + "/" + l.name + "|" + what));
    auto flats = p.fsdp->flat_shards(parts, into);
    for (size_t u = 0; u < flats.size(); ++u) {
      const std::string key = layouts[u].name + "|" + what;
      d.insert(key, stager.adopt(file + "/" + key, flats[u]));
    }
  };
  put("params", masters);
  for (const auto& k : o.keys) put(k, key_parts(o.states, k));
  std::vector<double> steps;
  for (const auto& s : o.states)
    steps.push_back(s.count("step") ? s.at("step").item<double>() : -1);
  d.insert("optim_step", at::tensor(steps, at::kDouble));
  // Buffers are not sharded: every rank writes its own, and a restore takes rank 0's (the
  // values a DDP or FSDP run broadcasts at construction), at any world size.
  for (const auto& item : p.module->named_buffers()) {
    d.insert(kBufferPrefix + item.key(), item.value().detach());
  }
  return d;
}

// Rank 0's optim.pt in PyTorch's layout: state keyed by the optimizer's parameter index, and
// each group's parameter names (which a restore matches by). `full_state[k][i]`: key k of
// model parameter i gathered (FSDP, TP); without either, empty: the state as it is.
c10::IValue full_optimizer_dict(const CheckpointParts& p, const OptimizerExport& o,
                                const std::vector<std::vector<at::Tensor>>& full_state) {
  c10::impl::GenericDict state(c10::AnyType::get(), c10::AnyType::get());
  const auto model = model_parameters(p);
  std::vector<std::string> names(optimizer_parameters(*p.optimizer).size());
  for (size_t i = 0; i < o.states.size(); ++i) {
    if (o.slots[i] < 0) continue;
    names[static_cast<size_t>(o.slots[i])] = model[i].first;
    auto entry = tensor_dict();
    if (o.states[i].count("step")) entry.insert("step", o.states[i].at("step"));
    for (size_t k = 0; k < o.keys.size(); ++k) {
      if (!o.states[i].count(o.keys[k])) continue;
      entry.insert(o.keys[k], full_state[k].empty() ? o.states[i].at(o.keys[k]) : full_state[k][i]);
    }
    if (entry.size() > 0) state.insert(o.slots[i], entry);
  }
  auto optim = tensor_dict();
  optim.insert("state", state);
  optim.insert("param_groups", optimizer_param_groups(*p.optimizer, names));
  return optim;
}

// Full: the model (model.pt) and optimizer (optim.pt), gathered on every rank under FSDP
// (collective), for rank 0 to write; none on other ranks.
std::vector<std::pair<std::string, c10::IValue>> full_dicts(const CheckpointParts& p,
                                                            const OptimizerExport& o, int rank) {
  auto tensors = model_tensors(p);
  std::vector<std::vector<at::Tensor>> full_state(o.keys.size());
  if (p.fsdp != nullptr) {
    for (size_t k = 0; k < o.keys.size(); ++k) {
      full_state[k] = p.fsdp->gather_full(key_parts(o.states, o.keys[k]));
    }
  }
  if (p.tp != nullptr) {
    // Every rank holds state for the same parameters (one optimizer, stepped alike), so the
    // group's gathers pair up.
    const auto params = model_parameters(p);
    for (size_t k = 0; k < o.keys.size(); ++k) {
      if (full_state[k].empty()) full_state[k] = key_parts(o.states, o.keys[k]);
      for (size_t i = 0; i < params.size(); ++i) {
        if (full_state[k][i].defined()) {
          full_state[k][i] = p.tp->full(params[i].first, full_state[k][i]);
        }
      }
    }
  }
  if (rank != 0) return {};
  auto model = tensor_dict();
  for (const auto& t : tensors) model.insert(t.name, t.tensor);
  std::vector<std::pair<std::string, c10::IValue>> files{{"model.pt", model}};
  if (p.optimizer != nullptr) files.push_back({"optim.pt", full_optimizer_dict(p, o, full_state)});
  return files;
}

// The model's side of meta.json: its parameters, and under sharding its FSDP units.
void describe_model(const CheckpointParts& p, bool sharded, ckpt::Meta& m) {
  if (p.fsdp != nullptr) {
    for (const auto& l : p.fsdp->layouts()) {
      for (const auto& e : l.params) m.parameters.push_back({e.name, e.shape, "fp32"});
    }
  } else {
    for (const auto& item : p.module->named_parameters()) {
      m.parameters.push_back(
          {item.key(), item.value().sizes().vec(), comm::dtype_name(item.value().scalar_type())});
    }
  }
  if (p.tp != nullptr) {  // the whole model's shapes, as the files hold them
    for (auto& pm : m.parameters) pm.shape = p.tp->full_shape(pm.name, pm.shape);
  }
  if (!sharded) return;
  for (const auto& l : p.fsdp->layouts()) {
    ckpt::UnitMeta unit{l.name, name_of(l.layout), l.numel, l.shard_size, l.shard_group_size, {}};
    for (const auto& e : l.params) {
      unit.params.push_back({e.name, e.shape, e.place.offset, e.place.numel, e.place.chunk,
                             e.place.shard_at, p.tp != nullptr ? p.tp->sliced_dim(e.name) : -1});
    }
    m.units.push_back(std::move(unit));
  }
}

// A rank's list of the files it wrote (files_<r>.txt beside them): one "name bytes xxh64" line
// each, which rank 0 reads into meta.json.
std::string files_marker(int rank) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "files_%05d.txt", rank);
  return buf;
}

std::vector<FileInfo> read_marker(const std::string& dir, int rank) {
  const std::vector<char> raw = ckpt::read_raw(dir + "/" + files_marker(rank));
  std::istringstream in(std::string(raw.begin(), raw.end()));
  std::vector<FileInfo> files;
  std::string name, hex;
  uint64_t bytes = 0;
  while (in >> name >> bytes >> hex) {
    files.push_back({name, bytes, std::stoull(hex, nullptr, 16)});
  }
  DTRAIN_CHECK_AS(CheckpointError, in.eof(), "checkpoint '", dir, "': ", files_marker(rank),
                  " is malformed");
  return files;
}

// Rank 0: keeps the newest `keep` complete checkpoints, and drops incomplete ones (crashed
// writes) older than the newest complete one.
void prune(const CheckpointConfig& cc) {
  std::vector<std::pair<std::string, bool>> found;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(cc.dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("step_", 0) == 0) found.push_back({name, fs::exists(e.path() / "COMPLETE", ec)});
  }
  std::sort(found.begin(), found.end());
  int64_t complete_seen = 0;
  for (auto it = found.rbegin(); it != found.rend(); ++it) {
    if (it->second && ++complete_seen <= cc.keep) continue;
    if (!it->second && complete_seen == 0) continue;  // newer than every complete one
    fs::remove_all(cc.dir + "/" + it->first, ec);
  }
}

}  // namespace

// A checkpoint copied out of the training state (Checkpointer::stage): the files this rank
// writes, each a pickled value whose tensors are staged, and rank 0's metadata, which lacks
// only the files' sizes and checksums.
struct Checkpointer::Staged {
  std::string dir;
  int rank = 0;
  int world = 1;
  std::vector<std::pair<std::string, c10::IValue>> files;
  ckpt::Meta meta;
};

// What runs beside training under checkpoint.async: the one save being written, the error it
// ended with, and the staging buffers every save reuses.
struct Checkpointer::Async {
  std::map<std::string, at::Tensor> buffers;
  std::thread writer;
  std::string writing;  // the step folder being written
  std::exception_ptr error;
  int64_t staged_bytes = 0;
};

Checkpointer::~Checkpointer() {
  if (async_ && async_->writer.joinable()) async_->writer.join();
}

int64_t Checkpointer::staging_bytes() const { return async_ ? async_->staged_bytes : 0; }

// Every rank's files go to the step folder (rank 0 emptied it before anyone wrote), then a
// list of them (files_<r>.txt); rank 0 waits for every rank's list, then writes meta.json and
// the COMPLETE marker that holds meta.json's checksum: a checkpoint without its marker was
// never finished. No collective: this runs on a thread while training uses the communicator.
void Checkpointer::write(const Staged& s) const {
  std::vector<FileInfo> mine;
  // model.pt and optim.pt (the large ones of a full checkpoint) in parallel.
  std::vector<std::future<FileInfo>> more;
  for (size_t i = 1; i < s.files.size(); ++i) {
    more.push_back(std::async(std::launch::async, [&s, i] {
      return ckpt::write_pickle(s.dir, s.files[i].first, s.files[i].second);
    }));
  }
  if (!s.files.empty())
    mine.push_back(ckpt::write_pickle(s.dir, s.files[0].first, s.files[0].second));
  for (auto& f : more) mine.push_back(f.get());
  std::string list;
  for (const auto& f : mine)
    list += f.name + " " + std::to_string(f.bytes) + " " + ckpt::hex(f.checksum) + "\n";
  ckpt::write_file(s.dir, files_marker(s.rank), std::vector<char>(list.begin(), list.end()));
  if (s.rank != 0) return;
  ckpt::Meta m = s.meta;
  const double timeout_s = config_.parallel.timeout_s > 0 ? config_.parallel.timeout_s : 1800;
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  for (int r = 0; r < s.world; ++r) {
    std::error_code ec;
    while (!fs::exists(fs::path(s.dir) / files_marker(r), ec)) {
      DTRAIN_CHECK_AS(CheckpointError, std::chrono::steady_clock::now() < deadline, "checkpoint '",
                      s.dir, "': rank ", r, " did not finish writing its files within ", timeout_s,
                      " s (parallel.timeout_s); the checkpoint stays incomplete");
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    for (const auto& f : read_marker(s.dir, r)) m.files[f.name] = f;
  }
  const std::string meta_text = ckpt::write_meta(m);
  const FileInfo meta =
      ckpt::write_file(s.dir, "meta.json", std::vector<char>(meta_text.begin(), meta_text.end()));
  const std::string complete = ckpt::write_complete(meta);
  ckpt::write_file(s.dir, "COMPLETE", std::vector<char>(complete.begin(), complete.end()));
  std::error_code ec;
  for (int r = 0; r < s.world; ++r) fs::remove(fs::path(s.dir) / files_marker(r), ec);
  prune(config_.checkpoint);
}

// The training state copied out: rank 0 empties the step folder, every rank stages its own
// files (collective: FSDP gathers what a full checkpoint holds), rank 0 its metadata.
Checkpointer::Staged Checkpointer::stage(const CheckpointParts& p, const TrainerProgress& progress,
                                         std::map<std::string, at::Tensor>* buffers) const {
  const auto& cc = config_.checkpoint;
  Staged s;
  s.rank = rank_of(p);
  s.world = world_of(p);
  // Under TP, full unless sharded is asked for: each rank's file then holds its FSDP shards of
  // its tp slices, which a restore at another mesh puts together (read_sharded).
  const bool sharded = p.fsdp != nullptr && cc.format != CheckpointFormat::kFull &&
                       (p.tp == nullptr || cc.format == CheckpointFormat::kSharded);
  s.dir = cc.dir + "/" + step_name(progress.step);
  if (s.rank == 0) prepare_step_dir(cc.dir, s.dir);
  barrier(p);
  c10::NoGradGuard no_grad;
  Stager stager(buffers);
  auto add = [&](const std::string& name, const c10::IValue& v) {
    s.files.emplace_back(name, stager.value(name, v));
  };
  add(rank_file("rank", s.rank), rank_state(p));
  const OptimizerExport optim = export_in_model_order(p);
  if (sharded) {
    const std::string file = rank_file("shard", s.rank);
    add(file, shard_dict(p, optim, stager, file));
  }
  if (!sharded) {
    for (auto& [name, v] : full_dicts(p, optim, s.rank)) add(name, v);
  }
  if (s.rank == 0 && p.scaler != nullptr) add("scaler.pt", p.scaler->state_dict());
  // Each rank's shard rank (HYBRID_SHARD repeats them): which file holds which slice.
  const std::vector<int64_t> shard_ranks =
      gather_values(p, {p.fsdp != nullptr ? p.fsdp->layouts().front().shard_rank : 0});
  // And its tp rank: which slices.
  const std::vector<int64_t> tp_ranks = gather_values(p, {p.tp != nullptr ? p.tp->rank() : 0});
  stager.finish();
  if (async_) async_->staged_bytes = std::max(async_->staged_bytes, stager.bytes());
  if (s.rank == 0) {
    ckpt::Meta& m = s.meta;
    m.strategy = name_of(config_.parallel.strategy);
    m.mode = sharded ? "sharded" : "full";
    m.world_size = s.world;
    describe_model(p, sharded, m);
    m.optimizer_keys = optim.keys;
    m.shard_ranks = shard_ranks;
    if (sharded && p.tp != nullptr && p.tp->size() > 1) {
      m.tp = p.tp->size();
      m.tp_ranks = tp_ranks;
    }
    m.step = progress.step;
    m.skipped_steps = progress.skipped_steps;
    m.lr = progress.lr;
    m.consecutive_skips = progress.consecutive_skips;
    m.nonfinite_run = progress.nonfinite_run;
    m.spike = progress.spike;
    m.data = progress.data;
    m.data_step = progress.data_step;
    m.job = job_;
  }
  return s;
}

double Checkpointer::finish() {
  if (!async_ || !async_->writer.joinable()) return 0;
  const auto t0 = std::chrono::steady_clock::now();
  async_->writer.join();
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (async_->error) {
    std::exception_ptr e = async_->error;
    async_->error = nullptr;
    std::rethrow_exception(e);
  }
  return waited;
}

std::string Checkpointer::save(const CheckpointParts& p, const TrainerProgress& progress,
                               bool background) {
  if (!config_.checkpoint.async) background = false;
  if (config_.checkpoint.async && !async_) async_ = std::make_unique<Async>();
  if (async_ && async_->writer.joinable()) {
    const std::string previous = async_->writing;
    const double waited = finish();
    if (waited >= 0.001) {
      logging::info("checkpoint ", previous, " was still being written when step_", progress.step,
                    "'s was due: waited ", logging::fixed(waited, 2), " s for it");
    }
  }
  if (!background) {
    Staged s = stage(p, progress, nullptr);
    write(s);
    barrier(p);
    return s.dir;
  }
  auto staged = std::make_shared<Staged>(stage(p, progress, &async_->buffers));
  async_->writing = staged->dir;
  async_->writer = std::thread([this, staged] {
    try {
      write(*staged);
    } catch (...) {
      async_->error = std::current_exception();
    }
  });
  return staged->dir;
}

std::optional<TrainerProgress> Checkpointer::restore(const CheckpointParts& p,
                                                     const std::string& resume) {
  if (resume == "never") return std::nullopt;
  if (resume != "auto") {
    std::error_code ec;
    DTRAIN_CHECK_AS(CheckpointError, fs::exists(resume, ec), "checkpoint '", resume,
                    "' does not exist; give a step_* directory of checkpoint.dir, or "
                    "checkpoint.resume: auto for the newest there");
    DTRAIN_CHECK_AS(CheckpointError, fs::exists(resume + "/COMPLETE", ec), "checkpoint '", resume,
                    "' is not a complete checkpoint (no COMPLETE file: its writer crashed, or "
                    "it is not a step_* directory); give one that has it, or "
                    "checkpoint.resume: auto");
    return restore_agreed(p, resume);
  }
  // auto: the newest complete checkpoint that reads back intact on every rank; a damaged one
  // (bad checksum, truncated, missing metadata) is kept for inspection and the next older is
  // tried.
  std::vector<int64_t> steps;
  if (rank_of(p) == 0 && enabled()) {
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(config_.checkpoint.dir, ec)) {
      const std::string name = e.path().filename().string();
      if (name.rfind("step_", 0) == 0 && fs::exists(e.path() / "COMPLETE", ec)) {
        steps.push_back(std::stoll(name.substr(5)));
      }
    }
    std::sort(steps.rbegin(), steps.rend());
  }
  const int64_t count = broadcast_value(p, static_cast<int64_t>(steps.size()));
  steps.resize(static_cast<size_t>(count));
  for (auto& step : steps) step = broadcast_value(p, step);
  std::string damaged, why;
  for (int64_t step : steps) {
    const std::string dir = config_.checkpoint.dir + "/" + step_name(step);
    try {
      auto progress = restore_agreed(p, dir);
      if (!damaged.empty()) {
        // Out of the way of this run's own save at that step, kept for inspection.
        const fs::path from(damaged);
        const std::string kept =
            (from.parent_path() / ("damaged_" + from.filename().string())).string();
        if (rank_of(p) == 0) {
          std::error_code ec;
          fs::remove_all(kept, ec);
          fs::rename(from, kept, ec);
        }
        logging::warn("checkpoint '", damaged, "' is damaged (", why, "); resumed from '", dir,
                      "', the newest intact one. The damaged one is kept as '", kept, "'.");
      }
      return progress;
    } catch (const CheckpointError& e) {
      logging::warn("checkpoint '", dir, "' cannot be resumed: ", message_of(e));
      if (damaged.empty()) {
        damaged = dir;
        why = e.what();
      }
    }
  }
  DTRAIN_CHECK_AS(CheckpointError, damaged.empty(), "no intact checkpoint in '",
                  config_.checkpoint.dir, "' to resume: the newest, '", damaged, "', failed: ", why,
                  ". Set checkpoint.resume: never to start afresh.");
  return std::nullopt;
}

std::optional<TrainerProgress> Checkpointer::restore_agreed(const CheckpointParts& p,
                                                            const std::string& dir) {
  try {
    return restore_from(p, dir);
  } catch (const AgreedCheckpointError&) {
    throw;
  } catch (const AgreedConfigError&) {
    throw;
  } catch (const ConfigError& e) {
    agree(p, e.what(), /*other_job=*/true);
    throw;
  } catch (const std::exception& e) {
    // Reading failed on this rank: the others learn it in agree(), where they wait before
    // changing anything.
    agree(p, e.what());
    throw;  // agree() threw already
  }
}

namespace {

// --- restore, step by step ------------------------------------------------------------------

// A checkpoint directory being read: its verified metadata, and its files by name, each
// verified as it is read.
struct Source {
  std::string dir;
  ckpt::Meta meta;

  c10::IValue load(const std::string& name) const {
    DTRAIN_CHECK_AS(CheckpointError, meta.files.count(name), "checkpoint '", dir,
                    "': meta.json lists no '", name, "'");
    return ckpt::unpickle(ckpt::read_file(dir, meta.files.at(name)), dir + "/" + name);
  }
  c10::impl::GenericDict dict(const std::string& name) const {
    return as_dict(load(name), dir + "/" + name);
  }
};

// What a restore changes, read and checked on this rank before anything is: per model
// parameter its new value (full, or this rank's parts under FSDP), buffers by name, the
// optimizer's state in its own order, the scaler's, and this rank's RNG and numerics state
// (when the world size is the one saved).
struct Loaded {
  std::vector<at::Tensor> values;
  std::map<std::string, at::Tensor> buffers;
  std::vector<ParamState> optimizer_states;
  c10::impl::GenericDict scaler = tensor_dict();
  std::optional<c10::impl::GenericDict> rank_state;
};

// The model's parameters as the restore addresses them (FSDP: its fp32 masters).
using Params = std::vector<std::pair<std::string, at::Tensor>>;

// Full optim.pt -> per model parameter, its state (full values). Saved names map the state
// back to the parameter of that name, whatever order this optimizer's groups are in.
std::vector<ParamState> read_full_optimizer_state(const Source& src, const Params& params,
                                                  const std::vector<int64_t>& slots_now) {
  auto optim = src.dict("optim.pt");
  auto state = as_dict(optim.at("state"), src.dir + "/optim.pt state");
  std::map<std::string, int64_t> saved_index;  // name -> saved index, where names are saved
  bool named = false;
  if (optim.contains("param_groups") && optim.at("param_groups").isList()) {
    named = true;
    for (const auto& g : optim.at("param_groups").toListRef()) {
      if (!g.isGenericDict() || !g.toGenericDict().contains("param_names")) {
        named = false;
        break;
      }
      const auto ids = g.toGenericDict().at("params").toListRef();
      const auto names = g.toGenericDict().at("param_names").toListRef();
      for (size_t k = 0; k < ids.size() && k < names.size(); ++k) {
        saved_index[names[k].toStringRef()] = ids[k].toInt();
      }
    }
  }
  std::map<int64_t, ParamState> saved;
  for (const auto& kv : state) {
    saved[kv.key().toInt()] = tensors_of(as_dict(kv.value(), "optimizer state"));
  }
  std::vector<ParamState> out(params.size());  // model order (model_parameters)
  for (size_t i = 0; i < params.size(); ++i) {
    if (slots_now[i] < 0) continue;
    int64_t j = slots_now[i];
    if (named) {
      auto it = saved_index.find(params[i].first);
      DTRAIN_CHECK_AS(CheckpointError, it != saved_index.end(), "checkpoint '", src.dir,
                      "/optim.pt': its optimizer did not hold parameter '", params[i].first,
                      "', which this optimizer does. Nothing was loaded.");
      j = it->second;
    }
    if (saved.count(j)) out[i] = saved.at(j);
  }
  return out;
}

// A full checkpoint (model.pt, optim.pt) into any strategy: under FSDP each rank keeps its
// parts of the full values.
void read_full(const CheckpointParts& p, const Source& src, const Params& params,
               const std::vector<int64_t>& slots_now, size_t held_now, Loaded& out) {
  auto model = tensors_of(src.dict("model.pt"));
  std::map<std::string, std::vector<int64_t>> fsdp_shapes;
  if (p.fsdp != nullptr) {
    for (const auto& l : p.fsdp->layouts()) {
      for (const auto& e : l.params) fsdp_shapes[e.name] = e.shape;
    }
  }
  std::vector<Wanted> want;
  for (const auto& [name, t] : params) {
    const std::vector<int64_t> local = p.fsdp != nullptr ? fsdp_shapes[name] : t.sizes().vec();
    want.push_back({name, p.tp != nullptr ? p.tp->full_shape(name, local) : local, at::kFloat});
  }
  for (const auto& item : p.module->named_buffers()) {
    want.push_back({item.key(), item.value().sizes().vec(), item.value().scalar_type()});
  }
  std::vector<at::Tensor> matched = match(model, want, src.dir + "/model.pt");
  std::vector<at::Tensor> full(matched.begin(), matched.begin() + params.size());
  for (size_t i = 0; i < full.size(); ++i) {
    full[i] = full[i].to(at::kFloat);
    if (p.tp != nullptr) full[i] = p.tp->slice(params[i].first, full[i]).contiguous();
  }
  size_t b = params.size();
  for (const auto& item : p.module->named_buffers()) out.buffers[item.key()] = matched[b++];
  out.values = p.fsdp != nullptr ? p.fsdp->local_parts(full) : full;
  if (p.optimizer == nullptr || !src.meta.files.count("optim.pt")) return;
  std::vector<ParamState> states = read_full_optimizer_state(src, params, slots_now);
  if (p.tp != nullptr) {  // whole -> this rank's slices (not the step count)
    for (size_t i = 0; i < params.size(); ++i) {
      for (const auto& key : src.meta.optimizer_keys) {
        auto it = states[i].find(key);
        if (it != states[i].end()) {
          it->second = p.tp->slice(params[i].first, it->second).contiguous();
        }
      }
    }
  }
  if (p.fsdp != nullptr) {
    // Full state -> this rank's parts, per key.
    for (const auto& key : src.meta.optimizer_keys) {
      std::vector<at::Tensor> fulls;
      for (size_t i = 0; i < params.size(); ++i) {
        fulls.push_back(states[i].count(key) ? states[i].at(key)
                                             : at::zeros(fsdp_shapes[params[i].first]));
      }
      auto parts = p.fsdp->local_parts(fulls);
      for (size_t i = 0; i < params.size(); ++i) {
        if (states[i].count(key)) states[i][key] = parts[i];
      }
    }
  }
  out.optimizer_states = to_optimizer_order(states, slots_now, held_now);
}

// A parameter's full shape from one tp rank's slice of it (cut on `dim` into `tp` parts).
std::vector<int64_t> full_of(std::vector<int64_t> shape, int64_t dim, int64_t tp) {
  if (dim >= 0) shape[static_cast<size_t>(dim)] *= tp;
  return shape;
}

// Sharded checkpoints under FSDP need the same FSDP units (the world size and the tp degree
// may differ: the parameters' whole shapes must be the same).
void check_same_units(const CheckpointParts& p, const Source& src) {
  const auto layouts = p.fsdp->layouts();
  const std::vector<ckpt::UnitMeta>& units = src.meta.units;
  DTRAIN_CHECK_AS(CheckpointError, units.size() == layouts.size(), "checkpoint '", src.dir,
                  "' has ", units.size(), " FSDP units, this model ", layouts.size(),
                  ": resume with the same wrap policy. Nothing was loaded.");
  const int64_t tp_now = p.tp != nullptr ? p.tp->size() : 1;
  for (size_t u = 0; u < layouts.size(); ++u) {
    const std::vector<ckpt::UnitParamMeta>& ps = units[u].params;
    DTRAIN_CHECK_AS(CheckpointError, ps.size() == layouts[u].params.size(), "checkpoint '", src.dir,
                    "': unit '", layouts[u].name, "' holds ", ps.size(), " parameters there, ",
                    layouts[u].params.size(), " here. Nothing was loaded.");
    for (size_t i = 0; i < ps.size(); ++i) {
      const auto& e = layouts[u].params[i];
      const int64_t dim_now = p.tp != nullptr ? p.tp->sliced_dim(e.name) : -1;
      const auto then = full_of(ps[i].shape, ps[i].tp_dim, src.meta.tp);
      const auto now = full_of(e.shape, dim_now, tp_now);
      DTRAIN_CHECK_AS(CheckpointError, ps[i].name == e.name && then == now, "checkpoint '", src.dir,
                      "': parameter '", ps[i].name, "' of shape ", at::IntArrayRef(then),
                      " does not match the model's '", e.name, "' of shape ", at::IntArrayRef(now),
                      ". Nothing was loaded.");
    }
  }
}

// Reads a sharded checkpoint's parameters and optimizer state at any mesh: elements of this
// run's local tensors (its tp slice, or the whole tensor without TP) from whichever saving
// ranks' shard files hold them. A saved tp slice is one rank's chunk of the whole tensor on
// `tp_dim`; this rank's chunk (of another count of chunks) maps onto runs of elements that lie
// in one saved chunk and are consecutive in both layouts; each run is then found in the saving
// run's FSDP layout (sharding::locate) and read from the file of a rank with that tp rank and
// shard rank.
class ShardedReader {
 public:
  ShardedReader(const CheckpointParts& p, const Source& src)
      : src_(src),
        tp_now_(p.tp != nullptr ? p.tp->size() : 1),
        tp_rank_(p.tp != nullptr ? p.tp->rank() : 0) {
    const ckpt::Meta& m = src.meta;
    for (size_t u = 0; u < m.units.size(); ++u) {
      for (size_t i = 0; i < m.units[u].params.size(); ++i) {
        where_[m.units[u].params[i].name] = {static_cast<int64_t>(u), static_cast<int64_t>(i)};
      }
    }
    for (size_t w = 0; w < m.shard_ranks.size(); ++w) {
      const int64_t t = m.tp_ranks.empty() ? 0 : m.tp_ranks[w];
      file_of_.emplace(std::make_pair(t, m.shard_ranks[w]), static_cast<int>(w));
    }
    if (p.tp != nullptr) {
      for (const auto& [name, place] : where_) dim_now_[name] = p.tp->sliced_dim(name);
    }
  }

  // The saved parameter `name`: its unit and index there.
  std::pair<int64_t, int64_t> place(const std::string& name) const {
    auto it = where_.find(name);
    DTRAIN_CHECK_AS(CheckpointError, it != where_.end(), "checkpoint '", src_.dir,
                    "': it holds no parameter '", name, "'. Nothing was loaded.");
    return it->second;
  }

  // Elements [begin, begin + count) of this run's local `name` (of `shape`), of `what`
  // ("params" or an optimizer key), fp32 on the CPU.
  at::Tensor read(const std::string& name, const std::vector<int64_t>& shape,
                  const std::string& what, int64_t begin, int64_t count) {
    const auto [unit, param] = place(name);
    const ckpt::UnitParamMeta& e = src_.meta.units[static_cast<size_t>(unit)].params[param];
    auto dn = dim_now_.find(name);
    const int64_t dim_now = dn == dim_now_.end() ? -1 : dn->second;
    DTRAIN_CHECK_AS(CheckpointError, e.tp_dim < 0 || dim_now < 0 || e.tp_dim == dim_now,
                    "checkpoint '", src_.dir, "': '", name, "' was cut on dim ", e.tp_dim,
                    " and is cut on dim ", dim_now, " here. Nothing was loaded.");
    const int64_t dim = e.tp_dim >= 0 ? e.tp_dim : dim_now;
    const int64_t tp_then = e.tp_dim >= 0 ? src_.meta.tp : 1, tp_now = dim_now >= 0 ? tp_now_ : 1,
                  rank_now = dim_now >= 0 ? tp_rank_ : 0;
    at::Tensor out = at::empty({count}, at::kFloat);
    if (dim < 0) {  // whole on every rank: tp rank 0's copy
      read_saved(unit, param, what, 0, begin, count, out);
      return out;
    }
    int64_t inner = 1;
    for (size_t d = static_cast<size_t>(dim) + 1; d < shape.size(); ++d) inner *= shape[d];
    const int64_t full = shape[static_cast<size_t>(dim)] * tp_now;
    const int64_t chunk_now = full / tp_now, chunk_then = full / tp_then;
    for (int64_t i = begin; i < begin + count;) {
      const int64_t outer = i / (chunk_now * inner), rem = i % (chunk_now * inner);
      const int64_t c_now = rem / inner, in = rem % inner;
      const int64_t c_full = rank_now * chunk_now + c_now;
      const int64_t rank_then = c_full / chunk_then, c_then = c_full % chunk_then;
      const int64_t at_then = outer * chunk_then * inner + c_then * inner + in;
      const int64_t n = std::min({begin + count - i, (chunk_now - c_now) * inner - in,
                                  (chunk_then - c_then) * inner - in});
      read_saved(unit, param, what, rank_then, at_then, n, out.narrow(0, i - begin, n));
      i += n;
    }
    return out;
  }

  const c10::impl::GenericDict& file(int64_t tp_rank, int64_t shard_rank) {
    auto it = file_of_.find({tp_rank, shard_rank});
    DTRAIN_CHECK_AS(CheckpointError, it != file_of_.end(), "checkpoint '", src_.dir,
                    "': no rank's file holds tp rank ", tp_rank, "'s shard ", shard_rank);
    if (!cache_.count(it->second))
      cache_.emplace(it->second, src_.dict(rank_file("shard", it->second)));
    return cache_.at(it->second);
  }

 private:
  // Elements [begin, begin + count) of saved parameter (unit, param) as tp rank `tp_rank`
  // held it, into `out`.
  void read_saved(int64_t unit, int64_t param, const std::string& what, int64_t tp_rank,
                  int64_t begin, int64_t count, at::Tensor out) {
    const ckpt::UnitMeta& saved = src_.meta.units[static_cast<size_t>(unit)];
    const ckpt::UnitParamMeta& e = saved.params[static_cast<size_t>(param)];
    const auto layout = choice_from_name<sharding::ShardLayout>(saved.layout).value();
    const sharding::ParamPlace place{e.offset, e.numel, e.chunk, e.shard_at};
    for (int64_t i = begin; i < begin + count;) {
      const sharding::Located l = sharding::locate(layout, place, saved.shard_size, i);
      const int64_t n = std::min(begin + count - i, l.run);
      const auto& f = file(tp_rank, l.rank);
      const std::string key = saved.name + "|" + what;
      DTRAIN_CHECK_AS(CheckpointError, f.contains(key), "checkpoint '", src_.dir,
                      "': a shard file lacks '", key, "'");
      at::Tensor flat = f.at(key).toTensor();
      out.narrow(0, i - begin, n).copy_(flat.narrow(0, l.pos, n));
      i += n;
    }
  }

  const Source& src_;
  int64_t tp_now_, tp_rank_;
  std::map<std::string, std::pair<int64_t, int64_t>> where_;
  std::map<std::string, int64_t> dim_now_;
  std::map<std::pair<int64_t, int64_t>, int> file_of_;
  std::map<int, c10::impl::GenericDict> cache_;
};

// Buffers from rank 0's file, and the optimizer's steps (per saved parameter, in the saving
// run's order: its units' parameters in turn).
void read_sharded_rest(const CheckpointParts& p, const Source& src, ShardedReader& reader,
                       Loaded& out) {
  std::map<std::string, at::Tensor> saved;
  for (const auto& [key, t] : tensors_of(reader.file(0, 0))) {
    if (key.rfind(kBufferPrefix, 0) == 0) saved[key.substr(sizeof(kBufferPrefix) - 1)] = t;
  }
  for (const auto& item : p.module->named_buffers()) {
    out.buffers[item.key()] =
        match_one(saved, {item.key(), item.value().sizes().vec(), item.value().scalar_type()},
                  src.dir + "/" + rank_file("shard", 0));
  }
}

// The saved optimizer step of `name` (-1: no state), from rank 0's file.
double saved_step(const Source& src, ShardedReader& reader, const std::string& name) {
  int64_t index = 0;
  const auto [unit, param] = reader.place(name);
  for (int64_t u = 0; u < unit; ++u) {
    index += static_cast<int64_t>(src.meta.units[static_cast<size_t>(u)].params.size());
  }
  return reader.file(0, 0).at("optim_step").toTensor()[index + param].item<double>();
}

// A sharded checkpoint into FSDP: this rank's new ranges read from whichever old ranks'
// shard files hold them (resharding, and re-slicing over another tp degree), buffers from
// rank 0's file.
void read_sharded(const CheckpointParts& p, const Source& src, const Params& params,
                  const std::vector<int64_t>& slots_now, size_t held_now, Loaded& out) {
  check_same_units(p, src);
  const auto layouts = p.fsdp->layouts();
  ShardedReader reader(p, src);
  const c10::Device device = p.fsdp->all_parameters().front().second.device();
  auto part_reader = [&](const std::string& what) {
    return [&, what](int64_t unit, int64_t param, int64_t begin, int64_t count) {
      const auto& e = layouts[static_cast<size_t>(unit)].params[static_cast<size_t>(param)];
      return reader.read(e.name, e.shape, what, begin, count).to(device);
    };
  };
  out.values = p.fsdp->parts_from(part_reader("params"));
  read_sharded_rest(p, src, reader, out);
  if (p.optimizer == nullptr || src.meta.optimizer_keys.empty()) return;
  std::vector<ParamState> states(params.size());
  for (const auto& key : src.meta.optimizer_keys) {
    auto parts = p.fsdp->parts_from(part_reader(key));
    for (size_t i = 0; i < params.size(); ++i) {
      if (saved_step(src, reader, params[i].first) >= 0) states[i][key] = parts[i];
    }
  }
  for (size_t i = 0; i < params.size(); ++i) {
    const double s = saved_step(src, reader, params[i].first);
    if (s >= 0) states[i]["step"] = at::scalar_tensor(s, at::kFloat);
  }
  out.optimizer_states = to_optimizer_order(states, slots_now, held_now);
}

// A sharded checkpoint into a run without FSDP (tensor parallelism over the whole world, or
// one process): each parameter's local tensor whole, put together from the shard files.
void read_sharded_whole(const CheckpointParts& p, const Source& src, const Params& params,
                        const std::vector<int64_t>& slots_now, size_t held_now, Loaded& out) {
  ShardedReader reader(p, src);
  const int64_t tp_now = p.tp != nullptr ? p.tp->size() : 1;
  auto whole = [&](const std::string& name, const at::Tensor& like, const std::string& what) {
    const std::vector<int64_t> shape = like.sizes().vec();
    const auto [unit, param] = reader.place(name);
    const ckpt::UnitParamMeta& e = src.meta.units[static_cast<size_t>(unit)].params[param];
    const auto then = full_of(e.shape, e.tp_dim, src.meta.tp);
    const auto now = full_of(shape, p.tp != nullptr ? p.tp->sliced_dim(name) : -1, tp_now);
    DTRAIN_CHECK_AS(CheckpointError, then == now, "checkpoint '", src.dir, "': parameter '", name,
                    "' of shape ", at::IntArrayRef(then), " does not match the model's of shape ",
                    at::IntArrayRef(now), ". Nothing was loaded.");
    return reader.read(name, shape, what, 0, like.numel()).view(shape).to(like.device());
  };
  for (const auto& [name, t] : params) out.values.push_back(whole(name, t, "params"));
  read_sharded_rest(p, src, reader, out);
  if (p.optimizer == nullptr || src.meta.optimizer_keys.empty()) return;
  std::vector<ParamState> states(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const double s = saved_step(src, reader, params[i].first);
    if (s < 0) continue;
    for (const auto& key : src.meta.optimizer_keys) {
      states[i][key] = whole(params[i].first, params[i].second, key);
    }
    states[i]["step"] = at::scalar_tensor(s, at::kFloat);
  }
  out.optimizer_states = to_optimizer_order(states, slots_now, held_now);
}

// This rank's RNG states and numerics history back (rank_<r>.pt).
void apply_rank_state(const CheckpointParts& p, const c10::impl::GenericDict& mine) {
  at::Generator cpu = at::detail::getDefaultCPUGenerator();  // a handle: shares the state
  cpu.set_state(mine.at("rng_cpu").toTensor());
  auto cuda = mine.at("rng_cuda").toList();
  for (int i = 0; i < std::min<int>(static_cast<int>(cuda.size()), cuda_devices()); ++i) {
    at::Generator g = at::globalContext().defaultGenerator(
        c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i)));
    g.set_state(cuda.get(i).toTensor());
  }
  if (p.monitor != nullptr && mine.contains("scale_history")) {
    at::Tensor h = mine.at("scale_history").toTensor();
    std::vector<std::pair<int64_t, double>> history;
    for (int64_t i = 0; i < h.size(0); ++i) {
      history.push_back({static_cast<int64_t>(h[i][0].item<double>()), h[i][1].item<double>()});
    }
    p.monitor->restore_scale_history(std::move(history));
  }
  if (p.ddp != nullptr && mine.contains("ddp_bucket_order")) {
    at::Tensor o = mine.at("ddp_bucket_order").toTensor().to(at::kLong).contiguous();
    p.ddp->restore_rebuilt_order(
        std::vector<int64_t>(o.data_ptr<int64_t>(), o.data_ptr<int64_t>() + o.numel()));
  }
}

// Everything read, on every rank (after agree()): the parts take it.
void apply(const CheckpointParts& p, const Params& params, const Loaded& in) {
  if (p.fsdp != nullptr) {
    p.fsdp->set_parameters(in.values);
  } else {
    for (size_t i = 0; i < params.size(); ++i) params[i].second.copy_(in.values[i]);
  }
  for (const auto& item : p.module->named_buffers()) {
    if (in.buffers.count(item.key())) item.value().copy_(in.buffers.at(item.key()));
  }
  if (p.optimizer != nullptr && !in.optimizer_states.empty()) {
    import_optimizer_state(*p.optimizer, in.optimizer_states);
  }
  if (p.scaler != nullptr && (in.scaler.size() > 0 || p.scaler->is_enabled())) {
    p.scaler->load_state_dict(in.scaler);
  }
  if (in.rank_state) apply_rank_state(p, *in.rank_state);
}

}  // namespace

// COMPLETE -> meta.json (verified) -> every file (verified as it is read) -> checked against
// the model -> agree() -> applied. Nothing changes until every rank has read its part.
void Checkpointer::check_same_job(
    const CheckpointParts& p, const std::string& dir,
    const std::map<std::string, std::string>& saved_job,
    const std::vector<std::pair<std::string, std::vector<int64_t>>>& saved_params) {
  const auto& cc = config_.checkpoint;
  auto value = [](const std::map<std::string, std::string>& m, const std::string& k) {
    auto it = m.find(k);
    return it == m.end() ? std::string() : it->second;
  };
  // Data and tokenizer: compared where both runs recorded them.
  for (const char* key : {"tokenizer", "data"}) {
    const std::string then = value(saved_job, key), now = value(job_, key);
    if (then.empty() || now.empty() || then == now) continue;
    const std::string what_then = value(saved_job, std::string(key) + "_what"),
                      what_now = value(job_, std::string(key) + "_what");
    const std::string said =
        std::string(key) == "data"
            ? "was trained on other data than this run reads: then " +
                  (what_then.empty() ? std::string() : what_then + ", ") + then + "; now " +
                  (what_now.empty() ? std::string() : what_now + ", ") + now
            : "was trained on tokens of another tokenizer: then " + then + "; now " + now;
    if (cc.allow_data_change) {
      data_changed_ = true;
      if (rank_of(p) == 0) {
        logging::warn("checkpoint '", dir, "' ", said,
                      ". Continuing on this run's (checkpoint.allow_data_change: true).");
      }
      continue;
    }
    DTRAIN_FAIL(ConfigError, config_.source, ": checkpoint '", dir, "' ", said,
                ". Resume it on the data it was trained on; to continue on this data on purpose, "
                "set checkpoint.allow_data_change: true; to start afresh, checkpoint.resume: "
                "never (or another checkpoint.dir).");
  }
  // The model: every parameter's name and shape, before any file is read.
  ckpt::Meta here;
  describe_model(p, /*sharded=*/false, here);
  std::map<std::string, std::vector<int64_t>> now, then(saved_params.begin(), saved_params.end());
  for (const auto& pm : here.parameters) now[pm.name] = pm.shape;
  std::string first;
  int differ = 0, missing = 0, extra = 0;
  auto shape = [](const std::vector<int64_t>& v) {
    std::string out = "[";
    for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
    return out + "]";
  };
  for (const auto& pm : here.parameters) {  // in the model's order: the first one named
    const std::string& name = pm.name;
    const std::vector<int64_t>& s = pm.shape;
    auto it = then.find(name);
    if (it == then.end()) {
      if (missing++ == 0 && first.empty()) {
        first = "this run's '" + name + "' " + shape(s) + " is not in it";
      }
    } else if (it->second != s) {
      if (differ++ == 0 && first.empty()) {
        first = "'" + name + "' is " + shape(it->second) + " there and " + shape(s) + " here";
      }
    }
  }
  for (const auto& [name, s] : saved_params) {
    if (now.count(name) == 0 && extra++ == 0 && first.empty()) {
      first = "it holds '" + name + "' " + shape(s) + ", which this model has not";
    }
  }
  if (first.empty()) return;
  DTRAIN_FAIL(ConfigError, config_.source, ": checkpoint '", dir,
              "' holds another model than this run's: ", first, " (", differ,
              " parameter(s) of another shape, ", missing, " missing, ", extra,
              " extra). Resume it with the model.* settings it was saved with, or start afresh: "
              "checkpoint.resume: never (or another checkpoint.dir).");
}

std::optional<TrainerProgress> Checkpointer::restore_from(const CheckpointParts& p,
                                                          const std::string& dir) {
  const int rank = rank_of(p), world = world_of(p);
  const Source src{dir, ckpt::read_meta(dir)};
  const ckpt::Meta& meta = src.meta;
  std::vector<std::pair<std::string, std::vector<int64_t>>> saved_params;
  for (const auto& pm : meta.parameters) saved_params.emplace_back(pm.name, pm.shape);
  check_same_job(p, dir, meta.job, saved_params);
  DTRAIN_CHECK_AS(CheckpointError,
                  meta.mode == "full" || p.fsdp != nullptr || p.tp != nullptr || meta.tp > 1,
                  "checkpoint '", dir, "' is sharded (FSDP), but this run's strategy is ",
                  name_of(config_.parallel.strategy),
                  "; resume it with parallel.strategy: fsdp, or save it with checkpoint.format: "
                  "full");
  c10::NoGradGuard no_grad;
  Params params;
  if (p.fsdp != nullptr) {
    params = p.fsdp->all_parameters();
  } else {
    for (const auto& item : p.module->named_parameters())
      params.push_back({item.key(), item.value()});
  }
  // Where each model parameter sits in this optimizer (optimizer_slots).
  const std::vector<int64_t> slots_now =
      p.optimizer == nullptr ? std::vector<int64_t>{} : optimizer_slots(p);
  const size_t held_now = p.optimizer == nullptr ? 0 : optimizer_parameters(*p.optimizer).size();
  Loaded loaded;
  if (meta.mode == "full") {
    read_full(p, src, params, slots_now, held_now, loaded);
  } else if (p.fsdp != nullptr) {
    read_sharded(p, src, params, slots_now, held_now, loaded);
  } else {
    read_sharded_whole(p, src, params, slots_now, held_now, loaded);
  }
  if (p.scaler != nullptr && meta.files.count("scaler.pt")) loaded.scaler = src.dict("scaler.pt");
  if (meta.world_size == world) loaded.rank_state = src.dict(rank_file("rank", rank));

  agree(p, "");
  apply(p, params, loaded);
  if (meta.world_size != world) {
    logging::warn("checkpoint '", dir, "' was written at ", meta.world_size,
                  " ranks, this run has ", world,
                  ": resharded; random-number generators keep this run's seeding");
  }
  TrainerProgress progress;
  progress.step = meta.step;
  progress.skipped_steps = meta.skipped_steps;
  progress.lr = meta.lr;
  progress.consecutive_skips = meta.consecutive_skips;
  progress.nonfinite_run = meta.nonfinite_run;
  progress.spike = meta.spike;
  // On other data (checkpoint.allow_data_change) the position means nothing: the run goes on
  // from its step alone.
  if (!data_changed_) progress.data = meta.data;
  progress.data_step = meta.data_step;
  restored_dir_ = dir;
  logging::info("resumed from ", dir, " at step ", progress.step, " (", meta.mode, ", written at ",
                meta.world_size, " rank(s))");
  return progress;
}

std::vector<std::pair<std::string, at::Tensor>> read_model_tensors(const std::string& dir) {
  const Source src{dir, ckpt::read_meta(dir)};
  std::vector<std::pair<std::string, at::Tensor>> out;
  if (src.meta.mode == "full") {
    const auto dict = src.dict("model.pt");
    for (const auto& kv : dict) {
      DTRAIN_CHECK_AS(CheckpointError, kv.key().isString() && kv.value().isTensor(), "checkpoint '",
                      dir, "': model.pt holds something other than named tensors");
      out.emplace_back(kv.key().toStringRef(), kv.value().toTensor());
    }
    return out;
  }
  // Sharded: each parameter put together whole from the shard files as meta.json lays it out
  // (under tensor parallelism, from every tp rank's slices).
  ShardedReader reader(CheckpointParts{}, src);
  for (const ckpt::UnitMeta& unit : src.meta.units) {
    for (const ckpt::UnitParamMeta& e : unit.params) {
      const auto shape = full_of(e.shape, e.tp_dim, src.meta.tp);
      const int64_t numel = c10::multiply_integers(shape);
      out.emplace_back(e.name, reader.read(e.name, shape, "params", 0, numel).view(shape));
    }
  }
  for (const auto& [key, t] : tensors_of(reader.file(0, 0))) {
    if (key.rfind(kBufferPrefix, 0) == 0)
      out.emplace_back(key.substr(sizeof(kBufferPrefix) - 1), t);
  }
  return out;
}

}  // namespace dtrain::framework
