// Runs every registered test, one line each, then "N passed, M failed"; exit 1 on any failure.
#include <chrono>
#include <exception>
#include <iostream>
#include <string>

#include "check.hpp"

int main() {
  int passed = 0;
  int failed = 0;
  for (const auto& test : check::registry()) {
    check::failures().clear();
    const auto begin = std::chrono::steady_clock::now();
    try {
      test.fn();
    } catch (const std::exception& e) {
      check::fail(__FILE__, __LINE__, std::string("uncaught exception: ") + e.what());
    } catch (...) {
      check::fail(__FILE__, __LINE__, "uncaught non-std exception");
    }
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                        std::chrono::steady_clock::now() - begin)
                        .count();
    const bool ok = check::failures().empty();
    (ok ? passed : failed) += 1;
    std::cout << (ok ? "PASS " : "FAIL ") << test.name << " (" << ms << " ms)";
    if (!ok) std::cout << " [" << check::failures().size() << " failed checks]";
    std::cout << std::endl;
    for (const auto& message : check::failures()) std::cout << "    " << message << "\n";
  }
  std::cout << passed << " passed, " << failed << " failed" << std::endl;
  return failed == 0 ? 0 : 1;
}
