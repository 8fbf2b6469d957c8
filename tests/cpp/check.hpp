// Minimal test harness: TEST registers a function; CHECK* record file:line failures and go on.
#pragma once

#include <cstdlib>
#include <exception>
#include <ostream>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace check {

using TestFn = void (*)();

struct TestCase {
  const char* name;
  TestFn fn;
};

// Function-local statics: safe to use from static registrars in any translation unit.
inline std::vector<TestCase>& registry() {
  static std::vector<TestCase> tests;
  return tests;
}

// Failures ("file:line: message") of the test now running; the runner clears it per test.
inline std::vector<std::string>& failures() {
  static std::vector<std::string> messages;
  return messages;
}

inline void fail(const char* file, int line, const std::string& message) {
  failures().push_back(std::string(file) + ":" + std::to_string(line) + ": " + message);
}

// The stride through a long sweep's cases: 1 (every case) unless GPIPE_FAST_CPP_SWEEP_STRIDE
// says more. The sanitizer run sets it: its instrumented code runs the sweeps 3x slower, the
// plain run covers every case, and memory errors show on a share of them.
inline int sweep_stride() {
  const char* set = std::getenv("GPIPE_FAST_CPP_SWEEP_STRIDE");
  const int stride = set ? std::atoi(set) : 1;
  return stride > 1 ? stride : 1;
}

// How many of a sweep's `full` cases sweep_stride() leaves (at least one).
inline int sweep_cases(int full) {
  const int stride = sweep_stride();
  return (full + stride - 1) / stride;
}

struct Registrar {
  Registrar(const char* name, TestFn fn) { registry().push_back(TestCase{name, fn}); }
};

// Prints a value in a failure message when it can be streamed; otherwise a placeholder.
template <typename T, typename = void>
struct Printable : std::false_type {};
template <typename T>
struct Printable<
    T, std::void_t<decltype(std::declval<std::ostream&>() << std::declval<const T&>())>>
    : std::true_type {};

template <typename T>
std::string show(const T& value) {
  if constexpr (Printable<T>::value) {
    std::ostringstream out;
    out << value;
    return out.str();
  } else {
    return "<unprintable>";
  }
}

template <typename A, typename B>
void check_eq(const A& a, const B& b, const char* a_text, const char* b_text, const char* file,
              int line) {
  if (!(a == b)) {
    fail(file, line,
         std::string("CHECK_EQ(") + a_text + ", " + b_text + ") failed: " + show(a) + " vs " +
             show(b));
  }
}

}  // namespace check

#define CHECK_CONCAT_INNER(a, b) a##b
#define CHECK_CONCAT(a, b) CHECK_CONCAT_INNER(a, b)

// Defines and registers a test function: TEST(name) { ... }
#define TEST(name)                                                             \
  static void CHECK_CONCAT(check_test_, name)();                               \
  static const ::check::Registrar CHECK_CONCAT(check_registrar_, name){        \
      #name, &CHECK_CONCAT(check_test_, name)};                                \
  static void CHECK_CONCAT(check_test_, name)()

#define CHECK(cond)                                                             \
  do {                                                                          \
    if (!(cond)) ::check::fail(__FILE__, __LINE__, "CHECK(" #cond ") failed"); \
  } while (0)

#define CHECK_EQ(a, b) ::check::check_eq((a), (b), #a, #b, __FILE__, __LINE__)

// Passes when `expr` throws `type` (or a subclass); any other outcome is a failure.
#define CHECK_THROWS(expr, type)                                                            \
  do {                                                                                      \
    bool check_threw_ = false;                                                              \
    try {                                                                                   \
      (void)(expr);                                                                         \
    } catch (const type&) {                                                                 \
      check_threw_ = true;                                                                  \
    } catch (const std::exception& check_e_) {                                              \
      ::check::fail(__FILE__, __LINE__,                                                     \
                    std::string("CHECK_THROWS(" #expr ", " #type ") got another exception: ") + \
                        check_e_.what());                                                   \
      check_threw_ = true;                                                                  \
    } catch (...) {                                                                         \
      ::check::fail(__FILE__, __LINE__,                                                     \
                    "CHECK_THROWS(" #expr ", " #type ") got a non-std exception");          \
      check_threw_ = true;                                                                  \
    }                                                                                       \
    if (!check_threw_)                                                                      \
      ::check::fail(__FILE__, __LINE__, "CHECK_THROWS(" #expr ", " #type ") did not throw"); \
  } while (0)
