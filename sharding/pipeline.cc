#include "sharding/pipeline.h"

#include <chrono>
#include <map>
#include <optional>
#include <tuple>
#include <utility>

#include "core/error.h"
#include "core/trace.h"
#include "sharding/split_backward.h"

namespace dtrain::sharding::pp {

Pipeline::Pipeline(Schedule schedule, std::shared_ptr<comm::Communicator> group)
    : schedule_(std::move(schedule)), group_(std::move(group)) {
  const int size = group_ ? group_->size() : 1;
  DTRAIN_CHECK_AS(UsageError, size == schedule_.ranks, "pipeline: the schedule is for ",
                  schedule_.ranks, " ranks but the group has ", size);
  rank_ = group_ ? group_->rank() : 0;
  check_message_order(schedule_, comm::Communicator::kMaxTag + 1);
}

int Pipeline::tag(int boundary, int micro, bool grad) const {
  return message_tag(boundary, micro, grad, schedule_.micro_batches,
                     comm::Communicator::kMaxTag + 1);
}

at::Tensor Pipeline::loss_sum(const std::vector<at::Tensor>& losses) const {
  const at::Device device = group_ ? group_->device() : at::Device(at::kCPU);
  at::Tensor sum = at::zeros({}, at::TensorOptions(at::kDouble).device(device));
  for (const at::Tensor& l : losses) sum += l.to(device, at::kDouble).reshape({});
  if (group_) group_->all_reduce(sum, comm::ReduceOp::kSum).wait();
  return sum;
}

at::Tensor Pipeline::any_found_inf(const at::Tensor& found_inf) const {
  const at::Device device = group_ ? group_->device() : at::Device(at::kCPU);
  at::Tensor flag = found_inf.to(device, at::kFloat).reshape({1}).clone();
  if (group_) group_->all_reduce(flag, comm::ReduceOp::kMax).wait();
  return flag.reshape({}).to(found_inf.device());
}

std::vector<at::Tensor> Pipeline::run(const Step& step) {
  using Key = std::pair<int, int>;  // stage, micro
  const Schedule& s = schedule_;
  const int S = s.stages, M = s.micro_batches;
  const auto& actions = s.actions[static_cast<size_t>(rank_)];
  DTRAIN_CHECK_AS(UsageError, static_cast<bool>(step.forward), "pipeline: no forward");
  const bool has_first = s.rank_of(0) == rank_, has_last = s.rank_of(S - 1) == rank_;
  DTRAIN_CHECK_AS(UsageError, !has_last || static_cast<bool>(step.loss),
                  "pipeline: the last stage's rank needs a loss");
  DTRAIN_CHECK_AS(UsageError, !has_first || static_cast<int>(step.inputs.size()) == M,
                  "pipeline: ", step.inputs.size(), " inputs for ", M, " micro-batches");
  // Forward-only (evaluation): no graph, nothing held for a backward.
  const bool training = s.kind != ScheduleKind::kForwardOnly;
  std::optional<c10::NoGradGuard> no_grad;
  if (!training) no_grad.emplace();
  const auto t0 = std::chrono::steady_clock::now();
  auto seconds = [&t0] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  std::map<Key, at::Tensor> arrived;   // a stage's input, from another rank or this one
  std::map<Key, at::Tensor> inputs;    // held for backward: the input leaf (stage > 0)
  std::map<Key, at::Tensor> outputs;   // held for backward: the output (the loss, last)
  std::map<Key, at::Tensor> grad_in;   // the gradient of a stage's output
  std::map<Key, at::Tensor> grad_out;  // the gradient of a stage's input, to send
  std::map<Key, WeightGrad> weight;    // zero_bubble: the W half of a run I half
  std::vector<at::Tensor> losses(has_last ? static_cast<size_t>(M) : 0);
  spans_.clear();
  peak_in_flight_ = 0;
  int in_flight = 0;
  auto take = [](std::map<Key, at::Tensor>& m, const Key& k, const char* what) {
    auto it = m.find(k);
    DTRAIN_CHECK_AS(UsageError, it != m.end(), "pipeline: no ", what, " for stage ", k.first,
                    " micro-batch ", k.second);
    at::Tensor t = std::move(it->second);
    m.erase(it);
    return t;
  };
  const auto options = at::TensorOptions().dtype(step.activation_dtype).device(step.device);
  auto run_weight = [&](const Action& a) {
    const double start = seconds();
    trace::Scope traced("weight " + std::to_string(a.stage) + "." + std::to_string(a.micro),
                        "compute");
    auto it = weight.find({a.stage, a.micro});
    DTRAIN_CHECK_AS(UsageError, it != weight.end(), "pipeline: no input half before ",
                    to_string(a));
    it->second.run();
    weight.erase(it);
    --in_flight;
    spans_.push_back({a, start, seconds()});
  };
  for (size_t i = 0; i < actions.size();) {
    const Action& a = actions[i];
    const Key k{a.stage, a.micro};
    const double start = seconds();
    if (a.op == Op::kForward) {
      trace::Scope traced("forward " + std::to_string(a.stage) + "." + std::to_string(a.micro),
                          "compute");
      at::Tensor input;
      if (a.stage == 0) {
        input = step.inputs[static_cast<size_t>(a.micro)];
      } else {
        input = take(arrived, k, "activation").detach().requires_grad_(true);
        inputs[k] = input;
      }
      at::Tensor out = step.forward(a.stage, a.micro, input);
      if (a.stage == S - 1) {
        at::Tensor loss = step.loss(a.micro, out);
        losses[static_cast<size_t>(a.micro)] = loss.detach();
        if (training) outputs[k] = loss;
      } else if (s.rank_of(a.stage + 1) == rank_) {
        // Between stages on this rank too, the activation is what a message would carry.
        arrived[{a.stage + 1, a.micro}] = out.to(step.activation_dtype);
        if (training) outputs[k] = out;
      } else {
        outputs[k] = out;  // until sent (and, training, until its backward)
      }
      if (training) peak_in_flight_ = std::max(peak_in_flight_, ++in_flight);
      spans_.push_back({a, start, seconds()});
      ++i;
      continue;
    }
    if (a.op == Op::kBackwardWeight) {
      run_weight(a);
      ++i;
      continue;
    }
    if (a.gives_input_grad()) {
      const bool half = a.op == Op::kBackwardInput;
      trace::Scope traced(
          (half ? "input " : "backward ") + std::to_string(a.stage) + "." + std::to_string(a.micro),
          "compute");
      at::Tensor out = take(outputs, k, "output");
      at::Tensor g_out;
      if (a.stage < S - 1) {
        g_out = take(grad_in, k, "output gradient").to(out.device(), out.scalar_type());
      }
      at::Tensor in = a.stage > 0 ? take(inputs, k, "input") : at::Tensor();
      // An output that needs no gradient (a frozen stage, or a run under NoGradGuard) has no
      // backward to run; its input's gradient is then zeros.
      at::Tensor g_in;
      if (half) {
        WeightGrad w;
        if (out.requires_grad()) w = backward_input(out, g_out, in, &g_in);
        weight.emplace(k, std::move(w));
      } else if (out.requires_grad()) {
        out.backward(g_out);
      }
      if (a.stage > 0) {
        if (!g_in.defined()) g_in = in.grad();
        at::Tensor g = g_in.defined() ? g_in : at::zeros_like(in);
        if (s.rank_of(a.stage - 1) == rank_) {
          grad_in[{a.stage - 1, a.micro}] = g;
        } else {
          grad_out[k] = g;
        }
      }
      if (!half) --in_flight;
      spans_.push_back({a, start, seconds()});
      ++i;
      continue;
    }
    // A batch: the communication actions up to the next compute action.
    std::vector<comm::Communicator::P2POp> ops;
    std::vector<std::pair<Key, bool>> receives;  // where each receive lands (activation?)
    std::vector<Action> weights;                 // run while the batch is in flight
    size_t j = i;
    for (; j < actions.size() && (!actions[j].is_compute() || actions[j].op == Op::kBackwardWeight);
         ++j) {
      const Action& c = actions[j];
      const Key ck{c.stage, c.micro};
      if (c.op == Op::kBackwardWeight) {
        weights.push_back(c);
        continue;
      }
      using P = comm::Communicator::P2POp;
      switch (c.op) {
        case Op::kSendActivation:
          ops.push_back({P::kSend, outputs.at(ck).detach().to(step.activation_dtype).contiguous(),
                         s.rank_of(c.stage + 1), tag(c.stage, c.micro, false)});
          if (!training) outputs.erase(ck);
          break;
        case Op::kRecvActivation:
          ops.push_back({P::kRecv, at::empty(step.activation_shape, options),
                         s.rank_of(c.stage - 1), tag(c.stage - 1, c.micro, false)});
          receives.push_back({ck, true});
          break;
        case Op::kSendGrad:
          ops.push_back(
              {P::kSend,
               take(grad_out, ck, "input gradient").to(step.activation_dtype).contiguous(),
               s.rank_of(c.stage - 1), tag(c.stage - 1, c.micro, true)});
          break;
        case Op::kRecvGrad:
          ops.push_back({P::kRecv, at::empty(step.activation_shape, options),
                         s.rank_of(c.stage + 1), tag(c.stage, c.micro, true)});
          receives.push_back({ck, false});
          break;
        default:
          break;
      }
    }
    DTRAIN_CHECK_AS(UsageError, group_ != nullptr, "pipeline: ", to_string(a),
                    " needs a group of ranks");
    std::vector<at::Tensor> landing;
    for (const auto& op : ops) {
      if (op.kind == comm::Communicator::P2POp::kRecv) landing.push_back(op.tensor);
    }
    std::string name;
    if (trace::enabled()) {
      name = "pp";
      for (size_t x = i; x < j; ++x) {
        if (!actions[x].is_compute()) name += " " + to_string(actions[x]);
      }
    }
    std::optional<trace::Scope> traced(std::in_place, name, "wait");
    {
      std::optional<trace::Label> label(std::in_place, name);  // the communicator's track
      comm::Work work = group_->batch_p2p(std::move(ops));
      if (!weights.empty()) {
        // The W halves while the messages are in flight (their own spans).
        label.reset();
        traced.reset();
        spans_.push_back({a, start, seconds()});
        for (const Action& w : weights) run_weight(w);
        traced.emplace(name, "wait");
      }
      work.wait();
    }
    for (size_t r = 0; r < receives.size(); ++r) {
      (receives[r].second ? arrived : grad_in)[receives[r].first] = landing[r];
    }
    if (weights.empty()) spans_.push_back({a, start, seconds()});
    i = j;
  }
  // Every input half's weight half ran: a schedule that dropped one would leave its
  // parameters' gradients short without a word.
  DTRAIN_CHECK_AS(UsageError, weight.empty(), "pipeline: ", weight.size(),
                  " backward(s) ran without their weight half, the first of stage ",
                  weight.begin()->first.first, " micro-batch ", weight.begin()->first.second);
  return losses;
}

}  // namespace dtrain::sharding::pp
