// Pipeline schedules on paper: every schedule at every size runs without deadlock, every
// forward before its backward, holding what it promises; its simulated bubble against the
// literature's; and broken schedules (misordered, a missing receive, too many in flight)
// refused naming the rank and action.
#include "sharding/pipeline_schedule.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "core/error.h"

namespace dtrain::sharding::pp {
namespace {

std::string error_of(const Schedule& s) {
  try {
    check(s);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}

TEST(PipelineSchedule, EveryScheduleRunsAndHoldsWhatItPromises) {
  for (auto kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B}) {
    for (int p : {1, 2, 3, 4, 8}) {
      for (int m : {1, 2, 3, 4, 8, 16}) {
        SCOPED_TRACE(std::string(schedule_name(kind)) + " p=" + std::to_string(p) +
                     " m=" + std::to_string(m));
        Schedule s = make_schedule(kind, p, m);
        Simulation sim = simulate(s);
        // Forward 1, backward 2 per stage, free communication: the textbook bubble exactly.
        EXPECT_NEAR(sim.bubble, theoretical_bubble(s), 1e-12);
        for (int r = 0; r < p; ++r) {
          EXPECT_EQ(sim.peak_in_flight[r], s.promised_in_flight[r]);
          EXPECT_EQ(sim.spans[r].size(), 2u * m);
        }
        if (kind == ScheduleKind::k1F1B) {
          EXPECT_EQ(sim.peak_in_flight[0], std::min(p, m));
        }
      }
    }
  }
}

// Every combination make_schedule accepts, up to 8 ranks, 4 stages each and 24 micro-batches:
// no deadlock, the promise kept, the textbook bubble.
TEST(PipelineSchedule, EveryAcceptedCombinationChecks) {
  int accepted = 0;
  for (auto kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kInterleaved1F1B}) {
    for (int p = 1; p <= 8; ++p) {
      for (int v = 1; v <= 4; ++v) {
        for (int m = 1; m <= 24; ++m) {
          Schedule s;
          try {
            s = make_schedule(kind, p, m, v);
          } catch (const ConfigError&) {
            continue;
          }
          ++accepted;
          SCOPED_TRACE(std::string(schedule_name(kind)) + " p=" + std::to_string(p) +
                       " v=" + std::to_string(v) + " m=" + std::to_string(m));
          Simulation sim = simulate(s);
          EXPECT_NEAR(sim.bubble, theoretical_bubble(s), 1e-9);
          EXPECT_EQ(sim.peak_in_flight, s.promised_in_flight);
        }
      }
    }
  }
  EXPECT_GT(accepted, 500);
}

// Forward-only (evaluation) at every size: no deadlock, nothing held, no backward.
TEST(PipelineSchedule, ForwardOnlyRunsEverywhereHoldingNothing) {
  for (int p = 1; p <= 8; ++p) {
    for (int v = 1; v <= 4; ++v) {
      for (int m = 1; m <= 24; ++m) {
        SCOPED_TRACE("p=" + std::to_string(p) + " v=" + std::to_string(v) +
                     " m=" + std::to_string(m));
        Schedule s = make_schedule(ScheduleKind::kForwardOnly, p, m, v);
        Simulation sim = simulate(s);
        for (int r = 0; r < p; ++r) {
          EXPECT_EQ(sim.peak_in_flight[r], 0);
          EXPECT_EQ(sim.spans[r].size(), static_cast<size_t>(m * v));
        }
      }
    }
  }
  // A backward in it is refused.
  Schedule s = make_schedule(ScheduleKind::kForwardOnly, 1, 1);
  s.actions[0].push_back({Op::kBackward, 0, 0});
  EXPECT_NE(error_of(s).find("a backward in a forward-only schedule"), std::string::npos);
}

TEST(PipelineSchedule, InterleavedHasTheSmallerBubble) {
  for (int p : {2, 4}) {
    for (int v : {2, 3}) {
      for (int m : {p, 2 * p, 4 * p}) {
        SCOPED_TRACE("p=" + std::to_string(p) + " v=" + std::to_string(v) +
                     " m=" + std::to_string(m));
        Schedule s = make_schedule(ScheduleKind::kInterleaved1F1B, p, m, v);
        Simulation sim = simulate(s);
        Simulation plain = simulate(make_schedule(ScheduleKind::k1F1B, p, m));
        EXPECT_LT(sim.bubble, plain.bubble);
        EXPECT_NEAR(sim.bubble, theoretical_bubble(s), 1e-12);
        for (int r = 0; r < p; ++r) {
          EXPECT_EQ(sim.peak_in_flight[r], s.promised_in_flight[r]);
          EXPECT_EQ(sim.spans[r].size(), 2u * m * v);
        }
        std::printf("interleaved p=%d v=%d m=%d: bubble %.4f (theory %.4f, 1f1b %.4f)\n", p, v, m,
                    sim.bubble, theoretical_bubble(s), plain.bubble);
      }
    }
  }
}

// Zero bubble (ZB-H1): every size runs without deadlock, each W after its I, holding what it
// promises (min(p, m): 1f1b's first rank's); its bubble is the literature's from m = p on, and
// below 1f1b's at every size.
TEST(PipelineSchedule, ZeroBubbleRunsEverywhereWithTheSmallestBubble) {
  int accepted = 0;
  for (int p = 1; p <= 8; ++p) {
    for (int m = 1; m <= 24; ++m) {
      Schedule s;
      try {
        s = make_schedule(ScheduleKind::kZeroBubble, p, m);
      } catch (const ConfigError&) {
        continue;
      }
      ++accepted;
      SCOPED_TRACE("p=" + std::to_string(p) + " m=" + std::to_string(m));
      Simulation sim = simulate(s);
      EXPECT_EQ(sim.peak_in_flight, s.promised_in_flight);
      for (int r = 0; r < p; ++r) {
        EXPECT_EQ(sim.spans[r].size(), 3u * m);
        EXPECT_EQ(s.promised_in_flight[r], std::min(p, m));
      }
      if (m >= p) {
        EXPECT_NEAR(sim.bubble, theoretical_bubble(s), 1e-12);
      }
      if (p > 1) {
        Simulation base = simulate(make_schedule(ScheduleKind::k1F1B, p, m));
        EXPECT_LT(sim.bubble, base.bubble);
        if (m == 2 * p || m == 4 * p) {
          std::printf("zero_bubble p=%d m=%d: bubble %.4f (theory %.4f, 1f1b %.4f)\n", p, m,
                      sim.bubble, theoretical_bubble(s), base.bubble);
        }
      }
    }
  }
  EXPECT_GT(accepted, 130);
  EXPECT_THROW(make_schedule(ScheduleKind::kZeroBubble, 2, 4, 2), ConfigError);
}

// The order is PyTorch's (ScheduleInterleavedZeroBubble with one stage per rank, as its
// _calculate_single_rank_operations gives it at pp 4 with 8 micro-batches, bubbles left out).
TEST(PipelineSchedule, ZeroBubbleRunsPyTorchsOrder) {
  const char* const pytorch[] = {
      "F0 F1 F2 F3 I0 W0 F4 I1 W1 F5 I2 W2 F6 I3 W3 F7 I4 W4 I5 W5 I6 W6 I7 W7",
      "F0 F1 F2 I0 F3 I1 W0 F4 I2 W1 F5 I3 W2 F6 I4 W3 F7 I5 W4 I6 W5 I7 W6 W7",
      "F0 F1 I0 F2 I1 F3 I2 W0 F4 I3 W1 F5 I4 W2 F6 I5 W3 F7 I6 W4 I7 W5 W6 W7",
      "F0 I0 F1 I1 F2 I2 F3 I3 W0 F4 I4 W1 F5 I5 W2 F6 I6 W3 F7 I7 W4 W5 W6 W7"};
  Schedule s = make_schedule(ScheduleKind::kZeroBubble, 4, 8);
  for (int r = 0; r < 4; ++r) {
    std::string mine;
    for (const Action& a : s.actions[r]) {
      if (!a.is_compute()) continue;
      const std::string name = to_string(a);  // "I 2.5"
      mine += (mine.empty() ? "" : " ") + name.substr(0, name.find(' ')) +
              name.substr(name.find('.') + 1);
    }
    EXPECT_EQ(mine, pytorch[r]) << "rank " << r;
  }
}

TEST(PipelineSchedule, PrintsOneRanksActions) {
  Schedule s = make_schedule(ScheduleKind::k1F1B, 2, 3);
  EXPECT_EQ(format(s, 0),
            "F 0.0\n"
            "SA 0.0\n"
            "F 0.1\n"
            "SA 0.1  RG 0.0\n"
            "B 0.0\n"
            "F 0.2\n"
            "SA 0.2  RG 0.1\n"
            "B 0.1\n"
            "RG 0.2\n"
            "B 0.2\n");
  EXPECT_EQ(format(s, 1),
            "RA 1.0\n"
            "F 1.0\n"
            "B 1.0\n"
            "SG 1.0  RA 1.1\n"
            "F 1.1\n"
            "B 1.1\n"
            "SG 1.1  RA 1.2\n"
            "F 1.2\n"
            "B 1.2\n"
            "SG 1.2\n");
}

TEST(PipelineSchedule, MisorderedSchedulesAreRefused) {
  // The last rank runs micro-batch 1's backward before 0's: the rank before it waits for 0's
  // gradient while 1's is offered: a deadlock, with each rank's waiting action named.
  Schedule s = make_schedule(ScheduleKind::k1F1B, 2, 3);
  {
    Schedule bad = s;
    // F1.0 B1.0 F1.1 B1.1 ... -> F1.0 F1.1 B1.1 B1.0 F1.2 B1.2
    std::vector<std::vector<Action>> orders(2);
    for (const Action& a : bad.actions[0]) {
      if (a.is_compute()) orders[0].push_back(a);
    }
    orders[1] = {{Op::kForward, 1, 0},  {Op::kForward, 1, 1}, {Op::kBackward, 1, 1},
                 {Op::kBackward, 1, 0}, {Op::kForward, 1, 2}, {Op::kBackward, 1, 2}};
    bad.actions = with_communication(orders, 2, 2);
    bad.promised_in_flight = {2, 2};
    EXPECT_NE(error_of(bad).find("deadlocks: rank 0 waits at RG 0.0; rank 1 waits at SG 1.1;"),
              std::string::npos)
        << error_of(bad);
  }
  {
    // A receive dropped: the forward has no input.
    Schedule bad = s;
    auto& l = bad.actions[1];
    l.erase(std::find(l.begin(), l.end(), Action{Op::kRecvActivation, 1, 1}));
    EXPECT_NE(error_of(bad).find("rank 1, F 1.1: its input has not arrived"), std::string::npos)
        << error_of(bad);
  }
  {
    // A backward before its forward.
    Schedule bad = s;
    auto& l = bad.actions[1];
    std::iter_swap(std::find(l.begin(), l.end(), Action{Op::kForward, 1, 0}),
                   std::find(l.begin(), l.end(), Action{Op::kBackward, 1, 0}));
    EXPECT_NE(error_of(bad).find("rank 1, B 1.0: a backward before its forward"), std::string::npos)
        << error_of(bad);
  }
  {
    // One warm-up forward more than 1F1B promises on rank 0.
    Schedule bad = make_schedule(ScheduleKind::k1F1B, 4, 8);
    Schedule gpipe = make_schedule(ScheduleKind::kGPipe, 4, 8);
    bad.actions[0] = gpipe.actions[0];
    EXPECT_NE(
        error_of(bad).find(
            "rank 0, F 0.4: 5 micro-batches in flight, more than the schedule's promise of 4"),
        std::string::npos)
        << error_of(bad);
  }
  {
    // A stage on the wrong rank, and a micro-batch never run.
    Schedule bad = s;
    bad.actions[0][0].stage = 1;
    EXPECT_NE(error_of(bad).find("rank 0, F 1.0: stage 1 lives on rank 1"), std::string::npos);
    // Communication between stages on one rank, and a message sent twice.
    Schedule self = make_schedule(ScheduleKind::kInterleaved1F1B, 1, 2, 2);
    self.actions[0].insert(self.actions[0].begin() + 1, Action{Op::kSendActivation, 0, 0});
    EXPECT_NE(error_of(self).find("stage 1 is on this rank too"), std::string::npos)
        << error_of(self);
    Schedule twice = s;
    auto& t = twice.actions[0];
    t.insert(std::find(t.begin(), t.end(), Action{Op::kSendActivation, 0, 0}) + 1,
             Action{Op::kSendActivation, 0, 0});
    EXPECT_NE(error_of(twice).find("SA 0.0: done twice"), std::string::npos) << error_of(twice);
    Schedule lost = s;
    auto& l = lost.actions[1];
    l.erase(std::find(l.begin(), l.end(), Action{Op::kBackward, 1, 2}));
    EXPECT_NE(error_of(lost).find("sends a gradient its backward has not computed"),
              std::string::npos)
        << error_of(lost);
  }
}

// A zero-bubble list with a W moved before its I, or a W dropped, is refused by name.
TEST(PipelineSchedule, MisorderedWeightHalvesAreRefused) {
  Schedule s = make_schedule(ScheduleKind::kZeroBubble, 2, 4);
  Schedule early = s;
  auto& e = early.actions[1];
  auto w = std::find(e.begin(), e.end(), Action{Op::kBackwardWeight, 1, 1});
  const Action moved = *w;
  e.erase(w);
  e.insert(std::find(e.begin(), e.end(), Action{Op::kBackwardInput, 1, 1}), moved);
  EXPECT_NE(error_of(early).find("rank 1, W 1.1: a weight half before its input half"),
            std::string::npos)
      << error_of(early);
  Schedule dropped = s;
  auto& d = dropped.actions[0];
  d.erase(std::find(d.begin(), d.end(), Action{Op::kBackwardWeight, 0, 3}));
  EXPECT_NE(error_of(dropped).find("rank 0 never runs W 0.3"), std::string::npos)
      << error_of(dropped);
}

TEST(PipelineSchedule, LayersSplitEvenlyOrAsGivenAndBadSplitsAreRefused) {
  using Ranges = std::vector<std::pair<int64_t, int64_t>>;
  EXPECT_EQ(split_layers(8, 4), (Ranges{{0, 2}, {2, 4}, {4, 6}, {6, 8}}));
  EXPECT_EQ(split_layers(8, 2, {3, 5}), (Ranges{{0, 3}, {3, 8}}));
  auto error_of_split = [](int64_t layers, int stages, std::vector<int64_t> split) {
    try {
      split_layers(layers, stages, split);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(error_of_split(8, 3, {}).find("8 layers do not split evenly into 3 stages; give "
                                          "each stage's layer count in parallel.pp_split"),
            std::string::npos);
  EXPECT_NE(error_of_split(2, 4, {}).find("would leave a stage empty"), std::string::npos);
  EXPECT_NE(error_of_split(8, 2, {8, 0}).find("leaves stage 1 without layers"), std::string::npos);
  EXPECT_NE(error_of_split(8, 2, {3, 4}).find("adds up to 7 layers, but the model has 8"),
            std::string::npos);
  EXPECT_NE(error_of_split(8, 4, {4, 4}).find("names 2 stages, but the pipeline has 4"),
            std::string::npos);
}

TEST(PipelineSchedule, ImpossibleConfigurationsAreRefused) {
  EXPECT_THROW(make_schedule(ScheduleKind::kInterleaved1F1B, 4, 6, 2), ConfigError);
  EXPECT_THROW(make_schedule(ScheduleKind::kInterleaved1F1B, 4, 8, 1), ConfigError);
  EXPECT_THROW(make_schedule(ScheduleKind::k1F1B, 4, 8, 2), ConfigError);
  EXPECT_THROW(make_schedule(ScheduleKind::k1F1B, 4, 0), ConfigError);
  EXPECT_THROW(parse_schedule("zb-v"), ConfigError);
  EXPECT_THROW(parse_schedule("forward_only"), ConfigError);  // trains nothing
  EXPECT_EQ(parse_schedule("interleaved_1f1b"), ScheduleKind::kInterleaved1F1B);
  EXPECT_EQ(parse_schedule("zero_bubble"), ScheduleKind::kZeroBubble);
}

// Past 2 (stages - 1) micro-batches messages per step, tags repeat and messages of one tag
// pair up in the order they are posted: the schedules built here keep that order on both
// ranks, and one that does not is refused before it could swap two activations.
TEST(PipelineSchedule, RepeatedTagsMustPairInOrder) {
  constexpr int kTags = 16384;
  EXPECT_EQ(message_tag(0, 8192, false, 8200, kTags), message_tag(0, 0, false, 8200, kTags));
  EXPECT_NE(message_tag(0, 8191, false, 8200, kTags), message_tag(0, 0, false, 8200, kTags));
  for (auto kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kZeroBubble}) {
    const Schedule s = make_schedule(kind, 2, 8200);
    EXPECT_NO_THROW(check_message_order(s, kTags)) << schedule_name(kind);
  }
  EXPECT_NO_THROW(check_message_order(make_schedule(ScheduleKind::kInterleaved1F1B, 4, 1400, 2),
                                      kTags));  // 2 x 7 x 1400 = 19600 messages
  // Micro-batches 0 and 8192 share tag 0 between stages 0 and 1.
  Schedule s;
  s.ranks = 2;
  s.stages = 2;
  s.micro_batches = 8200;
  s.actions = {{{Op::kSendActivation, 0, 0}, {Op::kSendActivation, 0, 8192}},
               {{Op::kRecvActivation, 1, 0}, {Op::kRecvActivation, 1, 8192}}};
  EXPECT_NO_THROW(check_message_order(s, kTags));
  EXPECT_NO_THROW(check_message_order(s, 2 * 8200));  // every message its own tag
  std::swap(s.actions[1][0], s.actions[1][1]);
  EXPECT_NO_THROW(check_message_order(s, 2 * 8200));
  try {
    check_message_order(s, kTags);
    ADD_FAILURE() << "a swap of micro-batches 0 and 8192 was not refused";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "under tag 0 rank 0 sends the activation of stage 0 micro-batch 0 where rank 1 "
                  "receives the activation of stage 0 micro-batch 8192"),
              std::string::npos)
        << e.what();
  }
  // Gradients too: stage 1's to stage 0.
  s.actions = {{{Op::kRecvGrad, 0, 8192}, {Op::kRecvGrad, 0, 0}},
               {{Op::kSendGrad, 1, 0}, {Op::kSendGrad, 1, 8192}}};
  EXPECT_THROW(check_message_order(s, kTags), UsageError);
}

}  // namespace
}  // namespace dtrain::sharding::pp
