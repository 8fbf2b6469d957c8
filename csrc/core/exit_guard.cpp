// A terminate handler that parks threads ended by the interpreter's shutdown (exit_guard.hpp).
#include "gpipe_fast/exit_guard.hpp"

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>

namespace gpipe_fast {
namespace {

std::atomic<bool> exiting{false};
std::thread::id finalising_thread;  // written once, before `exiting` is set
std::terminate_handler previous = nullptr;
std::once_flag installed;

[[noreturn]] void on_terminate() {
  const bool ended_by_shutdown = exiting.load(std::memory_order_acquire) &&
                                 std::this_thread::get_id() != finalising_thread &&
                                 !std::current_exception();
  if (ended_by_shutdown) {
    for (;;) pause();  // the process's exit ends this thread
  }
  if (previous != nullptr) previous();
  std::abort();
}

}  // namespace

void install_exit_guard() {
  std::call_once(installed, [] { previous = std::set_terminate(on_terminate); });
}

void interpreter_exiting() {
  finalising_thread = std::this_thread::get_id();
  exiting.store(true, std::memory_order_release);
}

}  // namespace gpipe_fast
