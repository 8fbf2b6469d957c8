// The executor: per-worker threads run their task lists, waiting on cross-worker dependencies.
#include "gpipe_fast/executor.hpp"

#include <condition_variable>
#include <exception>
#include <mutex>
#include <string>

#include "gpipe_fast/error.hpp"

#if defined(__linux__)
#include <pthread.h>
#endif

namespace gpipe_fast {
namespace {

void name_thread(int worker) {
#if defined(__linux__)
  const std::string name = "gpipe-cell-" + std::to_string(worker);
  pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
#else
  (void)worker;
#endif
}

// A recorded task: its stamps become a TaskSpan when the spans are read.
struct StampedSpan {
  int task = -1;
  Stamp start;
  Stamp end;
};

}  // namespace

// Everything the workers touch. Held by the Executor and by each worker thread, so that
// workers left behind by an abandoned run (see RunControl::patience) never outlive it.
struct Executor::State {
  std::shared_ptr<StreamSync> sync;
  std::shared_ptr<TaskClock> clock;
  std::function<void()> on_thread_exit;
  std::vector<Stream> streams;
  bool recording = false;

  mutable std::mutex mutex;
  std::condition_variable work_cv;  // workers wait for a run or shutdown
  std::condition_variable done_cv;  // the caller waits for the run's end
  // One per worker: a worker waits on its own for its next task's dependencies, and a
  // finished task wakes only the workers of the tasks that depend on it.
  std::vector<std::unique_ptr<std::condition_variable>> ready_cv;

  // The run in flight, guarded by mutex.
  std::shared_ptr<const Schedule> schedule;
  TaskFn fn;
  std::uint64_t generation = 0;
  int running = 0;  // workers still in the run
  bool aborted = false;
  bool shutdown = false;
  bool abandoned = false;
  std::vector<char> done;
  std::vector<EventId> events;
  std::vector<WorkerState> worker_states;
  std::vector<StampedSpan> spans;   // the run in flight's, by task id
  std::vector<StampedSpan> unread;  // the last finished run's, until last_spans() reads them
  std::vector<TaskSpan> last_spans;
  std::exception_ptr error;
  std::int64_t runs = 0;

  ~State() {
    for (EventId event : events) {
      if (event >= 0) sync->release(event);
    }
    for (const auto& span : spans) {
      clock->discard(span.start);
      clock->discard(span.end);
    }
    discard_unread();
  }

  void discard_unread() {  // caller holds mutex (or is the destructor)
    for (const auto& span : unread) {
      clock->discard(span.start);
      clock->discard(span.end);
    }
    unread.clear();
    last_spans.clear();
  }

  bool ready(const Task& task) const {  // caller holds mutex
    for (int dep : task.deps) {
      if (!done[static_cast<std::size_t>(dep)]) return false;
    }
    return true;
  }

  void abort_locked() {
    aborted = true;
    for (auto& cv : ready_cv) cv->notify_all();
  }

  void worker_main(int worker) {
    name_thread(worker);
    std::uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex);
        work_cv.wait(lock, [&] { return shutdown || generation != seen; });
        if (shutdown) break;
        seen = generation;
      }
      run_worker(worker);
      {
        std::lock_guard<std::mutex> lock(mutex);
        --running;
      }
      done_cv.notify_all();
    }
    if (on_thread_exit) on_thread_exit();
  }

  void run_worker(int worker) {
    const std::shared_ptr<const Schedule> owner = schedule;  // fixed for the run: set before
    const Schedule& run = *owner;                            // the generation this worker saw
    const Stream stream = streams[static_cast<std::size_t>(worker)];
    auto& cv = *ready_cv[static_cast<std::size_t>(worker)];
    for (int id : run.order(worker)) {
      const Task& task = run.task(id);
      bool record = false;
      Stamp start;
      Stamp end;
      auto& state = worker_states[static_cast<std::size_t>(worker)];
      {
        std::unique_lock<std::mutex> lock(mutex);
        state = WorkerState{id, WorkerState::Phase::Waiting};
        cv.wait(lock, [&] { return aborted || ready(task); });
        if (aborted) return;
        state.phase = WorkerState::Phase::Running;
        record = !spans.empty();
      }
      try {
        // Order this worker's stream after its producers' work (device-side on CUDA).
        for (int dep : task.deps) {
          if (run.task(dep).worker != worker) sync->wait(stream, events[static_cast<std::size_t>(dep)]);
        }
        // Stamped after the waits and right around the callback: on a CUDA stream the span
        // is the stream's time in the task's work, from after its producers' work on.
        if (record) start = clock->stamp(stream);
        fn(task);
        if (record) end = clock->stamp(stream);
        const EventId event = sync->record(stream);
        std::lock_guard<std::mutex> lock(mutex);
        events[static_cast<std::size_t>(id)] = event;
        if (record) spans[static_cast<std::size_t>(id)] = StampedSpan{id, start, end};
        done[static_cast<std::size_t>(id)] = 1;
        state = WorkerState{};
      } catch (...) {
        clock->discard(start);  // a task that failed has no span
        clock->discard(end);
        std::lock_guard<std::mutex> lock(mutex);
        if (!error) error = std::current_exception();
        abort_locked();
        return;
      }
      for (int next : run.successors(id)) {
        const int other = run.task(next).worker;
        if (other != worker) ready_cv[static_cast<std::size_t>(other)]->notify_one();
      }
    }
  }
};

Executor::Executor(int workers, std::shared_ptr<StreamSync> sync,
                   std::function<void()> on_thread_exit, std::shared_ptr<TaskClock> clock)
    : state_(std::make_shared<State>()) {
  GF_EXPECTS(workers >= 1, "an executor needs at least one worker, got " + std::to_string(workers));
  GF_EXPECTS(sync != nullptr, "an executor needs a StreamSync backend");
  GF_EXPECTS(clock != nullptr, "an executor needs a TaskClock");
  state_->sync = std::move(sync);
  state_->clock = std::move(clock);
  state_->on_thread_exit = std::move(on_thread_exit);
  state_->streams.resize(static_cast<std::size_t>(workers));
  for (int w = 0; w < workers; ++w) state_->ready_cv.push_back(std::make_unique<std::condition_variable>());
  threads_.reserve(static_cast<std::size_t>(workers));
  for (int w = 0; w < workers; ++w) {
    threads_.emplace_back([state = state_, w] { state->worker_main(w); });
  }
}

Executor::~Executor() {
  bool abandoned = false;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->shutdown = true;
    state_->abort_locked();
    abandoned = state_->abandoned;
  }
  state_->work_cv.notify_all();
  for (auto& thread : threads_) {
    if (abandoned) {
      thread.detach();  // a stuck task may never return; the thread owns its share of state_
    } else {
      thread.join();
    }
  }
}

int Executor::workers() const { return static_cast<int>(threads_.size()); }
const StreamSync& Executor::sync() const { return *state_->sync; }
const TaskClock& Executor::clock() const { return *state_->clock; }

void Executor::set_streams(std::vector<Stream> streams) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  GF_EXPECTS(state_->schedule == nullptr, "set_streams during a run");
  GF_EXPECTS(streams.size() == threads_.size(),
             "set_streams needs one stream per worker: got " + std::to_string(streams.size()) +
                 " for " + std::to_string(threads_.size()) + " workers");
  state_->streams = std::move(streams);
}

void Executor::set_recording(bool on) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  // Outside a run, calibrating here keeps its cost out of the steps; during one, start()
  // calibrates before the next run.
  if (on && state_->schedule == nullptr) state_->clock->calibrate(state_->streams);
  state_->recording = on;
}

void Executor::start(std::shared_ptr<const Schedule> schedule, TaskFn fn) {
  GF_EXPECTS(schedule != nullptr, "start needs a schedule");
  GF_EXPECTS(schedule->workers() == workers(),
             "schedule has " + std::to_string(schedule->workers()) +
                 " workers but the executor has " + std::to_string(workers()));
  GF_EXPECTS(static_cast<bool>(fn), "start needs a task function");
  schedule->validate();  // once per schedule: it remembers
  State& s = *state_;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    GF_EXPECTS(!s.abandoned,
               "the executor was abandoned after a step timed out while a task was still "
               "running; build a new one");
    GF_EXPECTS(s.schedule == nullptr, "the executor is already running a schedule");
    s.discard_unread();  // before calibrating: unread stamps keep a stale anchor in place
    if (s.recording) s.clock->calibrate(s.streams);  // a no-op while the anchors are fresh
    const auto tasks = schedule->tasks().size();
    s.schedule = std::move(schedule);
    s.fn = std::move(fn);
    s.aborted = false;
    s.error = nullptr;
    s.running = workers();
    s.done.assign(tasks, 0);
    s.events.assign(tasks, -1);
    s.spans.assign(s.recording ? tasks : 0, StampedSpan{});
    s.worker_states.assign(threads_.size(), WorkerState{});
    ++s.generation;
  }
  s.work_cv.notify_all();
}

bool Executor::wait_for(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(state_->mutex);
  return state_->done_cv.wait_for(lock, timeout, [this] { return state_->running == 0; });
}

void Executor::cancel() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->abort_locked();
}

void Executor::finish() {
  State& s = *state_;
  std::exception_ptr error;
  {
    std::unique_lock<std::mutex> lock(s.mutex);
    GF_EXPECTS(s.schedule != nullptr, "finish without a run in flight");
    s.done_cv.wait(lock, [&] { return s.running == 0; });
    for (EventId event : s.events) {
      if (event >= 0) s.sync->release(event);
    }
    s.events.clear();
    for (const auto& span : s.spans) {
      if (span.task >= 0) s.unread.push_back(span);
    }
    s.spans.clear();
    s.schedule = nullptr;
    s.fn = nullptr;
    s.done.clear();
    ++s.runs;
    error = s.error;
    s.error = nullptr;
  }
  if (error) std::rethrow_exception(error);
}

void Executor::run(std::shared_ptr<const Schedule> schedule, TaskFn fn,
                   const RunControl& control) {
  const std::shared_ptr<const Schedule> kept = schedule;  // for the timeout's report
  start(std::move(schedule), std::move(fn));
  const auto started = std::chrono::steady_clock::now();
  // Ends a stopped run, dropping its task error: what stopped it is the caller's reason.
  auto finish_quietly = [this] {
    try {
      finish();
    } catch (...) {
    }
  };
  while (!wait_for(control.poll)) {
    if (control.interrupted && control.interrupted()) {
      cancel();
      finish_quietly();  // each worker ends its current task first
      throw Interrupted("gpipe_fast: the run was interrupted");
    }
    const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - started;
    if (control.timeout_s > 0 && elapsed.count() > control.timeout_s) {
      std::string message = "gpipe_fast: step timed out after " +
                            std::to_string(control.timeout_s) + " s; " +
                            describe_progress(*kept, worker_states());
      cancel();
      if (!wait_for(control.patience)) {
        {
          std::lock_guard<std::mutex> lock(state_->mutex);
          state_->abandoned = true;
        }
        throw StepTimeout(message + " (a task is still running: this pipe can no longer run "
                                    "steps; build a new one)");
      }
      finish_quietly();
      throw StepTimeout(message);
    }
  }
  finish();
}

std::vector<WorkerState> Executor::worker_states() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->worker_states;
}

bool Executor::abandoned() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->abandoned;
}

std::vector<TaskSpan> Executor::last_spans() {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  // Reading may wait for the device: never while a run is in flight.
  GF_EXPECTS(s.schedule == nullptr, "last_spans during a run");
  if (s.unread.empty()) return s.last_spans;
  s.last_spans.reserve(s.unread.size());
  try {
    for (const auto& span : s.unread) {
      const std::int64_t start = s.clock->resolve(span.start);
      s.last_spans.push_back(TaskSpan{span.task, start, s.clock->resolve(span.end)});
    }
  } catch (...) {
    s.last_spans.clear();
    s.discard_unread();  // the stamps not resolved yet; resolved ones are already released
    throw;
  }
  s.unread.clear();
  return s.last_spans;
}

std::vector<std::string> Executor::worker_clocks() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  std::vector<std::string> names;
  names.reserve(state_->streams.size());
  for (const Stream& stream : state_->streams) names.push_back(state_->clock->name(stream));
  return names;
}

std::int64_t Executor::runs() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->runs;
}

std::string describe_progress(const Schedule& schedule, const std::vector<WorkerState>& states) {
  std::string out;
  for (const WorkerState& state : states) {
    if (state.phase == WorkerState::Phase::Done || state.task < 0) continue;
    const Task& task = schedule.task(state.task);
    if (!out.empty()) out += "; ";
    out += "cell " + std::to_string(task.stage) +
           (state.phase == WorkerState::Phase::Running ? " never finished its "
                                                       : " was waiting to start its ") +
           action_info(task.action).name + " of micro-batch " + std::to_string(task.microbatch);
  }
  return out.empty() ? "every cell had finished its tasks" : out;
}

}  // namespace gpipe_fast
