// Pipeline schedules as plain lists of actions, one list per pipeline rank, that a test can
// print and check and the runtime (sharding/pipeline.h) executes in order.
//
// A model of S stages runs on `ranks` pipeline ranks: stage s lives on rank s % ranks, so a
// rank holds S / ranks stages ("virtual stages" when more than one: Megatron's and PyTorch's
// looping placement). Each micro-batch m runs forward through stages 0..S-1, then backward
// from S-1 down to 0. Actions:
//
//   F s.m   forward of stage s on micro-batch m     B s.m   its backward
//   I s.m   its backward's input half               W s.m   its weight half (zero_bubble)
//   SA s.m  send stage s's output to rank(s + 1)    RA s.m  receive stage s's input
//   SG s.m  send the gradient of stage s's input    RG s.m  receive the gradient of its output
//
// Consecutive communication actions form one batch (Communicator::batch_p2p), posted together
// and complete when all are: the sends that follow a compute action and the receives that the
// next one needs, as PyTorch's schedules batch them. Between two stages on one rank (a single
// pipeline rank) nothing is sent.
//
// Schedules (micro-batches m, ranks p, v stages per rank):
//   gpipe             all forwards, then all backwards; m micro-batches held on every rank.
//   1f1b              p - r - 1 warm-up forwards on rank r, then one forward and one backward
//                     in turn, then the remaining backwards; min(p - r, m) held.
//   interleaved_1f1b  v >= 2 stages per rank, Megatron's order (micro-batches in groups of p,
//                     each group through every stage of the rank before the next group): a
//                     bubble v times smaller; m must be a multiple of p.
//   zero_bubble       ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"), one stage per
//                     rank, in the order of PyTorch's ScheduleInterleavedZeroBubble with one
//                     stage: each backward split into I, the input's gradient that the
//                     previous stage waits for, and W, the weights', which rank r runs r steps
//                     late and in the cool-down, where 1f1b idles. With F = I = W the bubble is
//                     (p - 1) / (3 m + p - 1), a third of 1f1b's at m >> p; min(p, m) held
//                     (a micro-batch is held until its W). m must be a multiple of
//                     max(1, m / p).
//
// A W action right after communication actions runs while their batch is in flight (posted,
// not yet waited for): the batch continues past it.
// Backwards (and W halves) run in micro-batch order on every stage, so gradients accumulate in
// the order of one process running the micro-batches one after another.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace dtrain::sharding::pp {

enum class Op {
  kForward,
  kBackward,
  kSendActivation,
  kRecvActivation,
  kSendGrad,
  kRecvGrad,
  kBackwardInput,
  kBackwardWeight
};

struct Action {
  Op op = Op::kForward;
  int stage = 0;
  int micro = 0;
  bool is_compute() const {
    return op == Op::kForward || op == Op::kBackward || op == Op::kBackwardInput ||
           op == Op::kBackwardWeight;
  }
  // B or I: what gives the input's gradient (and needs the output's).
  bool gives_input_grad() const { return op == Op::kBackward || op == Op::kBackwardInput; }
  bool operator==(const Action& o) const {
    return op == o.op && stage == o.stage && micro == o.micro;
  }
};

// "F 3.1", "SG 0.2"
std::string to_string(const Action& a);

// kForwardOnly: forwards alone, for evaluation (no backward, nothing held for one; PyTorch's
// _ScheduleForwardOnly), any number of stages per rank: micro-batches in groups of the
// pipeline's size, each group through all of a rank's stages before the next.
// parse_schedule does not take it: it trains nothing.
enum class ScheduleKind { kGPipe, k1F1B, kInterleaved1F1B, kForwardOnly, kZeroBubble };
const char* schedule_name(ScheduleKind k);
// "gpipe", "1f1b", "interleaved_1f1b", "zero_bubble" (ConfigError naming the choices
// otherwise).
ScheduleKind parse_schedule(const std::string& name);

struct Schedule {
  ScheduleKind kind = ScheduleKind::k1F1B;
  int ranks = 1;
  int stages = 1;
  int micro_batches = 1;
  std::vector<std::vector<Action>> actions;  // per rank, in order
  // Per rank: the most micro-batches whose forward has run and backward has not, over all its
  // stages, that the schedule promises (the activations a rank holds).
  std::vector<int> promised_in_flight;

  int rank_of(int stage) const { return stage % ranks; }
  int stages_per_rank() const { return stages / ranks; }
  // The stages of `rank`, in order.
  std::vector<int> stages_of(int rank) const;
};

// The schedule of `kind` for `ranks` pipeline ranks with `stages_per_rank` stages each (1 but
// for interleaved_1f1b, which needs 2 or more) and `micro_batches` micro-batches.
// ConfigError on a combination the schedule cannot run.
Schedule make_schedule(ScheduleKind kind, int ranks, int micro_batches, int stages_per_rank = 1);

// Adds the communication to per-rank compute orders (F and B actions), step by step: each
// step's receives before it and its sends after it, so that a step's sends and the next one's
// receives form one batch. A step is one compute action, or in interleaved_1f1b's steady state
// a forward and a backward (Megatron's exchange in both directions at once, which keeps it
// free of deadlock). make_schedule's lists come from this; a test builds its own orders.
using Steps = std::vector<Action>;
std::vector<std::vector<Action>> with_communication(const std::vector<std::vector<Steps>>& steps,
                                                    int ranks, int stages);
// Each compute action a step of its own.
std::vector<std::vector<Action>> with_communication(const std::vector<std::vector<Action>>& compute,
                                                    int ranks, int stages);

// The layers of each stage, [begin, end) per stage: `split` (layer counts per stage, as
// parallel.pp_split gives them), or an even split when it is empty. ConfigError naming the
// counts when a stage would be empty, when the counts do not add up to `layers`, or, with no
// split given, when `stages` does not divide `layers` (an uneven split must be spelled out).
std::vector<std::pair<int64_t, int64_t>> split_layers(int64_t layers, int stages,
                                                      const std::vector<int64_t>& split = {});

// One rank's list, one action per line, batches of communication on one line.
std::string format(const Schedule& s, int rank);

// The schedule run on paper, every rank at once, with forward and backward costs per stage and
// free communication in which a send and its receive complete together once both are posted
// (no buffering, the strictest transport). Throws UsageError naming the rank and action for
// the first problem:
//   - a deadlock (every unfinished rank waits; each one's waiting action is named);
//   - a forward whose input has not arrived, a backward before its forward or before its
//     output's gradient, a send of something not computed, an action of a stage the rank does
//     not hold, anything done twice or left undone;
//   - a rank holding more micro-batches in flight than promised_in_flight.
struct Span {
  Action action;
  double start = 0, end = 0;
};
struct Simulation {
  double makespan = 0;
  double bubble = 0;  // idle fraction of ranks x makespan
  std::vector<int> peak_in_flight;
  std::vector<std::vector<Span>> spans;  // per rank, compute actions
};
Simulation simulate(const Schedule& s, double forward_cost = 1.0, double backward_cost = 2.0);
inline void check(const Schedule& s) { simulate(s); }

// The message tag (in [0, tags)) of the activation (grad = false) or gradient between stages
// `boundary` and boundary + 1 for micro-batch `micro`. Distinct for every message of a step
// while 2 (stages - 1) micro_batches <= tags; past that, tags repeat.
int message_tag(int boundary, int micro, bool grad, int micro_batches, int tags);
// Where tags repeat, messages of one tag between two ranks pair up in the order they are
// posted: throws UsageError naming both ranks, the tag and the two messages when a rank
// receives those of one tag in another order than its peer sends them (a schedule that would
// swap two micro-batches' activations silently). Every schedule make_schedule builds passes.
void check_message_order(const Schedule& s, int tags);

// The bubble fraction the literature gives: (p - 1) / (m + p - 1) for gpipe and 1f1b,
// (p - 1) / (v m + p - 1) for interleaved_1f1b, (p - 1) / (3 m + p - 1) for zero_bubble
// (with I and W each half of a backward's cost, as simulate() takes them).
double theoretical_bubble(const Schedule& s);

}  // namespace dtrain::sharding::pp
