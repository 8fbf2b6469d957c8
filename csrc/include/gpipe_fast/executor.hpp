// Runs a schedule with one persistent worker thread per worker; carries the first error back.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gpipe_fast/device.hpp"
#include "gpipe_fast/schedule.hpp"
#include "gpipe_fast/task_clock.hpp"

namespace gpipe_fast {

// Does the compute of one task (in gpipe_fast: a call back into Python). Runs on the task's
// worker thread; may throw, and the first exception ends the run.
using TaskFn = std::function<void(const Task&)>;

// What one worker is doing: inside `task`, blocked before it on a dependency, or done.
struct WorkerState {
  enum class Phase : std::uint8_t { Done, Waiting, Running };
  int task = -1;
  Phase phase = Phase::Done;
};

// Start and end of one task, in nanoseconds of the steady clock (see TaskClock: read on the
// worker for host streams, converted from the stream's timing events on CUDA streams).
struct TaskSpan {
  int task = -1;
  std::int64_t start_ns = 0;
  std::int64_t end_ns = 0;
};

// How a blocking run is watched from the calling thread.
struct RunControl {
  // > 0: a run still going after this many seconds is cancelled with StepTimeout.
  double timeout_s = 0.0;
  // Polled on the calling thread between waits; true stops the run with Interrupted once
  // every worker has finished its current task (Ctrl-C). It may cancel() the run itself,
  // while it still holds what the tasks need (the GIL), so that none starts in between.
  std::function<bool()> interrupted;
  std::chrono::milliseconds poll{50};
  // After a timeout, how long the running tasks get to return. A task still running then
  // cannot be stopped from outside: its workers are abandoned (left running, never joined)
  // and the executor refuses further runs.
  std::chrono::milliseconds patience{2000};
};

class Executor {
 public:
  // `on_thread_exit` runs on each worker thread just before it ends (the bindings use it to
  // drop the thread's Python state). `clock` times the tasks when recording.
  Executor(int workers, std::shared_ptr<StreamSync> sync,
           std::function<void()> on_thread_exit = {},
           std::shared_ptr<TaskClock> clock = make_host_clock());
  // Cancels a run in flight and joins the workers; an abandoned executor's workers are
  // detached instead and end, with the state they share, once their stuck task returns.
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  int workers() const;
  const StreamSync& sync() const;
  const TaskClock& clock() const;

  // Sets the stream each worker's tasks run on (host backend ignores handles).
  void set_streams(std::vector<Stream> streams);

  // Records task spans in the next runs when on (off by default: then nothing is timed and
  // the clock is never called). Switching on between runs ties the device clocks to the
  // host clock at once, so that runs rarely have to (start() renews stale anchors).
  void set_recording(bool on);

  // Blocking run under `control`: start, watch, finish. Rethrows the first task error;
  // throws Interrupted or StepTimeout (naming what each worker was doing) when stopped.
  void run(std::shared_ptr<const Schedule> schedule, TaskFn fn, const RunControl& control = {});

  // Hands the schedule (validated here, once) to the workers and returns at once; the run
  // keeps it and fn until finish() (an abandoned run: until its workers end).
  void start(std::shared_ptr<const Schedule> schedule, TaskFn fn);
  // Waits up to `timeout` for the run to end; true when it has.
  bool wait_for(std::chrono::milliseconds timeout);
  // Workers finish the task they are in and start no other.
  void cancel();
  // Waits for the run to end, releases its events, rethrows its first error if any.
  void finish();

  // Each worker's progress in the run in flight (for a watchdog's report).
  std::vector<WorkerState> worker_states() const;
  // True once a timed-out run left a task running: no further run is accepted.
  bool abandoned() const;

  // Spans of the last finished run, in task-id order of the tasks that ran. On CUDA streams
  // the first call waits for the run's timing events and releases them; a run whose spans
  // are never read releases them when the next run starts. Not during a run.
  std::vector<TaskSpan> last_spans();
  // Per worker, the clock that times its tasks: "host" or "cuda" (TaskClock::name).
  std::vector<std::string> worker_clocks() const;
  // Runs finished since construction (a worker-lifetime check for soak tests).
  std::int64_t runs() const;

  struct State;  // shared with the worker threads (see the destructor)

 private:
  std::shared_ptr<State> state_;
  std::vector<std::thread> threads_;
};

// "cell 1 never finished its forward of micro-batch 3; cell 0 was waiting to start its
// backward of micro-batch 2": what each worker was doing, for a timeout's message. (A cell
// is a stage: GPipe's name for it.)
std::string describe_progress(const Schedule& schedule, const std::vector<WorkerState>& states);

}  // namespace gpipe_fast
