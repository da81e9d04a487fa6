#include "sharding/fsdp.h"

#include <algorithm>
#include <unordered_map>

#include "core/error.h"
#include "core/logging.h"
#include "sharding/clip_grad.h"

namespace dtrain::sharding {
namespace {

// "dtrain::framework::BlockImpl" -> "Block"; "Block" -> "Block".
std::string short_type(const std::string& type) {
  std::string s = type.substr(type.rfind(':') == std::string::npos ? 0 : type.rfind(':') + 1);
  if (s.size() > 4 && s.compare(s.size() - 4, 4, "Impl") == 0) s.resize(s.size() - 4);
  return s;
}

bool type_matches(const std::string& type, const std::vector<std::string>& wanted) {
  if (wanted.empty()) return true;
  for (const auto& w : wanted) {
    if (w == type || short_type(w) == short_type(type)) return true;
  }
  return false;
}

bool under(const std::string& name, const std::string& prefix) {
  return name.size() > prefix.size() && name.compare(0, prefix.size(), prefix) == 0 &&
         name[prefix.size()] == '.';
}

}  // namespace

namespace detail {

std::unique_ptr<FSDPState> build_fsdp(torch::nn::Module& module,
                                      std::shared_ptr<comm::Communicator> comm,
                                      FSDPOptions options) {
  // Wrap points the policy chooses, deepest first (a parameter goes to its innermost unit).
  struct Point {
    std::string name;
    UnitBase* unit;
  };
  std::vector<Point> chosen;
  std::vector<std::string> declined;
  for (const auto& item : module.named_modules(/*name_prefix=*/"", /*include_self=*/false)) {
    auto* unit = dynamic_cast<UnitBase*>(item.value().get());
    if (unit == nullptr) continue;
    int64_t count = 0;
    for (const auto& p : item.value()->parameters()) count += p.numel();
    if (type_matches(unit->unit_type(), options.auto_wrap().module_types()) &&
        count >= options.auto_wrap().min_params()) {
      chosen.push_back({item.key(), unit});
    } else {
      declined.push_back(item.key());
    }
  }
  // `chosen` is in module order (named_modules() lists them so); `deepest` looks the
  // innermost one up first.
  std::vector<size_t> deepest(chosen.size());
  for (size_t u = 0; u < chosen.size(); ++u) deepest[u] = u;
  std::stable_sort(deepest.begin(), deepest.end(), [&](size_t a, size_t b) {
    return chosen[a].name.size() > chosen[b].name.size();
  });

  // Owner of each parameter: its innermost chosen unit, or the root (index -1). A tensor
  // registered under several names (tied weights) in different units belongs to the root.
  auto owner_of = [&](const std::string& name) -> int64_t {
    for (size_t u : deepest) {
      if (under(name, chosen[u].name)) return static_cast<int64_t>(u);
    }
    return -1;
  };
  std::vector<std::string> order;
  std::vector<std::pair<std::string, at::Tensor>> unique;
  std::unordered_map<const void*, size_t> seen;
  std::vector<int64_t> owner;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    const void* impl = item.value().unsafeGetTensorImpl();
    auto it = seen.find(impl);
    if (it != seen.end()) {
      if (owner[it->second] != owner_of(item.key())) owner[it->second] = -1;
      logging::debug("FSDP: '", item.key(), "' is the same tensor as '", unique[it->second].first,
                     "' (tied); it is kept once");
      continue;
    }
    seen.emplace(impl, unique.size());
    unique.emplace_back(item.key(), item.value());
    owner.push_back(owner_of(item.key()));
    order.push_back(item.key());
  }
  // Before any collective, so every rank refuses alike (a rank failing inside a collective
  // constructor would leave the others in it).
  if (!options.param_init()) check_no_placeholders(unique, "FSDP");
  std::vector<FSDPState::UnitSpec> specs(chosen.size());
  FSDPState::UnitSpec root;
  for (size_t u = 0; u < chosen.size(); ++u) specs[u].name = chosen[u].name;
  for (size_t i = 0; i < unique.size(); ++i) {
    (owner[i] < 0 ? root : specs[owner[i]]).params.push_back(std::move(unique[i]));
  }
  // Units in module order; a chosen wrap point that owns nothing runs plain.
  std::vector<std::pair<std::string, UnitBase*>> attached;
  std::vector<FSDPState::UnitSpec> units;
  for (size_t u = 0; u < chosen.size(); ++u) {
    if (specs[u].params.empty()) continue;
    attached.emplace_back(chosen[u].name, chosen[u].unit);
    units.push_back(std::move(specs[u]));
  }
  std::vector<std::pair<std::string, at::Tensor>> buffers;
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    buffers.emplace_back(item.key(), item.value());
  }
  auto state = std::make_unique<FSDPState>(std::move(units), std::move(root), std::move(buffers),
                                           std::move(order), std::move(comm), std::move(options));
  for (size_t u = 0; u < attached.size(); ++u) {
    attached[u].second->attach(state.get(), static_cast<int64_t>(u));
  }
  if (!declined.empty()) {
    logging::debug("FSDP: ", declined.size(), " wrap point(s) not chosen by the policy (",
                   declined.front(), declined.size() > 1 ? ", ..." : "", ")");
  }
  return state;
}

void detach_units(torch::nn::Module& module) {
  for (const auto& m : module.modules(/*include_self=*/false)) {
    if (auto* unit = dynamic_cast<UnitBase*>(m.get())) unit->attach(nullptr, -1);
  }
}

}  // namespace detail

double clip_sharded_grad_norm_(FSDPState& state, double max_norm, double norm_type) {
  return clip_grad_norm_(state.parameters(), max_norm, norm_type, state.shard_group());
}

}  // namespace dtrain::sharding
