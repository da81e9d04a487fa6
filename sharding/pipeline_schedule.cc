#include "sharding/pipeline_schedule.h"

#include <algorithm>
#include <map>
#include <set>
#include <sstream>
#include <tuple>

#include "core/error.h"

namespace dtrain::sharding::pp {

std::string to_string(const Action& a) {
  static const char* const kNames[] = {"F", "B", "SA", "RA", "SG", "RG", "I", "W"};
  std::ostringstream os;
  os << kNames[static_cast<int>(a.op)] << " " << a.stage << "." << a.micro;
  return os.str();
}

const char* schedule_name(ScheduleKind k) {
  switch (k) {
    case ScheduleKind::kGPipe:
      return "gpipe";
    case ScheduleKind::k1F1B:
      return "1f1b";
    case ScheduleKind::kInterleaved1F1B:
      return "interleaved_1f1b";
    case ScheduleKind::kForwardOnly:
      return "forward_only";
    case ScheduleKind::kZeroBubble:
      return "zero_bubble";
  }
  return "?";
}

ScheduleKind parse_schedule(const std::string& name) {
  for (auto k : {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kInterleaved1F1B,
                 ScheduleKind::kZeroBubble}) {
    if (name == schedule_name(k)) return k;
  }
  DTRAIN_FAIL(ConfigError, "unknown pipeline schedule '", name,
              "' (choose gpipe, 1f1b, interleaved_1f1b or zero_bubble)");
}

std::vector<int> Schedule::stages_of(int rank) const {
  std::vector<int> out;
  for (int s = rank; s < stages; s += ranks) out.push_back(s);
  return out;
}

std::vector<std::vector<Action>> with_communication(const std::vector<std::vector<Steps>>& steps,
                                                    int ranks, int stages) {
  auto rank_of = [ranks](int s) { return s % ranks; };
  std::vector<std::vector<Action>> out(steps.size());
  for (size_t r = 0; r < steps.size(); ++r) {
    const int me = static_cast<int>(r);
    for (const Steps& step : steps[r]) {
      for (const Action& a : step) {  // what the step receives, before it
        if (a.op == Op::kForward && a.stage > 0 && rank_of(a.stage - 1) != me) {
          out[r].push_back({Op::kRecvActivation, a.stage, a.micro});
        }
        if (a.gives_input_grad() && a.stage + 1 < stages && rank_of(a.stage + 1) != me) {
          out[r].push_back({Op::kRecvGrad, a.stage, a.micro});
        }
      }
      for (const Action& a : step) out[r].push_back(a);
      for (const Action& a : step) {  // what it sends, after it
        if (a.op == Op::kForward && a.stage + 1 < stages && rank_of(a.stage + 1) != me) {
          out[r].push_back({Op::kSendActivation, a.stage, a.micro});
        }
        if (a.gives_input_grad() && a.stage > 0 && rank_of(a.stage - 1) != me) {
          out[r].push_back({Op::kSendGrad, a.stage, a.micro});
        }
      }
    }
  }
  return out;
}

std::vector<std::vector<Action>> with_communication(const std::vector<std::vector<Action>>& compute,
                                                    int ranks, int stages) {
  std::vector<std::vector<Steps>> steps(compute.size());
  for (size_t r = 0; r < compute.size(); ++r) {
    for (const Action& a : compute[r]) steps[r].push_back({a});
  }
  return with_communication(steps, ranks, stages);
}

namespace {

// Rank r's compute order under PyTorch's ScheduleInterleavedZeroBubble (ZB1P, the order its
// _get_1f1b_rank_ops gives with zero bubble on): micro-batches in rounds of m / max(1, m / p),
// 1f1b's warm-up, then per step a forward and an input half, and from step r on the weight half
// of the oldest backward; the remaining weight halves at the end. Each action a step of its
// own, as PyTorch's runtime posts them.
std::vector<Steps> zero_bubble_order(int p, int m, int v, int r) {
  const int rounds = std::max(1, m / p);
  DTRAIN_CHECK_AS(ConfigError, m % rounds == 0, "pipeline schedule zero_bubble runs ",
                  "micro-batches in ", rounds, " rounds: train.micro_batches (", m,
                  ") must be a multiple of ", rounds);
  const int per_round = m / rounds;
  const int total = m * v;
  const int warmup = std::min((v - 1) * per_round + (p - 1 - r), total);
  auto forward_stage = [&](int k) { return ((k / per_round) % v) * p + r; };
  auto backward_stage = [&](int k) { return (v - 1 - ((k - warmup) / per_round) % v) * p + r; };
  std::map<int, int> next_f, next_b, next_w;  // per stage: its next micro-batch
  std::vector<int> backward_ops;              // the op index of each backward, in order
  size_t weights = 0;
  std::vector<Steps> out;
  auto weight = [&] {
    const int st = backward_stage(backward_ops[weights++]);
    out.push_back({{Op::kBackwardWeight, st, next_w[st]++}});
  };
  for (int k = 0; k < total + warmup; ++k) {
    if (k < total) {
      const int st = forward_stage(k);
      out.push_back({{Op::kForward, st, next_f[st]++}});
    }
    if (k >= warmup) {
      const int st = backward_stage(k);
      out.push_back({{Op::kBackwardInput, st, next_b[st]++}});
      backward_ops.push_back(k);
      if (k - warmup >= r) weight();
    }
  }
  while (weights < backward_ops.size()) weight();
  return out;
}

}  // namespace

Schedule make_schedule(ScheduleKind kind, int ranks, int micro_batches, int stages_per_rank) {
  DTRAIN_CHECK_AS(ConfigError, ranks >= 1, "pipeline: ", ranks, " ranks");
  DTRAIN_CHECK_AS(ConfigError, micro_batches >= 1, "pipeline: ", micro_batches,
                  " micro-batches; a schedule needs at least one");
  const int p = ranks, m = micro_batches, v = stages_per_rank;
  if (kind == ScheduleKind::kInterleaved1F1B) {
    DTRAIN_CHECK_AS(ConfigError, v >= 2, "pipeline schedule interleaved_1f1b needs 2 or more ",
                    "stages per rank (parallel.pp_stages_per_rank), got ", v,
                    "; with one, choose 1f1b");
    DTRAIN_CHECK_AS(ConfigError, m % p == 0, "pipeline schedule interleaved_1f1b runs ",
                    "micro-batches in groups of the pipeline size: train.micro_batches (", m,
                    ") must be a multiple of parallel.pp (", p, ")");
  } else if (kind == ScheduleKind::kForwardOnly) {
    DTRAIN_CHECK_AS(ConfigError, v >= 1, "pipeline: ", v, " stages per rank");
  } else {
    // zero_bubble too: PyTorch's interleaved order at 2 or more stages per rank posts each
    // action's messages alone, which deadlocks where sends wait for their receives (the
    // strictest transport, simulate()'s); one stage per rank is ZB-H1.
    DTRAIN_CHECK_AS(ConfigError, v == 1, "pipeline schedule ", schedule_name(kind),
                    " holds one stage per rank, got ", v, "; for more choose interleaved_1f1b");
  }
  Schedule s;
  s.kind = kind;
  s.ranks = p;
  s.stages = p * v;
  s.micro_batches = m;
  s.promised_in_flight.assign(static_cast<size_t>(p), 0);
  std::vector<std::vector<Steps>> steps(static_cast<size_t>(p));
  for (int r = 0; r < p; ++r) {
    auto& list = steps[static_cast<size_t>(r)];
    int& promise = s.promised_in_flight[static_cast<size_t>(r)];
    if (kind == ScheduleKind::kForwardOnly) {
      // Micro-batches in groups of p, each group through every stage of the rank before the
      // next (the interleaved order; a whole stage at a time would leave the last rank's
      // first send waiting on rank 0, which waits on the rest of its stage).
      for (int g = 0; g < m; g += p) {
        for (int stage : s.stages_of(r)) {
          for (int i = g; i < std::min(m, g + p); ++i) list.push_back({{Op::kForward, stage, i}});
        }
      }
      promise = 0;  // nothing is held for a backward
    } else if (kind == ScheduleKind::kZeroBubble) {
      list = zero_bubble_order(p, m, v, r);
      int held = 0;
      for (const Steps& step : list) {
        for (const Action& a : step) {
          if (a.op == Op::kForward) promise = std::max(promise, ++held);
          if (a.op == Op::kBackwardWeight) --held;
        }
      }
    } else if (kind == ScheduleKind::kGPipe) {
      for (int i = 0; i < m; ++i) list.push_back({{Op::kForward, r, i}});
      for (int i = 0; i < m; ++i) list.push_back({{Op::kBackward, r, i}});
      promise = m;
    } else if (kind == ScheduleKind::k1F1B) {
      const int warmup = std::min(p - r - 1, m);
      for (int i = 0; i < warmup; ++i) list.push_back({{Op::kForward, r, i}});
      for (int i = 0; i < m - warmup; ++i) {
        list.push_back({{Op::kForward, r, warmup + i}});
        list.push_back({{Op::kBackward, r, i}});
      }
      for (int i = m - warmup; i < m; ++i) list.push_back({{Op::kBackward, r, i}});
      promise = std::min(p - r, m);
    } else {
      // Megatron's interleaved order: the k-th forward of this rank is micro-batch
      // (k / (p v)) p + k % p of its stage (k / p) % v; backwards likewise, stages reversed.
      const int total = m * v;
      auto micro_of = [&](int k) { return (k / (p * v)) * p + k % p; };
      auto forward = [&](int k) {
        return Action{Op::kForward, ((k / p) % v) * p + r, micro_of(k)};
      };
      auto backward = [&](int k) {
        return Action{Op::kBackward, (v - 1 - (k / p) % v) * p + r, micro_of(k)};
      };
      // With as many micro-batches as ranks every rank runs all its forwards first (as
      // Megatron does: a shorter warm-up on some ranks would leave the others waiting).
      const int warmup = m == p ? total : std::min((p - r - 1) * 2 + (v - 1) * p, total);
      for (int k = 0; k < warmup; ++k) list.push_back({forward(k)});
      for (int k = 0; k < total - warmup; ++k) {
        // Steady state: a forward and a backward as one step, whose sends and the next
        // step's receives go in one batch (Megatron's exchange in both directions at once;
        // posted apart, ranks p apart wait on each other).
        list.push_back({forward(warmup + k), backward(k)});
      }
      for (int k = total - warmup; k < total; ++k) list.push_back({backward(k)});
      promise = std::min(warmup + 1, total);
    }
  }
  s.actions = with_communication(steps, p, s.stages);
  return s;
}

std::vector<std::pair<int64_t, int64_t>> split_layers(int64_t layers, int stages,
                                                      const std::vector<int64_t>& split) {
  DTRAIN_CHECK_AS(ConfigError, stages >= 1, "pipeline: ", stages, " stages");
  std::vector<int64_t> counts = split;
  if (counts.empty()) {
    DTRAIN_CHECK_AS(ConfigError, layers >= stages, "pipeline: ", stages, " stages for a model of ",
                    layers, " layers would leave a stage empty; use at most ", layers, " stages");
    DTRAIN_CHECK_AS(ConfigError, layers % stages == 0, "pipeline: ", layers,
                    " layers do not split evenly into ", stages,
                    " stages; give each stage's layer count in parallel.pp_split (for example [",
                    layers / stages + 1, ", ..., ", layers / stages, "])");
    counts.assign(static_cast<size_t>(stages), layers / stages);
  }
  std::ostringstream given;
  for (size_t i = 0; i < counts.size(); ++i) given << (i ? ", " : "") << counts[i];
  DTRAIN_CHECK_AS(ConfigError, static_cast<int>(counts.size()) == stages, "parallel.pp_split [",
                  given.str(), "] names ", counts.size(), " stages, but the pipeline has ", stages,
                  " (parallel.pp x parallel.pp_stages_per_rank)");
  int64_t sum = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    DTRAIN_CHECK_AS(ConfigError, counts[i] >= 1, "parallel.pp_split [", given.str(),
                    "] leaves stage ", i, " without layers; every stage needs at least one");
    sum += counts[i];
  }
  DTRAIN_CHECK_AS(ConfigError, sum == layers, "parallel.pp_split [", given.str(), "] adds up to ",
                  sum, " layers, but the model has ", layers);
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t begin = 0;
  for (int64_t c : counts) {
    out.push_back({begin, begin + c});
    begin += c;
  }
  return out;
}

int message_tag(int boundary, int micro, bool grad, int micro_batches, int tags) {
  const int64_t n = (static_cast<int64_t>(boundary) * micro_batches + micro) * 2 + (grad ? 1 : 0);
  return static_cast<int>(n % tags);
}

void check_message_order(const Schedule& s, int tags) {
  if (2 * static_cast<int64_t>(s.stages - 1) * s.micro_batches <= tags) return;
  using Id = std::tuple<int, int, bool>;  // boundary, micro, gradient
  using Key = std::tuple<int, int, int>;  // from, to, tag
  std::map<Key, std::vector<Id>> sent, received;
  for (int r = 0; r < static_cast<int>(s.actions.size()); ++r) {
    for (const Action& a : s.actions[static_cast<size_t>(r)]) {
      int boundary = 0, peer = 0;
      bool grad = false, send = false;
      switch (a.op) {
        case Op::kSendActivation:
          boundary = a.stage, peer = s.rank_of(a.stage + 1), send = true;
          break;
        case Op::kRecvActivation:
          boundary = a.stage - 1, peer = s.rank_of(a.stage - 1);
          break;
        case Op::kSendGrad:
          boundary = a.stage - 1, peer = s.rank_of(a.stage - 1), grad = send = true;
          break;
        case Op::kRecvGrad:
          boundary = a.stage, peer = s.rank_of(a.stage + 1), grad = true;
          break;
        default:
          continue;
      }
      const int tag = message_tag(boundary, a.micro, grad, s.micro_batches, tags);
      if (send) {
        sent[{r, peer, tag}].emplace_back(boundary, a.micro, grad);
      } else {
        received[{peer, r, tag}].emplace_back(boundary, a.micro, grad);
      }
    }
  }
  auto name = [](const Id& id) {
    const auto& [boundary, micro, grad] = id;
    std::ostringstream os;
    os << (grad ? "the gradient of stage " : "the activation of stage ")
       << (grad ? boundary + 1 : boundary) << " micro-batch " << micro;
    return os.str();
  };
  for (const auto& [key, ids] : sent) {
    const std::vector<Id>& got = received[key];
    if (got == ids) continue;
    size_t k = 0;
    while (k < ids.size() && k < got.size() && ids[k] == got[k]) ++k;
    const auto& [from, to, tag] = key;
    DTRAIN_FAIL(UsageError, "pipeline schedule ", schedule_name(s.kind), ": ",
                2 * static_cast<int64_t>(s.stages - 1) * s.micro_batches, " messages share ", tags,
                " tags, and under tag ", tag, " rank ", from, " sends ",
                k < ids.size() ? name(ids[k]) : std::string("nothing more"), " where rank ", to,
                " receives ", k < got.size() ? name(got[k]) : std::string("nothing more"),
                ": the two would be swapped. Use fewer micro-batches or stages, so that "
                "2 x (stages - 1) x micro-batches is at most ",
                tags, ", or post the messages of one tag in the same order on both ranks");
  }
}

std::string format(const Schedule& s, int rank) {
  std::ostringstream os;
  bool in_batch = false;
  for (const Action& a : s.actions[static_cast<size_t>(rank)]) {
    if (a.is_compute()) {
      if (in_batch) os << "\n";
      os << to_string(a) << "\n";
      in_batch = false;
    } else {
      os << (in_batch ? "  " : "") << to_string(a);
      in_batch = true;
    }
  }
  if (in_batch) os << "\n";
  return os.str();
}

namespace {

using Key = std::tuple<int, int>;  // stage, micro

// The action on the other rank that pairs with a communication action.
Action counterpart(const Action& a) {
  switch (a.op) {
    case Op::kSendActivation:
      return {Op::kRecvActivation, a.stage + 1, a.micro};
    case Op::kRecvActivation:
      return {Op::kSendActivation, a.stage - 1, a.micro};
    case Op::kSendGrad:
      return {Op::kRecvGrad, a.stage - 1, a.micro};
    case Op::kRecvGrad:
      return {Op::kSendGrad, a.stage + 1, a.micro};
    default:
      return a;
  }
}

}  // namespace

Simulation simulate(const Schedule& s, double forward_cost, double backward_cost) {
  const int p = s.ranks, S = s.stages, M = s.micro_batches;
  DTRAIN_CHECK_AS(UsageError, static_cast<int>(s.actions.size()) == p,
                  "pipeline schedule: ", s.actions.size(), " action lists for ", p, " ranks");
  const double per_stage = static_cast<double>(s.stages_per_rank());
  const double fcost = forward_cost / per_stage, bcost = backward_cost / per_stage;
  Simulation out;
  out.spans.resize(static_cast<size_t>(p));
  out.peak_in_flight.assign(static_cast<size_t>(p), 0);
  std::vector<size_t> pc(static_cast<size_t>(p), 0);
  std::vector<double> clock(static_cast<size_t>(p), 0.0);
  std::vector<int> in_flight(static_cast<size_t>(p), 0);
  std::set<Key> forwarded, backwarded, activation_in, grad_in;
  std::set<Key> halves, weighted;  // backwards split (I run), and their W halves run
  std::set<std::tuple<int, int, int>> communicated;  // op, stage, micro
  const bool forward_only = s.kind == ScheduleKind::kForwardOnly;
  // Per rank, the batch at its head: its actions, which are complete, and when each rank
  // posted it.
  struct Posted {
    std::vector<Action> ops;
    std::vector<bool> done;
    std::vector<double> when;
    size_t length = 0;  // of the run in the list: its actions and the W actions among them
  };
  std::vector<Posted> posted(static_cast<size_t>(p));
  auto fail = [&](int r, const Action& a, const std::string& why) {
    DTRAIN_FAIL(UsageError, "pipeline schedule ", schedule_name(s.kind), ": rank ", r, ", ",
                to_string(a), ": ", why);
  };
  auto finished = [&](int r) { return pc[static_cast<size_t>(r)] >= s.actions[r].size(); };
  // A compute action of rank r: its checks, the bookkeeping, its span.
  auto compute = [&](int r, const Action& a) {
    const auto ri = static_cast<size_t>(r);
    const Key k{a.stage, a.micro};
    if (a.op == Op::kForward) {
      if (forwarded.count(k)) fail(r, a, "a second forward");
      const bool local = a.stage == 0 || s.rank_of(a.stage - 1) == r;
      if (local ? a.stage > 0 && !forwarded.count({a.stage - 1, a.micro})
                : !activation_in.count(k)) {
        fail(r, a,
             "its input has not arrived (no receive before it, or the stage before "
             "has not run)");
      }
      forwarded.insert(k);
      if (forward_only) {
        // nothing held
      } else if (++in_flight[ri] > s.promised_in_flight[ri]) {
        fail(r, a,
             std::to_string(in_flight[ri]) +
                 " micro-batches in flight, more than the schedule's promise of " +
                 std::to_string(s.promised_in_flight[ri]));
      }
      out.peak_in_flight[ri] = std::max(out.peak_in_flight[ri], in_flight[ri]);
    } else if (a.op == Op::kBackwardWeight) {
      if (weighted.count(k)) fail(r, a, "a second weight half");
      if (!halves.count(k)) fail(r, a, "a weight half before its input half");
      weighted.insert(k);
      --in_flight[ri];
    } else {
      if (forward_only) fail(r, a, "a backward in a forward-only schedule");
      if (backwarded.count(k)) fail(r, a, "a second backward");
      if (!forwarded.count(k)) fail(r, a, "a backward before its forward");
      const bool local = a.stage == S - 1 || s.rank_of(a.stage + 1) == r;
      if (local ? a.stage < S - 1 && !backwarded.count({a.stage + 1, a.micro})
                : !grad_in.count(k)) {
        fail(r, a, "its output's gradient has not arrived");
      }
      backwarded.insert(k);
      if (a.op == Op::kBackwardInput) {
        halves.insert(k);  // held until its W
      } else {
        --in_flight[ri];
      }
    }
    const double start = clock[ri];
    clock[ri] += a.op == Op::kForward ? fcost : a.op == Op::kBackward ? bcost : bcost / 2;
    out.spans[ri].push_back({a, start, clock[ri]});
  };
  for (;;) {
    bool progressed = false, all_done = true;
    for (int r = 0; r < p; ++r) {
      const auto ri = static_cast<size_t>(r);
      if (finished(r)) continue;
      all_done = false;
      const auto& list = s.actions[ri];
      const Action& a = list[pc[ri]];
      if (a.stage < 0 || a.stage >= S || a.micro < 0 || a.micro >= M) {
        fail(r, a, "no such stage or micro-batch");
      }
      if (s.rank_of(a.stage) != r) {
        fail(r, a,
             "stage " + std::to_string(a.stage) + " lives on rank " +
                 std::to_string(s.rank_of(a.stage)));
      }
      if (a.is_compute()) {
        compute(r, a);
        ++pc[ri];
        progressed = true;
        continue;
      }
      // A batch of communication: post it if not yet, then run the W actions among and right
      // after its actions while it is in flight (they need nothing from it).
      Posted& b = posted[ri];
      if (b.ops.empty()) {
        std::vector<Action> weights;
        size_t i = pc[ri];
        for (; i < list.size() && (!list[i].is_compute() || list[i].op == Op::kBackwardWeight);
             ++i) {
          const Action& c = list[i];
          if (c.op == Op::kBackwardWeight) {
            weights.push_back(c);
            continue;
          }
          if (c.op == Op::kSendActivation && !forwarded.count({c.stage, c.micro})) {
            fail(r, c, "sends an activation its forward has not computed");
          }
          if (c.op == Op::kSendGrad && !backwarded.count({c.stage, c.micro})) {
            fail(r, c, "sends a gradient its backward has not computed");
          }
          const Action other = counterpart(c);
          if (other.stage < 0 || other.stage >= S) fail(r, c, "no stage to pair with");
          if (s.rank_of(other.stage) == r) {
            fail(r, c,
                 "stage " + std::to_string(other.stage) +
                     " is on this rank too: nothing is sent between them");
          }
          if (!communicated.insert({static_cast<int>(c.op), c.stage, c.micro}).second) {
            fail(r, c, "done twice");
          }
          b.ops.push_back(c);
          b.done.push_back(false);
          b.when.push_back(clock[ri]);
        }
        b.length = i - pc[ri];
        for (const Action& w : weights) compute(r, w);
        progressed = true;
      }
      // Pair with the peers' posted batches.
      for (size_t i = 0; i < b.ops.size(); ++i) {
        if (b.done[i]) continue;
        const Action other = counterpart(b.ops[i]);
        Posted& pb = posted[static_cast<size_t>(s.rank_of(other.stage))];
        for (size_t j = 0; j < pb.ops.size(); ++j) {
          if (!pb.done[j] && pb.ops[j] == other) {
            const double t = std::max(b.when[i], pb.when[j]);
            b.done[i] = pb.done[j] = true;
            b.when[i] = pb.when[j] = t;
            progressed = true;
            break;
          }
        }
      }
      if (std::all_of(b.done.begin(), b.done.end(), [](bool d) { return d; })) {
        for (size_t i = 0; i < b.ops.size(); ++i) {
          const Action& c = b.ops[i];
          if (c.op == Op::kRecvActivation) activation_in.insert({c.stage, c.micro});
          if (c.op == Op::kRecvGrad) grad_in.insert({c.stage, c.micro});
          clock[ri] = std::max(clock[ri], b.when[i]);
        }
        pc[ri] += b.length;
        b = Posted{};
        progressed = true;
      }
    }
    if (all_done) break;
    if (!progressed) {
      std::ostringstream os;
      for (int r = 0; r < p; ++r) {
        if (finished(r)) continue;
        os << " rank " << r << " waits at";
        const Posted& b = posted[static_cast<size_t>(r)];
        for (size_t i = 0; i < b.ops.size(); ++i) {
          if (!b.done[i]) os << " " << to_string(b.ops[i]);
        }
        os << ";";
      }
      DTRAIN_FAIL(UsageError, "pipeline schedule ", schedule_name(s.kind), " deadlocks:", os.str(),
                  " no send meets its receive");
    }
  }
  for (int st = 0; st < S; ++st) {
    for (int m = 0; m < M; ++m) {
      if (!(forward_only ? forwarded : backwarded).count({st, m})) {
        DTRAIN_FAIL(UsageError, "pipeline schedule ", schedule_name(s.kind), ": rank ",
                    s.rank_of(st), " never runs ", forwarded.count({st, m}) ? "B " : "F ", st, ".",
                    m);
      }
    }
  }
  for (const Key& k : halves) {
    if (!weighted.count(k)) {
      DTRAIN_FAIL(UsageError, "pipeline schedule ", schedule_name(s.kind), ": rank ",
                  s.rank_of(std::get<0>(k)), " never runs W ", std::get<0>(k), ".", std::get<1>(k));
    }
  }
  out.makespan = *std::max_element(clock.begin(), clock.end());
  double busy = 0;
  for (const auto& spans : out.spans) {
    for (const Span& sp : spans) busy += sp.end - sp.start;
  }
  out.bubble = out.makespan > 0 ? 1.0 - busy / (p * out.makespan) : 0.0;
  return out;
}

double theoretical_bubble(const Schedule& s) {
  const double p = s.ranks, m = s.micro_batches, v = s.stages_per_rank();
  if (s.kind == ScheduleKind::kZeroBubble) return (p - 1) / (3 * v * m + p - 1);
  return (p - 1) / (v * m + p - 1);
}

}  // namespace dtrain::sharding::pp
