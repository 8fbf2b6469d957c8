// The executor: per-cell workers run their task lists, waiting on cross-cell dependencies.
#include "gpipe_fast/executor.hpp"

#include <string>

#include "gpipe_fast/error.hpp"

#if defined(__linux__)
#include <pthread.h>
#endif

namespace gpipe_fast {
namespace {

void name_thread(int cell) {
#if defined(__linux__)
  const std::string name = "gpipe-cell-" + std::to_string(cell);
  pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
#else
  (void)cell;
#endif
}

}  // namespace

Executor::Executor(int workers, std::shared_ptr<StreamSync> sync,
                   std::function<void()> on_thread_exit, std::shared_ptr<TaskClock> clock)
    : sync_(std::move(sync)), clock_(std::move(clock)), on_thread_exit_(std::move(on_thread_exit)) {
  GF_EXPECTS(workers >= 1, "an executor needs at least one worker, got " + std::to_string(workers));
  GF_EXPECTS(sync_ != nullptr, "an executor needs a StreamSync backend");
  GF_EXPECTS(clock_ != nullptr, "an executor needs a TaskClock");
  streams_.resize(static_cast<std::size_t>(workers));
  threads_.reserve(static_cast<std::size_t>(workers));
  for (int cell = 0; cell < workers; ++cell) threads_.emplace_back([this, cell] { worker_main(cell); });
}

Executor::~Executor() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    shutdown_ = true;
    aborted_ = true;
  }
  work_cv_.notify_all();
  task_cv_.notify_all();
  for (auto& thread : threads_) thread.join();
  // A run abandoned by its caller still owns events.
  for (EventId event : events_) {
    if (event >= 0) sync_->release(event);
  }
  for (const auto& span : spans_) {
    clock_->discard(span.start);
    clock_->discard(span.end);
  }
  discard_unread();
}

void Executor::set_streams(std::vector<Stream> streams) {
  std::lock_guard<std::mutex> lock(mutex_);
  GF_EXPECTS(schedule_ == nullptr, "set_streams during a run");
  GF_EXPECTS(streams.size() == threads_.size(),
             "set_streams needs one stream per cell: got " + std::to_string(streams.size()) +
                 " for " + std::to_string(threads_.size()) + " cells");
  streams_ = std::move(streams);
}

void Executor::set_recording(bool on) {
  std::lock_guard<std::mutex> lock(mutex_);
  // Outside a run, calibrating here keeps its cost out of the steps; during one, start()
  // calibrates before the next run.
  if (on && schedule_ == nullptr) clock_->calibrate(streams_);
  recording_ = on;
}

void Executor::run(const Schedule& schedule, TaskFn fn) {
  start(schedule, std::move(fn));
  finish();
}

void Executor::start(const Schedule& schedule, TaskFn fn) {
  GF_EXPECTS(schedule.cells() == workers(), "schedule has " + std::to_string(schedule.cells()) +
                                                " cells but the executor has " +
                                                std::to_string(workers()) + " workers");
  GF_EXPECTS(static_cast<bool>(fn), "start needs a task function");
  schedule.validate();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    GF_EXPECTS(schedule_ == nullptr, "the executor is already running a schedule");
    discard_unread();  // before calibrating: unread stamps keep a stale anchor in place
    if (recording_) clock_->calibrate(streams_);  // a no-op while the anchors are fresh
    schedule_ = &schedule;
    fn_ = std::move(fn);
    aborted_ = false;
    error_ = nullptr;
    cells_running_ = workers();
    done_.assign(schedule.tasks().size(), 0);
    events_.assign(schedule.tasks().size(), -1);
    spans_.assign(recording_ ? schedule.tasks().size() : 0, StampedSpan{});
    cell_states_.assign(threads_.size(), CellState{});
    ++generation_;
  }
  work_cv_.notify_all();
}

bool Executor::wait_for(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  return done_cv_.wait_for(lock, timeout, [this] { return cells_running_ == 0; });
}

void Executor::cancel() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    aborted_ = true;
  }
  task_cv_.notify_all();
}

void Executor::finish() {
  std::exception_ptr error;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    GF_EXPECTS(schedule_ != nullptr, "finish without a run in flight");
    done_cv_.wait(lock, [this] { return cells_running_ == 0; });
    for (EventId event : events_) {
      if (event >= 0) sync_->release(event);
    }
    events_.clear();
    for (const auto& span : spans_) {
      if (span.task >= 0) unread_.push_back(span);
    }
    spans_.clear();
    schedule_ = nullptr;
    fn_ = nullptr;
    done_.clear();
    ++runs_;
    error = error_;
    error_ = nullptr;
  }
  if (error) std::rethrow_exception(error);
}

std::vector<CellState> Executor::cell_states() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return cell_states_;
}

std::vector<TaskSpan> Executor::last_spans() {
  std::lock_guard<std::mutex> lock(mutex_);
  // Reading may wait for the device: never while a run is in flight.
  GF_EXPECTS(schedule_ == nullptr, "last_spans during a run");
  if (unread_.empty()) return last_spans_;
  last_spans_.reserve(unread_.size());
  try {
    for (const auto& span : unread_) {
      const std::int64_t start = clock_->resolve(span.start);
      last_spans_.push_back(TaskSpan{span.task, start, clock_->resolve(span.end)});
    }
  } catch (...) {
    last_spans_.clear();
    discard_unread();  // the stamps not resolved yet; resolved ones are already released
    throw;
  }
  unread_.clear();
  return last_spans_;
}

std::vector<std::string> Executor::cell_clocks() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::string> names;
  names.reserve(streams_.size());
  for (const Stream& stream : streams_) names.push_back(clock_->name(stream));
  return names;
}

void Executor::discard_unread() {
  for (const auto& span : unread_) {
    clock_->discard(span.start);
    clock_->discard(span.end);
  }
  unread_.clear();
  last_spans_.clear();
}

std::int64_t Executor::runs() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return runs_;
}

bool Executor::ready(const Task& task) const {
  for (int dep : task.deps) {
    if (!done_[static_cast<std::size_t>(dep)]) return false;
  }
  return true;
}

void Executor::worker_main(int cell) {
  name_thread(cell);
  std::uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      work_cv_.wait(lock, [&] { return shutdown_ || generation_ != seen; });
      if (shutdown_) break;
      seen = generation_;
    }
    run_cell(cell);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      --cells_running_;
    }
    done_cv_.notify_all();
  }
  if (on_thread_exit_) on_thread_exit_();
}

void Executor::run_cell(int cell) {
  const Schedule& schedule = *schedule_;  // fixed for the run; read without the lock
  const Stream stream = streams_[static_cast<std::size_t>(cell)];
  for (int id : schedule.order(cell)) {
    const Task& task = schedule.task(id);
    bool record = false;
    Stamp start;
    Stamp end;
    auto& state = cell_states_[static_cast<std::size_t>(cell)];
    {
      std::unique_lock<std::mutex> lock(mutex_);
      state = CellState{id, CellState::Phase::Waiting};
      task_cv_.wait(lock, [&] { return aborted_ || ready(task); });
      if (aborted_) return;
      state.phase = CellState::Phase::Running;
      record = !spans_.empty();
    }
    try {
      // Order this cell's stream after its producers' work (device-side on CUDA).
      for (int dep : task.deps) {
        if (schedule.task(dep).cell != cell) sync_->wait(stream, events_[static_cast<std::size_t>(dep)]);
      }
      // Stamped after the waits and right around the callback: on a CUDA stream the span
      // is the stream's time in the task's work, from after its producers' work on.
      if (record) start = clock_->stamp(stream);
      fn_(task);
      if (record) end = clock_->stamp(stream);
      const EventId event = sync_->record(stream);
      std::lock_guard<std::mutex> lock(mutex_);
      events_[static_cast<std::size_t>(id)] = event;
      if (record) spans_[static_cast<std::size_t>(id)] = StampedSpan{id, start, end};
      done_[static_cast<std::size_t>(id)] = 1;
      state = CellState{};
    } catch (...) {
      clock_->discard(start);  // a task that failed has no span
      clock_->discard(end);
      std::lock_guard<std::mutex> lock(mutex_);
      if (!error_) error_ = std::current_exception();
      aborted_ = true;
      task_cv_.notify_all();
      return;
    }
    task_cv_.notify_all();
  }
}

}  // namespace gpipe_fast
