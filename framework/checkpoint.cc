#include "framework/checkpoint.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <sys/stat.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <future>
#include <map>
#include <sstream>

#include "amp/grad_scaler.h"
#include "amp/numerics.h"
#include "comm/communicator.h"
#include "comm/types.h"
#include "core/error.h"
#include "core/logging.h"
#include "framework/checkpoint_io.h"
#include "framework/checkpoint_meta.h"
#include "framework/optim_state.h"
#include "sharding/fsdp_state.h"

namespace dtrain::framework {
namespace {

namespace fs = std::filesystem;
using ckpt::FileInfo;

constexpr const char* kFormat = "dtrain-checkpoint";
constexpr int kVersion = 1;
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

std::string quote(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

std::string shape_json(at::IntArrayRef shape) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  return os.str() + "]";
}

std::string file_json(const FileInfo& f) {
  return "{\"name\": " + quote(f.name) + ", \"bytes\": " + std::to_string(f.bytes) +
         ", \"xxh64\": \"" + ckpt::hex(f.checksum) + "\"}";
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

// Collective: every rank says whether reading failed (`error`, empty when not). When any did,
// every rank throws the first failing rank's message, so each one reports the damaged file
// rather than a connection its peer closed.
void agree(const CheckpointParts& p, const std::string& error) {
  if (!p.comm || p.comm->size() == 1) {
    if (!error.empty()) throw AgreedCheckpointError(error);
    return;
  }
  const std::vector<int64_t> failed = gather_values(p, {error.empty() ? 0 : 1});
  const auto it = std::find(failed.begin(), failed.end(), 1);
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

std::string Checkpointer::save(const CheckpointParts& p, const TrainerProgress& progress) {
  const auto& cc = config_.checkpoint;
  const int rank = rank_of(p), world = world_of(p);
  const bool sharded = p.fsdp != nullptr && cc.format != "full";
  const std::string dir = cc.dir + "/" + step_name(progress.step);
  if (rank == 0) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    DTRAIN_CHECK_AS(CheckpointError, !ec, "checkpoint.dir: cannot create '", dir,
                    "': ", ec.message());
    // Saving into a step folder that exists (a run restarted from an older checkpoint passes
    // this step again): its COMPLETE marker goes first, so no marker ever stands over files
    // being rewritten, and a killed writer's temporary files with it.
    fs::remove(fs::path(dir) / "COMPLETE", ec);
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      if (e.path().filename().string().find(".tmp.") != std::string::npos) {
        fs::remove(e.path(), ec);
      }
    }
    ckpt::sync_dir(dir);
    ckpt::sync_dir(cc.dir);
  }
  barrier(p);
  c10::NoGradGuard no_grad;

  // Every rank: its RNG states and numerics history, and its shard (sharded mode).
  std::vector<FileInfo> mine;
  {
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
    mine.push_back(ckpt::write_pickle(dir, rank_file("rank", rank), d));
  }
  // Optimizer state in the model's order (model_parameters).
  const std::vector<int64_t> slots =
      p.optimizer == nullptr ? std::vector<int64_t>{} : optimizer_slots(p);
  std::vector<ParamState> states =
      p.optimizer == nullptr ? std::vector<ParamState>{}
                             : to_model_order(export_optimizer_state(*p.optimizer), slots);
  std::vector<std::string> keys;
  for (const auto& k : kStateKeys) {
    if (has_key(states, k)) keys.push_back(k);
  }
  if (sharded) {
    auto d = tensor_dict();
    std::vector<at::Tensor> masters;
    for (const auto& m : p.fsdp->all_parameters()) masters.push_back(m.second);
    const auto layouts = p.fsdp->layouts();
    auto put = [&](const std::string& what, const std::vector<at::Tensor>& parts) {
      auto flats = p.fsdp->flat_shards(parts);
      for (size_t u = 0; u < flats.size(); ++u)
        d.insert(layouts[u].name + "|" + what, flats[u].cpu());
    };
    put("params", masters);
    for (const auto& k : keys) put(k, key_parts(states, k));
    std::vector<double> steps;
    for (const auto& s : states)
      steps.push_back(s.count("step") ? s.at("step").item<double>() : -1);
    d.insert("optim_step", at::tensor(steps, at::kDouble));
    // Buffers are not sharded: every rank writes its own, and a restore takes rank 0's (the
    // values a DDP or FSDP run broadcasts at construction), at any world size.
    for (const auto& item : p.module->named_buffers()) {
      d.insert(kBufferPrefix + item.key(), item.value().detach().cpu());
    }
    mine.push_back(ckpt::write_pickle(dir, rank_file("shard", rank), d));
  }

  // Rank 0: the full model and optimizer (gathered: every rank takes part), the scaler.
  std::vector<FileInfo> shared;
  if (!sharded) {
    // Rank 0 writes model.pt on a thread while every rank gathers the optimizer state.
    auto tensors = model_tensors(p);
    std::future<FileInfo> model_file;
    if (rank == 0) {
      auto model = tensor_dict();
      for (const auto& t : tensors) model.insert(t.name, t.tensor.cpu());
      model_file = std::async(std::launch::async,
                              [&dir, model] { return ckpt::write_pickle(dir, "model.pt", model); });
    }
    std::vector<std::vector<at::Tensor>> full_state(keys.size());
    if (p.fsdp != nullptr) {
      for (size_t k = 0; k < keys.size(); ++k) {
        full_state[k] = p.fsdp->gather_full(key_parts(states, keys[k]));
      }
    }
    if (rank == 0) {
      if (p.optimizer != nullptr) {
        // PyTorch's layout: state keyed by the optimizer's parameter index, and each group's
        // parameter names (which a restore matches by).
        c10::impl::GenericDict state(c10::AnyType::get(), c10::AnyType::get());
        const auto model = model_parameters(p);
        std::vector<std::string> names(optimizer_parameters(*p.optimizer).size());
        for (size_t i = 0; i < states.size(); ++i) {
          if (slots[i] < 0) continue;
          names[static_cast<size_t>(slots[i])] = model[i].first;
          auto entry = tensor_dict();
          if (states[i].count("step")) entry.insert("step", states[i].at("step").cpu());
          for (size_t k = 0; k < keys.size(); ++k) {
            if (!states[i].count(keys[k])) continue;
            entry.insert(keys[k],
                         p.fsdp != nullptr ? full_state[k][i].cpu() : states[i].at(keys[k]).cpu());
          }
          if (entry.size() > 0) state.insert(slots[i], entry);
        }
        auto optim = tensor_dict();
        optim.insert("state", state);
        optim.insert("param_groups", optimizer_param_groups(*p.optimizer, names));
        shared.push_back(ckpt::write_pickle(dir, "optim.pt", optim));
      }
      shared.insert(shared.begin(), model_file.get());
    }
  }
  if (rank == 0 && p.scaler != nullptr) {
    shared.push_back(ckpt::write_pickle(dir, "scaler.pt", p.scaler->state_dict()));
  }

  // Every rank's files, then the metadata, then COMPLETE (rank 0).
  std::vector<int64_t> sizes;
  for (size_t i = 0; i < 2; ++i) {
    sizes.push_back(i < mine.size() ? static_cast<int64_t>(mine[i].bytes) : -1);
    sizes.push_back(i < mine.size() ? static_cast<int64_t>(mine[i].checksum) : 0);
  }
  const std::vector<int64_t> all = gather_values(p, sizes);
  // Each rank's shard rank (HYBRID_SHARD repeats them): which file holds which slice.
  const std::vector<int64_t> shard_ranks =
      gather_values(p, {p.fsdp != nullptr ? p.fsdp->layouts().front().shard_rank : 0});
  if (rank == 0) {
    std::ostringstream m;
    m << "{\"format\": " << quote(kFormat) << ", \"version\": " << kVersion
      << ", \"step\": " << progress.step << ", \"world_size\": " << world
      << ", \"strategy\": " << quote(config_.parallel.strategy)
      << ", \"mode\": " << quote(sharded ? "sharded" : "full")
      << ",\n \"trainer\": {\"step\": " << progress.step
      << ", \"skipped_steps\": " << progress.skipped_steps << ", \"lr\": " << progress.lr
      << ", \"consecutive_skips\": " << progress.consecutive_skips
      << ", \"nonfinite_run\": " << progress.nonfinite_run
      << ", \"data\": \"a function of the step\"},\n";
    m << " \"parameters\": [";
    if (p.fsdp != nullptr) {
      bool first = true;
      for (const auto& l : p.fsdp->layouts()) {
        for (const auto& e : l.params) {
          m << (first ? "" : ", ") << "{\"name\": " << quote(e.name)
            << ", \"shape\": " << shape_json(e.shape) << ", \"dtype\": \"fp32\"}";
          first = false;
        }
      }
    } else {
      bool first = true;
      for (const auto& item : p.module->named_parameters()) {
        m << (first ? "" : ", ") << "{\"name\": " << quote(item.key())
          << ", \"shape\": " << shape_json(item.value().sizes())
          << ", \"dtype\": " << quote(comm::dtype_name(item.value().scalar_type())) << "}";
        first = false;
      }
    }
    m << "],\n \"optimizer_keys\": [";
    for (size_t k = 0; k < keys.size(); ++k) m << (k ? ", " : "") << quote(keys[k]);
    m << "],\n";
    if (sharded) {
      m << " \"units\": [";
      const auto layouts = p.fsdp->layouts();
      for (size_t u = 0; u < layouts.size(); ++u) {
        const auto& l = layouts[u];
        m << (u ? ",\n  " : "") << "{\"name\": " << quote(l.name) << ", \"numel\": " << l.numel
          << ", \"shard_size\": " << l.shard_size
          << ", \"shard_group_size\": " << l.shard_group_size << ", \"params\": [";
        for (size_t i = 0; i < l.params.size(); ++i) {
          const auto& e = l.params[i];
          m << (i ? ", " : "") << "{\"name\": " << quote(e.name)
            << ", \"shape\": " << shape_json(e.shape) << ", \"offset\": " << e.offset
            << ", \"numel\": " << e.numel << "}";
        }
        m << "]}";
      }
      m << "],\n";
    }
    m << " \"shard_ranks\": " << shape_json(shard_ranks) << ",\n \"files\": [";
    std::vector<FileInfo> listed = shared;
    for (int r = 0; r < world; ++r) {
      const char* kinds[2] = {"rank", "shard"};
      for (int i = 0; i < 2; ++i) {
        if (all[4 * r + 2 * i] < 0) continue;
        listed.push_back({rank_file(kinds[i], r), static_cast<uint64_t>(all[4 * r + 2 * i]),
                          static_cast<uint64_t>(all[4 * r + 2 * i + 1])});
      }
    }
    for (size_t i = 0; i < listed.size(); ++i) m << (i ? ",\n  " : "") << file_json(listed[i]);
    m << "]}\n";
    const std::string meta_text = m.str();
    FileInfo meta =
        ckpt::write_file(dir, "meta.json", std::vector<char>(meta_text.begin(), meta_text.end()));
    const std::string complete = "{\"meta\": " + file_json(meta) + "}\n";
    ckpt::write_file(dir, "COMPLETE", std::vector<char>(complete.begin(), complete.end()));
  }
  barrier(p);
  // Keep the newest `keep` complete checkpoints; drop older incomplete ones (crashed writes).
  if (rank == 0) {
    std::vector<std::pair<std::string, bool>> found;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(cc.dir, ec)) {
      const std::string name = e.path().filename().string();
      if (name.rfind("step_", 0) == 0)
        found.push_back({name, fs::exists(e.path() / "COMPLETE", ec)});
    }
    std::sort(found.begin(), found.end());
    int64_t complete_seen = 0;
    for (auto it = found.rbegin(); it != found.rend(); ++it) {
      if (it->second && ++complete_seen <= cc.keep) continue;
      if (!it->second && complete_seen == 0) continue;  // newer than every complete one
      fs::remove_all(cc.dir + "/" + it->first, ec);
    }
  }
  return dir;
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
      logging::warn("checkpoint '", dir, "' cannot be resumed: ", e.what());
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
  } catch (const std::exception& e) {
    // Reading failed on this rank: the others learn it in agree(), where they wait before
    // changing anything.
    agree(p, e.what());
    throw;  // agree() threw already
  }
}

std::optional<TrainerProgress> Checkpointer::restore_from(const CheckpointParts& p,
                                                          const std::string& dir) {
  const int rank = rank_of(p), world = world_of(p);
  // COMPLETE -> meta.json (verified) -> every file (verified as it is read).
  const ckpt::Meta meta = ckpt::read_meta(dir);
  const std::map<std::string, FileInfo>& files = meta.files;
  auto load = [&](const std::string& name) {
    DTRAIN_CHECK_AS(CheckpointError, files.count(name), "checkpoint '", dir,
                    "': meta.json lists no '", name, "'");
    return ckpt::unpickle(ckpt::read_file(dir, files.at(name)), dir + "/" + name);
  };
  const std::string& mode = meta.mode;
  const int saved_world = meta.world_size;
  DTRAIN_CHECK_AS(CheckpointError, mode == "full" || p.fsdp != nullptr, "checkpoint '", dir,
                  "' is sharded (FSDP), but this run's strategy is ", config_.parallel.strategy,
                  "; resume it with parallel.strategy: fsdp, or save it with checkpoint.format: "
                  "full");
  c10::NoGradGuard no_grad;

  // 1. Read and check everything; nothing is changed until all of it matches.
  std::vector<std::pair<std::string, at::Tensor>> params;  // current: name -> where it goes
  if (p.fsdp != nullptr) {
    params = p.fsdp->all_parameters();
  } else {
    for (const auto& item : p.module->named_parameters())
      params.push_back({item.key(), item.value()});
  }
  std::vector<at::Tensor> new_values;  // per params entry: full (plain) or parts (FSDP)
  std::vector<ParamState> new_states;  // in the optimizer's order
  // Where each model parameter sits in this optimizer (optimizer_slots).
  const std::vector<int64_t> slots_now =
      p.optimizer == nullptr ? std::vector<int64_t>{} : optimizer_slots(p);
  const size_t held_now = p.optimizer == nullptr ? 0 : optimizer_parameters(*p.optimizer).size();
  std::map<std::string, at::Tensor> buffers;
  const std::vector<std::string>& keys = meta.optimizer_keys;
  if (mode == "full") {
    auto model = tensors_of(as_dict(load("model.pt"), dir + "/model.pt"));
    std::map<std::string, std::vector<int64_t>> fsdp_shapes;
    if (p.fsdp != nullptr) {
      for (const auto& l : p.fsdp->layouts()) {
        for (const auto& e : l.params) fsdp_shapes[e.name] = e.shape;
      }
    }
    std::vector<Wanted> want;
    for (const auto& [name, t] : params) {
      want.push_back({name, p.fsdp != nullptr ? fsdp_shapes[name] : t.sizes().vec(), at::kFloat});
    }
    for (const auto& item : p.module->named_buffers()) {
      want.push_back({item.key(), item.value().sizes().vec(), item.value().scalar_type()});
    }
    std::vector<at::Tensor> matched = match(model, want, dir + "/model.pt");
    std::vector<at::Tensor> full(matched.begin(), matched.begin() + params.size());
    for (auto& t : full) t = t.to(at::kFloat);
    size_t b = params.size();
    for (const auto& item : p.module->named_buffers()) buffers[item.key()] = matched[b++];
    new_values = p.fsdp != nullptr ? p.fsdp->local_parts(full) : full;
    if (p.optimizer != nullptr && files.count("optim.pt")) {
      auto optim = as_dict(load("optim.pt"), dir + "/optim.pt");
      auto state = as_dict(optim.at("state"), dir + "/optim.pt state");
      // Saved index -> name, where the checkpoint has names (dtrain's do): state goes back to
      // the parameter of that name, whatever order this optimizer's groups are in.
      std::map<std::string, int64_t> saved_index;
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
      // Model order (model_parameters).
      std::vector<ParamState> all_states(params.size());
      for (size_t i = 0; i < params.size(); ++i) {
        if (slots_now[i] < 0) continue;
        int64_t j = slots_now[i];
        if (named) {
          auto it = saved_index.find(params[i].first);
          DTRAIN_CHECK_AS(CheckpointError, it != saved_index.end(), "checkpoint '", dir,
                          "/optim.pt': its optimizer did not hold parameter '", params[i].first,
                          "', which this optimizer does. Nothing was loaded.");
          j = it->second;
        }
        if (saved.count(j)) all_states[i] = saved.at(j);
      }
      if (p.fsdp != nullptr) {
        // Full state -> this rank's parts, per key.
        for (const auto& key : keys) {
          std::vector<at::Tensor> fulls;
          for (size_t i = 0; i < params.size(); ++i) {
            fulls.push_back(all_states[i].count(key) ? all_states[i].at(key)
                                                     : at::zeros(fsdp_shapes[params[i].first]));
          }
          auto parts = p.fsdp->local_parts(fulls);
          for (size_t i = 0; i < params.size(); ++i) {
            if (all_states[i].count(key)) all_states[i][key] = parts[i];
          }
        }
      }
      new_states = to_optimizer_order(all_states, slots_now, held_now);
    }
  } else {
    // Sharded: the units must be the same; the world size may differ.
    const auto layouts = p.fsdp->layouts();
    const std::vector<ckpt::UnitMeta>& units = meta.units;
    DTRAIN_CHECK_AS(CheckpointError, units.size() == layouts.size(), "checkpoint '", dir, "' has ",
                    units.size(), " FSDP units, this model ", layouts.size(),
                    ": resume with the same wrap policy. Nothing was loaded.");
    for (size_t u = 0; u < layouts.size(); ++u) {
      const std::vector<ckpt::UnitParamMeta>& ps = units[u].params;
      DTRAIN_CHECK_AS(CheckpointError, ps.size() == layouts[u].params.size(), "checkpoint '", dir,
                      "': unit '", layouts[u].name, "' holds ", ps.size(), " parameters there, ",
                      layouts[u].params.size(), " here. Nothing was loaded.");
      for (size_t i = 0; i < ps.size(); ++i) {
        const auto& e = layouts[u].params[i];
        DTRAIN_CHECK_AS(CheckpointError, ps[i].name == e.name && ps[i].shape == e.shape,
                        "checkpoint '", dir, "': parameter '", ps[i].name, "' of shape ",
                        at::IntArrayRef(ps[i].shape), " does not match the model's '", e.name,
                        "' of shape ", at::IntArrayRef(e.shape), ". Nothing was loaded.");
      }
    }
    const std::vector<int64_t>& shard_ranks = meta.shard_ranks;
    std::map<int, c10::impl::GenericDict> cache;
    auto shard_file = [&](int64_t shard_rank) -> const c10::impl::GenericDict& {
      const int w = static_cast<int>(std::find(shard_ranks.begin(), shard_ranks.end(), shard_rank) -
                                     shard_ranks.begin());
      if (!cache.count(w)) {
        cache.emplace(w, as_dict(load(rank_file("shard", w)), dir + "/" + rank_file("shard", w)));
      }
      return cache.at(w);
    };
    auto reader = [&](const std::string& what) {
      return [&, what](int64_t unit, int64_t begin, int64_t count) {
        const int64_t size = units[unit].shard_size;
        at::Tensor out = at::empty({count}, at::kFloat);
        for (int64_t pos = begin; pos < begin + count;) {
          const int64_t q = pos / size, in = pos - q * size;
          const int64_t n = std::min(begin + count - pos, size - in);
          at::Tensor flat = shard_file(q).at(layouts[unit].name + "|" + what).toTensor();
          out.narrow(0, pos - begin, n).copy_(flat.narrow(0, in, n));
          pos += n;
        }
        return out.to(p.fsdp->all_parameters().front().second.device());
      };
    };
    new_values = p.fsdp->parts_from(reader("params"));
    {
      std::map<std::string, at::Tensor> saved;
      for (const auto& [key, t] : tensors_of(shard_file(0))) {
        if (key.rfind(kBufferPrefix, 0) == 0) saved[key.substr(sizeof(kBufferPrefix) - 1)] = t;
      }
      for (const auto& item : p.module->named_buffers()) {
        buffers[item.key()] =
            match_one(saved, {item.key(), item.value().sizes().vec(), item.value().scalar_type()},
                      dir + "/" + rank_file("shard", 0));
      }
    }
    if (p.optimizer != nullptr && !keys.empty()) {
      std::vector<ParamState> all_states(params.size());
      at::Tensor steps = shard_file(0).at("optim_step").toTensor();
      for (const auto& key : keys) {
        auto parts = p.fsdp->parts_from(reader(key));
        for (size_t i = 0; i < params.size(); ++i) {
          if (steps[static_cast<int64_t>(i)].item<double>() >= 0) all_states[i][key] = parts[i];
        }
      }
      for (size_t i = 0; i < params.size(); ++i) {
        const double s = steps[static_cast<int64_t>(i)].item<double>();
        if (s >= 0) all_states[i]["step"] = at::scalar_tensor(s, at::kFloat);
      }
      new_states = to_optimizer_order(all_states, slots_now, held_now);
    }
  }
  c10::impl::GenericDict scaler_state = tensor_dict();
  if (p.scaler != nullptr && files.count("scaler.pt")) {
    scaler_state = as_dict(load("scaler.pt"), dir + "/scaler.pt");
  }
  const bool same_world = saved_world == world;
  c10::impl::GenericDict mine = tensor_dict();
  if (same_world)
    mine = as_dict(load(rank_file("rank", rank)), dir + "/" + rank_file("rank", rank));

  // 2. Apply, once every rank has read and checked its part.
  agree(p, "");
  if (p.fsdp != nullptr) {
    p.fsdp->set_parameters(new_values);
  } else {
    for (size_t i = 0; i < params.size(); ++i) params[i].second.copy_(new_values[i]);
  }
  for (const auto& item : p.module->named_buffers()) {
    if (buffers.count(item.key())) item.value().copy_(buffers[item.key()]);
  }
  if (p.optimizer != nullptr && !new_states.empty())
    import_optimizer_state(*p.optimizer, new_states);
  if (p.scaler != nullptr && (scaler_state.size() > 0 || p.scaler->is_enabled())) {
    p.scaler->load_state_dict(scaler_state);
  }
  if (same_world) {
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
  } else {
    logging::warn("checkpoint '", dir, "' was written at ", saved_world, " ranks, this run has ",
                  world, ": resharded; random-number generators keep this run's seeding");
  }
  TrainerProgress progress;
  progress.step = meta.step;
  progress.skipped_steps = meta.skipped_steps;
  progress.lr = meta.lr;
  progress.consecutive_skips = meta.consecutive_skips;
  progress.nonfinite_run = meta.nonfinite_run;
  logging::info("resumed from ", dir, " at step ", progress.step, " (", mode, ", written at ",
                saved_world, " rank(s))");
  return progress;
}

}  // namespace dtrain::framework
