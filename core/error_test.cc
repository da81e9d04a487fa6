#include "core/error.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <map>

#include "core/env.h"
#include "core/faults.h"
#include "core/logging.h"

namespace dtrain {
namespace {

TEST(Error, CheckThrowsTheChosenTypeWithMessageAndLocation) {
  try {
    DTRAIN_CHECK_AS(ConfigError, 1 + 1 == 3, "expected ", 3, ", got ", 2);
    FAIL() << "no throw";
  } catch (const ConfigError& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("expected 3, got 2"), std::string::npos) << what;
    EXPECT_NE(what.find("core/error_test.cc:"), std::string::npos) << what;
  }
}

TEST(Error, TimeoutIsACommErrorIsAnError) {
  EXPECT_THROW(DTRAIN_FAIL(TimeoutError, "late"), CommError);
  EXPECT_THROW(DTRAIN_FAIL(TimeoutError, "late"), Error);
  EXPECT_NO_THROW(DTRAIN_CHECK(true, "never"));
}

// An `else` after a check binds to the caller's `if`, not to one hidden in the macro.
TEST(Error, CheckIsOneStatementSoElseBindsToTheCallersIf) {
  int branch = 0;
  bool take_if = false;
  if (take_if)
    DTRAIN_CHECK(true, "never");
  else
    branch = 2;
  EXPECT_EQ(branch, 2);
}

TEST(Error, UserMessagesDropC10BacktracesAndSourceTagsUnlessDebugging) {
  // The shape of a c10::Error's what(): message, "Exception raised from", frames.
  const std::string c10 =
      "The server socket has failed to listen on any local network address. port: 29500, "
      "useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use\n"
      "Exception raised from makeWithPort at /pytorch/torch/csrc/distributed/c10d/socket.cpp:"
      "1006 (most recent call first):\nframe #0: c10::Error::Error(...) + 0x98 (0x7f in "
      "libc10.so)\nframe #1: <unknown function> + 0x5 (0x7f in libtorch_cpu.so)\n";
  const std::string what = "rendezvous: rank 0 could not serve the store: " + c10 +
                           ". Check MASTER_PORT. [comm/rendezvous.cc:88] [framework/x.cc:12]";
  const std::string shown = detail::user_message(what, /*debug=*/false);
  EXPECT_EQ(shown.find("frame #"), std::string::npos) << shown;
  EXPECT_EQ(shown.find("Exception raised from"), std::string::npos) << shown;
  EXPECT_EQ(shown.find(".cc:"), std::string::npos) << shown;
  EXPECT_NE(shown.find("EADDRINUSE"), std::string::npos) << shown;
  EXPECT_NE(shown.find("Check MASTER_PORT."), std::string::npos) << shown;
  // Brackets that are not source tags stay.
  EXPECT_EQ(detail::user_message("ranks [0,1] at [x: y]", false), "ranks [0,1] at [x: y]");
  EXPECT_EQ(detail::user_message(what, /*debug=*/true), what);
}

// What a program shows for an exception (examples' catch blocks, warnings): the location only
// at DTRAIN_LOG_LEVEL=debug.
TEST(Error, MessageOfShowsTheLocationOnlyWhenDebugging) {
  try {
    DTRAIN_FAIL(UsageError, "dtrain::optim::AdamW: parameter 3 is wrong");
  } catch (const Error& e) {
    ::unsetenv("DTRAIN_LOG_LEVEL");
    EXPECT_EQ(message_of(e), "dtrain::optim::AdamW: parameter 3 is wrong");
    ::setenv("DTRAIN_LOG_LEVEL", "debug", 1);
    EXPECT_NE(message_of(e).find("[core/error_test.cc:"), std::string::npos) << message_of(e);
    ::unsetenv("DTRAIN_LOG_LEVEL");
  }
}

TEST(Env, ParsesIntegersAndRejectsGarbageNamingTheVariable) {
  std::map<std::string, std::string> vars{{"A", "12"}, {"B", "x1"}};
  EnvLookup env = [&](const std::string& k) -> std::optional<std::string> {
    auto it = vars.find(k);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
  EXPECT_EQ(env_int(env, "A", 0), 12);
  EXPECT_EQ(env_int(env, "MISSING", 7), 7);
  try {
    env_int(env, "B", 0);
    FAIL() << "no throw";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("B='x1'"), std::string::npos) << e.what();
  }
}

TEST(Faults, ParseByNameAndRefuseAMalformedValueNamingTheVariable) {
  ::unsetenv("DTRAIN_TEST_UNIT_AT");
  EXPECT_FALSE(faults::step_rank("UNIT_AT"));
  ::setenv("DTRAIN_TEST_UNIT_AT", "12:3", 1);
  std::optional<faults::StepRank> at = faults::step_rank("UNIT_AT");
  ASSERT_TRUE(at);
  EXPECT_EQ(at->step, 12);
  EXPECT_EQ(at->rank, 3);
  for (const char* bad : {"12", "12:", "x:1", "1:2:3", "1;2"}) {
    ::setenv("DTRAIN_TEST_UNIT_AT", bad, 1);
    try {
      faults::step_rank("UNIT_AT");
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("DTRAIN_TEST_UNIT_AT"), std::string::npos) << e.what();
    }
  }
  ::setenv("DTRAIN_TEST_UNIT_AT", "prog  -a b", 1);
  EXPECT_EQ(faults::words("UNIT_AT"), (std::vector<std::string>{"prog", "-a", "b"}));
  EXPECT_EQ(*faults::text("UNIT_AT"), "prog  -a b");
  ::unsetenv("DTRAIN_TEST_UNIT_AT");
  EXPECT_TRUE(faults::words("UNIT_AT").empty());
}

TEST(Logging, RejectsUnknownLevel) {
  EXPECT_EQ(logging::parse_level("debug"), logging::Level::kDebug);
  EXPECT_EQ(logging::parse_level("off"), logging::Level::kOff);
  EXPECT_THROW(logging::parse_level("verbose"), ConfigError);
}

}  // namespace
}  // namespace dtrain
