// dtrain's error hierarchy and the one-line check macros that throw it.
//
// Every failure a user can cause or meet is an exception under dtrain::Error:
//   ConfigError   a config file or --set override is wrong (message names file, key, line)
//   CommError     a collective failed or a communicator is unusable
//   TimeoutError  a collective did not finish in time (a CommError; names op, seq, ranks)
//   PeerLostError a peer closed its connection mid-collective (a CommError): the consequence
//                 of another rank's failure, which is the one to read (exit code 3)
//   UsageError    an API was called out of order (e.g. GradScaler::unscale_ twice)
//   CheckpointError  a checkpoint cannot be written, or is missing, corrupt or does not match
//                 the model (message names the file or tensor)
// The macros append the source location, so a report from the field points at the check;
// users see it only at DTRAIN_LOG_LEVEL=debug (detail::user_message).
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace dtrain {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class ConfigError : public Error {
 public:
  using Error::Error;
};

class CommError : public Error {
 public:
  using Error::Error;
};

class TimeoutError : public CommError {
 public:
  using CommError::CommError;
};

class PeerLostError : public CommError {
 public:
  using CommError::CommError;
};

class UsageError : public Error {
 public:
  using Error::Error;
};

class CheckpointError : public Error {
 public:
  using Error::Error;
};

// What to show a user for `e`: its message without the source locations dtrain's checks append
// (" [optim/fused.cc:32]") and without LibTorch's backtrace, unless DTRAIN_LOG_LEVEL is debug
// or trace, when it is whole. For a program's own catch: fprintf(stderr, "%s\n",
// dtrain::message_of(e).c_str()).
std::string message_of(const std::exception& e);

namespace detail {

template <typename... Args>
std::string str(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}

// `what` without the " [file:line]" suffix the check macros append (for rethrowing a
// message with more context).
std::string strip_location(const std::string& what);

// Strips the build-root prefix so messages show "comm/mpi_communicator.cc:42".
const char* short_path(const char* file);

// `what` of an exception from LibTorch without the C++ backtrace c10 appends ("Exception
// raised from ..." and "frame #0: ..." lines), which tells a user nothing.
std::string without_backtrace(const std::string& what);

// A message from elsewhere (LibTorch, gloo) for embedding in a sentence: no backtrace, and
// no trailing spaces or period.
std::string clause(const std::string& what);

// What a user is shown for `what`: no backtrace and no " [file.cc:NN]" tags, unless `debug`
// (DTRAIN_LOG_LEVEL=debug or trace), when it is returned whole.
std::string user_message(const std::string& what, bool debug);

template <typename E>
[[noreturn]] void fail(const char* file, int line, const std::string& message) {
  throw E(message + " [" + short_path(file) + ":" + std::to_string(line) + "]");
}

}  // namespace detail
}  // namespace dtrain

// DTRAIN_CHECK(cond, parts...): throws dtrain::Error with the parts streamed together.
#define DTRAIN_CHECK(cond, ...) DTRAIN_CHECK_AS(::dtrain::Error, cond, __VA_ARGS__)
// DTRAIN_CHECK_AS(ErrorType, cond, parts...): the same with a chosen error type. The
// do/while makes it one statement, so an `else` after it binds to the caller's `if`.
#define DTRAIN_CHECK_AS(E, cond, ...)                                                    \
  do {                                                                                   \
    if (!(cond))                                                                         \
      ::dtrain::detail::fail<E>(__FILE__, __LINE__, ::dtrain::detail::str(__VA_ARGS__)); \
  } while (0)
// DTRAIN_FAIL(ErrorType, parts...): throws unconditionally.
#define DTRAIN_FAIL(E, ...) \
  ::dtrain::detail::fail<E>(__FILE__, __LINE__, ::dtrain::detail::str(__VA_ARGS__))
