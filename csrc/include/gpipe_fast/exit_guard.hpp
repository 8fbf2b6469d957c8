// Threads that the interpreter ends while it shuts down park instead of aborting the process.
#pragma once

namespace gpipe_fast {

// Why: a daemon thread blocked in a native wait (a torch.distributed request that can never
// be cancelled, e.g. a receive from a rank that failed) may return while Python finalises.
// Python then ends that thread with pthread_exit, whose unwinding meets a noexcept frame (the
// binding's GIL guard) and calls std::terminate: the process aborts (SIGABRT) and loses its
// own exit code. Once `interpreter_exiting()` has been called (from an atexit handler, on the
// thread that finalises), std::terminate with no active exception on any other thread parks
// that thread for good: it holds no Python state then, and the process's exit ends it. Every
// other call of std::terminate goes to the handler that was installed before.

// Installs the terminate handler (once; later calls do nothing).
void install_exit_guard();
// From now on, threads other than the caller park rather than abort on such a terminate.
void interpreter_exiting();

}  // namespace gpipe_fast
