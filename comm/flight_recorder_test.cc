// The flight recorder's ring: what it keeps, in which order, with which states, what a dump
// writes, and what recording costs per collective (printed: benchmarks, not timed asserts).
#include "comm/flight_recorder.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <memory>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace dtrain::comm {
namespace {

CollectiveInfo info(int64_t seq) {
  // One member list, as a communicator shares one (the recorder keeps each it sees).
  static const auto ranks = std::make_shared<const std::vector<int>>(std::vector<int>{0, 1});
  CollectiveInfo i;
  i.op = "all_reduce";
  i.seq = seq;
  i.dtype = c10::kFloat;
  i.numel = 1000 + seq;
  i.backend = "gloo";
  i.ranks = ranks;
  return i;
}

size_t count(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

// main() sets DTRAIN_FLIGHT_ENTRIES=4 before the first record.
TEST(FlightRecorder, KeepsTheLastEntriesWithTheirStates) {
  std::vector<int64_t> tickets;
  for (int64_t seq = 1; seq <= 6; ++seq) tickets.push_back(flight::issued(info(seq)));
  flight::started(tickets[0]);  // overwritten by #5: ignored
  flight::ended(tickets[0], flight::State::kCompleted);
  flight::started(tickets[2]);
  flight::ended(tickets[2], flight::State::kCompleted);
  flight::started(tickets[3]);
  flight::ended(tickets[4], flight::State::kTimedOut);
  const std::string json = flight::to_json("test");
  EXPECT_EQ(count(json, "\"seq\":"), 4u) << json;
  EXPECT_EQ(json.find("\"seq\":2,"), std::string::npos) << json;
  // Oldest first: #3 completed, #4 started, #5 timed out, #6 issued.
  const size_t s3 = json.find("\"seq\":3,"), s4 = json.find("\"seq\":4,");
  const size_t s5 = json.find("\"seq\":5,"), s6 = json.find("\"seq\":6,");
  ASSERT_TRUE(s3 < s4 && s4 < s5 && s5 < s6) << json;
  EXPECT_NE(json.find("\"state\":\"completed\"", s3), std::string::npos);
  EXPECT_LT(json.find("\"state\":\"completed\"", s3), s4) << json;
  EXPECT_LT(json.find("\"state\":\"started\"", s4), s5) << json;
  EXPECT_LT(json.find("\"state\":\"timed out\"", s5), s6) << json;
  EXPECT_NE(json.find("\"state\":\"issued\"", s6), std::string::npos) << json;
  EXPECT_NE(json.find("\"numel\":1006,\"backend\":\"gloo\",\"ranks\":[0,1]"), std::string::npos)
      << json;
  EXPECT_NE(json.find("\"reason\":\"test\""), std::string::npos) << json;
}

TEST(FlightRecorder, DumpsToTheRunFolderOnlyWhenOneIsSet) {
  flight::set_dump_dir("", 0);
  EXPECT_EQ(flight::dump("nowhere"), "");
  const char* base = std::getenv("TEST_TMPDIR");
  std::string dir = std::string(base ? base : "/tmp") + "/flightXXXXXX";
  ASSERT_NE(::mkdtemp(dir.data()), nullptr);
  flight::set_dump_dir(dir, 3);
  const std::string path = flight::dump("a \"quoted\" reason");
  EXPECT_EQ(path, dir + "/flight_rank3.json");
  std::ifstream f(path);
  std::stringstream text;
  text << f.rdbuf();
  EXPECT_EQ(text.str().rfind("{\"rank\":3,", 0), 0u) << text.str();
  EXPECT_NE(text.str().find("\"reason\":\"a \\\"quoted\\\" reason\""), std::string::npos)
      << text.str();
}

// Slots are written without a lock: a dump taken while another thread records keeps only
// whole entries (each entry's numel is 1000 + its seq, so a torn one shows), and an entry
// being rewritten is left out rather than mixed with its successor. The writer's seqs start
// at 10001, above the earlier tests', so the dumps must show its entries, not theirs.
TEST(FlightRecorder, ADumpDuringRecordingHoldsOnlyWholeEntries) {
  std::atomic<bool> stop{false};
  std::atomic<int64_t> written{0};
  std::thread writer([&] {
    for (int64_t seq = 10001; !stop.load(); seq = seq < 100000 ? seq + 1 : 10001) {
      const int64_t t = flight::issued(info(seq));
      flight::started(t);
      flight::ended(t, flight::State::kCompleted);
      written.fetch_add(1);
    }
  });
  while (written.load() == 0) std::this_thread::yield();
  int64_t entries = 0, theirs = 0, torn = 0, unmatched = 0, overfull = 0;
  const std::regex entry(
      "\"seq\":([0-9]+),\"op\":\"all_reduce\",\"dtype\":\"fp32\",\"numel\":([0-9]+),"
      "\"backend\":\"gloo\",\"ranks\":\\[0,1\\],\"issued_us\":[1-9][0-9]*,\"started_us\":[0-9]+,"
      "\"ended_us\":[0-9]+,\"state\":\"(issued|started|completed)\"\\}");
  for (int d = 0; d < 20000; ++d) {
    const std::string json = flight::to_json("concurrent");
    const int64_t records = static_cast<int64_t>(count(json, "\"seq\":"));
    int64_t matched = 0;
    for (auto it = std::sregex_iterator(json.begin(), json.end(), entry);
         it != std::sregex_iterator(); ++it, ++matched) {
      const int64_t seq = std::stoll((*it)[1]);
      if (std::stoll((*it)[2]) != 1000 + seq) ++torn;
      if (seq > 10000) ++theirs;
    }
    entries += matched;
    unmatched += records - matched;  // an entry with a field out of place
    overfull += records > 4;
  }
  stop = true;
  writer.join();
  EXPECT_EQ(torn, 0) << "of " << entries << " entries";
  EXPECT_EQ(unmatched, 0) << "of " << entries << " entries";
  EXPECT_EQ(overfull, 0) << "dumps with more entries than the ring holds";
  EXPECT_GT(theirs, 0) << "no dump saw the writer's entries";
  std::printf("concurrent dumps: %lld entries, %lld from the writer (%lld collectives recorded)\n",
              static_cast<long long>(entries), static_cast<long long>(theirs),
              static_cast<long long>(written.load()));
}

// What one collective's three records cost (issue, start, end), for docs/benchmarks.md.
TEST(FlightRecorder, CostPerCollectiveIsPrinted) {
  const CollectiveInfo i = info(1);
  constexpr int kN = 200000;
  const auto t0 = std::chrono::steady_clock::now();
  for (int n = 0; n < kN; ++n) {
    const int64_t t = flight::issued(i);
    flight::started(t);
    flight::ended(t, flight::State::kCompleted);
  }
  const double ns =
      std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / kN;
  std::printf("flight recorder: %.0f ns per collective (issue + start + end)\n", ns);
  EXPECT_GT(ns, 0.0);
}

}  // namespace
}  // namespace dtrain::comm

int main(int argc, char** argv) {
  ::setenv("DTRAIN_FLIGHT_ENTRIES", "4", 1);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
