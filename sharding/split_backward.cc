#include "sharding/split_backward.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>

#include <functional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "core/error.h"

namespace dtrain::sharding {

namespace ag = torch::autograd;

namespace {

// An activation node whose weight half was deferred: what flowed into it in the input half,
// and its edges into the weight-only part.
struct Deferred {
  std::vector<ag::Edge> inputs;  // (node, input_nr) of each recorded gradient
  std::vector<at::Tensor> grads;
  std::vector<ag::Edge> weight_edges;
};

ag::Engine& engine() { return ag::Engine::get_default_engine(); }

// Hooks of any kind on a node: a node run twice would run them twice.
bool has_hooks(ag::Node& n) {
  return !n.pre_hooks().empty() || !n.post_hooks().empty() || !n.tensor_pre_hooks().empty() ||
         !n.retains_grad_hooks().empty();
}

// Hooks that run on a node's incoming gradient where the engine captures it without running
// the node: captured in one call and fed to the node in the next, they would run twice.
bool has_capture_hooks(ag::Node& n) {
  return !n.tensor_pre_hooks().empty() || !n.retains_grad_hooks().empty();
}

// Built-in autograd nodes (generated kernels' backwards) are named like "AddmmBackward0";
// custom Functions and the engine's own nodes carry their C++ namespace.
bool is_builtin(const ag::Node& n) { return n.name().find(':') == std::string::npos; }

}  // namespace

struct WeightGrad::State {
  // The whole backward in the weight half (no input gradient to give first).
  ag::Edge root;
  at::Tensor root_grad;
  // Or the split: what to run again, and the parameters' gradients the input half took whole
  // (at their AccumulateGrad, which the weight half then runs on them).
  std::vector<Deferred> deferred;
  ag::edge_list taken;
  std::vector<at::Tensor> taken_grads;
  // Held so that the graph lives until the weight half ran.
  at::Tensor output;
  bool done = false;
};

WeightGrad::WeightGrad() = default;
WeightGrad::~WeightGrad() = default;
WeightGrad::WeightGrad(WeightGrad&&) noexcept = default;
WeightGrad& WeightGrad::operator=(WeightGrad&&) noexcept = default;
WeightGrad::WeightGrad(std::unique_ptr<State> state) : state_(std::move(state)) {}

int WeightGrad::deferred_nodes() const {
  return state_ ? static_cast<int>(state_->deferred.size()) : 0;
}

void WeightGrad::run() {
  if (!state_ || state_->done) return;
  State& s = *state_;
  s.done = true;
  if (s.root.is_valid()) {
    engine().execute({s.root}, {s.root_grad}, /*keep_graph=*/false, /*create_graph=*/false,
                     /*accumulate_grad=*/true);
  }
  // Each deferred node again, alone, computing only its outputs toward the weights.
  ag::edge_list roots;
  std::vector<at::Tensor> grads;
  for (Deferred& d : s.deferred) {
    // Only this node runs (its weight edges are the outputs), and never again: its saved
    // values are freed as it finishes.
    auto out = engine().execute(d.inputs, d.grads, /*keep_graph=*/false, /*create_graph=*/false,
                                /*accumulate_grad=*/false, d.weight_edges);
    for (size_t i = 0; i < out.size(); ++i) {
      if (!out[i].defined()) continue;
      roots.push_back(d.weight_edges[i]);
      grads.push_back(std::move(out[i]));
    }
  }
  s.deferred.clear();
  // The weight-only part from those edges, and the taken gradients through their parameters'
  // AccumulateGrad, accumulating as a plain backward does (its layout rules and hooks).
  for (size_t i = 0; i < s.taken.size(); ++i) {
    if (!s.taken_grads[i].defined()) continue;
    roots.push_back(s.taken[i]);
    grads.push_back(s.taken_grads[i]);
  }
  if (!roots.empty()) {
    engine().execute(roots, grads, /*keep_graph=*/false, /*create_graph=*/false,
                     /*accumulate_grad=*/true);
  }
  s.taken.clear();
  s.taken_grads.clear();
  s.output = at::Tensor();
  s.root = ag::Edge();
  s.root_grad = at::Tensor();
}

WeightGrad backward_input(const at::Tensor& output, const at::Tensor& grad_output,
                          const at::Tensor& input, at::Tensor* grad_input) {
  DTRAIN_CHECK_AS(UsageError, output.requires_grad(),
                  "backward_input: the output needs no gradient");
  DTRAIN_CHECK_AS(UsageError, grad_output.defined() || output.numel() == 1,
                  "backward_input: an output of ", output.numel(),
                  " elements needs its gradient (as backward() does)");
  DTRAIN_CHECK_AS(UsageError, !input.defined() || !input.requires_grad() || input.is_leaf(),
                  "backward_input: the input must be a leaf (a received activation, detached); "
                  "the gradients of what made it would be lost");
  auto state = std::make_unique<WeightGrad::State>();
  state->output = output;
  const at::Tensor root_grad =
      grad_output.defined() ? grad_output : at::ones_like(output, at::MemoryFormat::Preserve);
  const ag::Edge root = ag::impl::gradient_edge(output);
  ag::Node* const root_fn = root.function.get();
  const bool has_input = input.defined() && input.requires_grad();
  ag::Edge in_edge;
  if (has_input) in_edge = ag::impl::gradient_edge(input);
  ag::Node* const in_fn = in_edge.function.get();

  // The activation nodes: those with a path to the input (post-order, without recursion).
  std::unordered_map<ag::Node*, bool> reaches;
  if (has_input && root_fn != nullptr) {
    std::vector<std::pair<ag::Node*, size_t>> stack{{root_fn, 0}};
    reaches[root_fn] = root_fn == in_fn;
    while (!stack.empty()) {
      auto& [node, next] = stack.back();
      const auto& edges = node->next_edges();
      if (next < edges.size()) {
        ag::Node* child = edges[next++].function.get();
        if (child == nullptr) continue;
        auto [it, fresh] = reaches.emplace(child, child == in_fn);
        if (fresh && child != in_fn) stack.push_back({child, 0});
        continue;
      }
      bool any = node == in_fn;
      for (const auto& e : edges) {
        if (e.function && reaches[e.function.get()]) any = true;
      }
      reaches[node] = any;
      stack.pop_back();
    }
  }
  const bool split = has_input && root_fn != nullptr && reaches[root_fn];
  if (!split) {
    // No path to the input (the first stage, or an input the stage does not use): the input's
    // gradient is zeros and the whole backward is the weight half.
    if (grad_input) *grad_input = input.defined() ? at::zeros_like(input) : at::Tensor();
    state->root = root;
    state->root_grad = root_grad;
    return WeightGrad(std::move(state));
  }
  auto is_activation = [&](ag::Node* n) {
    auto it = reaches.find(n);
    return it != reaches.end() && it->second;
  };

  // The weight edges: from an activation node into the weight-only part. Count, for every
  // weight-only node, how many weight edges reach it (1 or "more"): an edge may be deferred
  // only when its whole part is its own.
  struct WeightEdge {
    ag::Node* from;
    size_t index;  // in from->next_edges()
  };
  std::vector<WeightEdge> weight_edges;
  std::vector<ag::Node*> activation_nodes;
  for (const auto& [node, on_path] : reaches) {
    if (!on_path || node == in_fn) continue;
    activation_nodes.push_back(node);
    const auto& edges = node->next_edges();
    for (size_t i = 0; i < edges.size(); ++i) {
      ag::Node* child = edges[i].function.get();
      if (child != nullptr && !is_activation(child)) weight_edges.push_back({node, i});
    }
  }
  std::unordered_map<ag::Node*, int> reached_by;
  auto walk = [&](ag::Node* start, const std::function<bool(ag::Node*)>& visit) {
    std::vector<ag::Node*> stack{start};
    std::unordered_set<ag::Node*> seen{start};
    while (!stack.empty()) {
      ag::Node* n = stack.back();
      stack.pop_back();
      if (!visit(n)) continue;
      for (const auto& e : n->next_edges()) {
        ag::Node* c = e.function.get();
        if (c != nullptr && seen.insert(c).second) stack.push_back(c);
      }
    }
  };
  for (const WeightEdge& w : weight_edges) {
    walk(w.from->next_edges()[w.index].function.get(), [&](ag::Node* n) {
      int& c = reached_by[n];
      if (c >= 2) return false;  // its part already counted as shared
      ++c;
      return true;
    });
  }
  // Deferred: edges of built-in nodes whose part only they reach. The rest: their parameters'
  // gradients are taken in the input half (captured at their AccumulateGrad).
  std::unordered_map<ag::Node*, std::vector<ag::Edge>> deferred_edges;
  std::unordered_set<ag::Node*> taken_acc;
  std::vector<ag::Edge> taken_edges;
  for (const WeightEdge& w : weight_edges) {
    const ag::Edge& e = w.from->next_edges()[w.index];
    bool own = is_builtin(*w.from);
    std::vector<ag::Node*> part;
    walk(e.function.get(), [&](ag::Node* n) {
      part.push_back(n);
      if (reached_by[n] != 1) own = false;
      return true;
    });
    if (own) {
      deferred_edges[w.from].push_back(e);
      continue;
    }
    for (ag::Node* n : part) {
      auto* acc = dynamic_cast<ag::AccumulateGrad*>(n);
      if (acc != nullptr && taken_acc.insert(n).second) {
        taken_edges.push_back(ag::Edge(ag::impl::grad_accumulator(acc->variable), 0));
      }
    }
  }
  // Hooks that the split would run twice (a deferred node's, a deferred edge's target's or a
  // taken parameter's on its incoming gradient): then no split, the plain backward now.
  bool hooked = false;
  for (const auto& [n, edges] : deferred_edges) {
    hooked = hooked || has_hooks(*n);
    for (const auto& e : edges) hooked = hooked || has_capture_hooks(*e.function);
  }
  for (const auto& e : taken_edges) hooked = hooked || has_capture_hooks(*e.function);
  if (hooked) {
    engine().execute({root}, {root_grad}, /*keep_graph=*/false, /*create_graph=*/false,
                     /*accumulate_grad=*/true);
    if (grad_input) *grad_input = input.grad().defined() ? input.grad() : at::zeros_like(input);
    return WeightGrad(std::move(state));
  }

  // The input half: the input's gradient, what flows into each deferred node, and the taken
  // parameters' gradients, in one backward that keeps the graph.
  ag::edge_list outputs{in_edge};
  std::vector<std::pair<ag::Node*, size_t>> recorded;  // (node, first output index)
  for (ag::Node* n : activation_nodes) {
    auto it = deferred_edges.find(n);
    if (it == deferred_edges.end()) continue;
    recorded.push_back({n, outputs.size()});
    for (uint32_t i = 0; i < n->num_inputs(); ++i) outputs.push_back(ag::Edge());
  }
  // Node pointers as the graph holds them: from the parents' edges (or the root).
  std::unordered_map<ag::Node*, ag::Edge> owner;
  owner[root_fn] = root;
  for (ag::Node* n : activation_nodes) {
    for (const auto& e : n->next_edges()) {
      if (e.function) owner.emplace(e.function.get(), e);
    }
  }
  for (const auto& [n, first] : recorded) {
    const auto& fn = owner.at(n).function;
    for (uint32_t i = 0; i < n->num_inputs(); ++i) outputs[first + i] = ag::Edge(fn, i);
  }
  const size_t taken_first = outputs.size();
  outputs.insert(outputs.end(), taken_edges.begin(), taken_edges.end());
  auto got = engine().execute({root}, {root_grad}, /*keep_graph=*/true, /*create_graph=*/false,
                              /*accumulate_grad=*/false, outputs);
  if (grad_input) *grad_input = got[0].defined() ? got[0] : at::zeros_like(input);
  for (const auto& [n, first] : recorded) {
    Deferred d;
    for (uint32_t i = 0; i < n->num_inputs(); ++i) {
      if (!got[first + i].defined()) continue;
      d.inputs.push_back(outputs[first + i]);
      d.grads.push_back(got[first + i]);
    }
    if (d.inputs.empty()) continue;  // nothing flowed into it
    d.weight_edges = deferred_edges[n];
    state->deferred.push_back(std::move(d));
  }
  state->taken = taken_edges;
  state->taken_grads.assign(got.begin() + static_cast<std::ptrdiff_t>(taken_first), got.end());
  return WeightGrad(std::move(state));
}

}  // namespace dtrain::sharding
