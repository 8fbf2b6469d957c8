// Error types of the native core and the precondition macro that raises them.
#pragma once

#include <new>
#include <stdexcept>
#include <string>

namespace gpipe_fast {

// A caller broke a documented precondition; Python sees ValueError.
class InvalidArgument : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// A CUDA runtime call failed; Python sees RuntimeError with the call and error name.
class CudaError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A run took longer than its limit and was cancelled; Python sees TimeoutError.
class StepTimeout : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A run was stopped because its caller asked (Ctrl-C); Python sees the pending signal's
// exception (KeyboardInterrupt).
class Interrupted : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A bounded wait (a shared-memory channel's receive, flush or attach) ended without what it
// waited for; Python sees TimeoutError. Nothing is lost: the same wait may be tried again.
class WaitTimeout : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A shared-memory channel was closed (by either side, or poisoned by a failing rank), or the
// process at its other end died; Python sees ConnectionError.
class ChannelClosed : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A memory resource could not satisfy a request; Python sees MemoryError.
class OutOfMemory : public std::bad_alloc {
 public:
  explicit OutOfMemory(std::string what) : what_(std::move(what)) {}
  const char* what() const noexcept override { return what_.c_str(); }

 private:
  std::string what_;
};

namespace detail {
[[noreturn]] inline void fail_precondition(const std::string& message, const char* file, int line) {
  throw InvalidArgument(message + " (" + file + ":" + std::to_string(line) + ")");
}
}  // namespace detail

}  // namespace gpipe_fast

// Checks a precondition; on failure throws InvalidArgument with the message and file:line.
#define GF_EXPECTS(condition, message)                                                 \
  do {                                                                                 \
    if (!(condition)) ::gpipe_fast::detail::fail_precondition((message), __FILE__, __LINE__); \
  } while (0)
