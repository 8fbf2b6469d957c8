// Runs a schedule with one persistent worker thread per cell; carries the first error back.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "gpipe_fast/device.hpp"
#include "gpipe_fast/schedule.hpp"
#include "gpipe_fast/task_clock.hpp"

namespace gpipe_fast {

// Does the compute of one task (in gpipe_fast: a call back into Python). Runs on the task's
// cell's worker thread; may throw, and the first exception ends the run.
using TaskFn = std::function<void(const Task&)>;

// What one cell's worker is doing: inside `task`, blocked before it on a dependency, or done.
struct CellState {
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

class Executor {
 public:
  // `on_thread_exit` runs on each worker thread just before it ends (the bindings use it to
  // drop the thread's Python state). `clock` times the tasks when recording.
  Executor(int workers, std::shared_ptr<StreamSync> sync,
           std::function<void()> on_thread_exit = {},
           std::shared_ptr<TaskClock> clock = make_host_clock());
  ~Executor();  // cancels a run in flight and joins the workers
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  int workers() const { return static_cast<int>(threads_.size()); }
  const StreamSync& sync() const { return *sync_; }
  const TaskClock& clock() const { return *clock_; }

  // Sets the stream each cell's tasks run on (one per cell; host backend ignores handles).
  void set_streams(std::vector<Stream> streams);

  // Records task spans in the next runs when on (off by default: then nothing is timed and
  // the clock is never called). Switching on between runs ties the device clocks to the
  // host clock at once, so that runs rarely have to (start() renews stale anchors).
  void set_recording(bool on);

  // Blocking run: start + wait + finish.
  void run(const Schedule& schedule, TaskFn fn);

  // Hands the schedule to the workers and returns at once. The schedule and fn must stay
  // alive until finish() returns.
  void start(const Schedule& schedule, TaskFn fn);
  // Waits up to `timeout` for the run to end; true when it has.
  bool wait_for(std::chrono::milliseconds timeout);
  // Workers finish the task they are in and start no other.
  void cancel();
  // Waits for the run to end, releases its events, rethrows its first error if any.
  void finish();

  // Each cell's progress in the run in flight (for a watchdog's report).
  std::vector<CellState> cell_states() const;

  // Spans of the last finished run, in task-id order of the tasks that ran. On CUDA streams
  // the first call waits for the run's timing events and releases them; a run whose spans
  // are never read releases them when the next run starts. Not during a run.
  std::vector<TaskSpan> last_spans();
  // Per cell, the clock that times its tasks: "host" or "cuda" (TaskClock::name).
  std::vector<std::string> cell_clocks() const;
  // Runs finished since construction (a worker-lifetime check for soak tests).
  std::int64_t runs() const;

 private:
  void worker_main(int cell);
  void run_cell(int cell);
  bool ready(const Task& task) const;  // caller holds mutex_
  void discard_unread();                // caller holds mutex_

  // A recorded task: its stamps become a TaskSpan when the spans are read.
  struct StampedSpan {
    int task = -1;
    Stamp start;
    Stamp end;
  };

  std::shared_ptr<StreamSync> sync_;
  std::shared_ptr<TaskClock> clock_;
  std::function<void()> on_thread_exit_;
  std::vector<Stream> streams_;
  bool recording_ = false;

  mutable std::mutex mutex_;
  std::condition_variable work_cv_;   // workers wait for a run or shutdown
  std::condition_variable task_cv_;   // workers wait for dependencies
  std::condition_variable done_cv_;   // the caller waits for the run's end

  // State of the run in flight, guarded by mutex_.
  const Schedule* schedule_ = nullptr;
  TaskFn fn_;
  std::uint64_t generation_ = 0;
  int cells_running_ = 0;
  bool aborted_ = false;
  bool shutdown_ = false;
  std::vector<char> done_;
  std::vector<EventId> events_;
  std::vector<CellState> cell_states_;
  std::vector<StampedSpan> spans_;   // the run in flight's, by task id
  std::vector<StampedSpan> unread_;  // the last finished run's, until last_spans() reads them
  std::vector<TaskSpan> last_spans_;
  std::exception_ptr error_;
  std::int64_t runs_ = 0;

  std::vector<std::thread> threads_;
};

}  // namespace gpipe_fast
