#include "core/error.h"

#include <gtest/gtest.h>

#include <map>

#include "core/env.h"
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

TEST(Logging, RejectsUnknownLevel) {
  EXPECT_EQ(logging::parse_level("debug"), logging::Level::kDebug);
  EXPECT_EQ(logging::parse_level("off"), logging::Level::kOff);
  EXPECT_THROW(logging::parse_level("verbose"), ConfigError);
}

}  // namespace
}  // namespace dtrain
