// Running a program from a test the way a user's shell would: its exit code (128 + signal
// for a crash) and everything it printed, stdout and stderr together.
#pragma once

#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <regex>
#include <string>

namespace dtrain::testing {

struct CommandResult {
  int code;
  std::string output;
};

inline CommandResult run_command(const std::string& cmd) {
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  std::string out;
  char buf[4096];
  while (size_t n = std::fread(buf, 1, sizeof(buf), p)) out.append(buf, n);
  const int status = ::pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), out};
}

// A path under the test's scratch folder (Bazel's TEST_TMPDIR, else /tmp).
inline std::string scratch_path(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  return std::string(base ? base : "/tmp") + "/" + name;
}

// The final parameters' xxh64 in dtrain-train's output ("parameters identical on all N
// rank(s) (xxh64 ...)"); empty when it printed none.
inline std::string final_checksum(const std::string& output) {
  std::smatch m;
  const std::regex re("parameters identical on all [0-9]+ rank\\(s\\) \\(xxh64 ([0-9a-f]+)\\)");
  return std::regex_search(output, m, re) ? m[1].str() : "";
}

}  // namespace dtrain::testing
