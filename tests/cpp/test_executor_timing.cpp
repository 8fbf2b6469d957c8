// The executor's recording with a clock whose device stamps resolve later, like CUDA events:
// stamps around each task, reads only after the run, every event released, host cells kept.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "check.hpp"
#include "gpipe_fast/device.hpp"
#include "gpipe_fast/error.hpp"
#include "gpipe_fast/executor.hpp"
#include "gpipe_fast/generators.hpp"
#include "gpipe_fast/schedule.hpp"
#include "gpipe_fast/task_clock.hpp"

using gpipe_fast::Executor;
using gpipe_fast::InvalidArgument;
using gpipe_fast::Schedule;
using gpipe_fast::Stamp;
using gpipe_fast::Stream;
using gpipe_fast::Task;
using gpipe_fast::TaskSpan;

namespace {

// A clock with the CUDA clock's shape and no device: a stamp on a device stream is an
// "event" holding the steady clock read when it was enqueued plus a fixed device offset,
// readable only through resolve(). Counts every call, and flags misuse.
class DeferredClock final : public gpipe_fast::TaskClock {
 public:
  static constexpr std::int64_t kDeviceOffsetNs = 7;

  std::string name(const Stream& stream) const override {
    return stream.device < 0 ? "host" : "deferred";
  }

  void calibrate(const std::vector<Stream>& streams) override {
    std::lock_guard<std::mutex> lock(mutex_);
    ++calibrations;
    if (running) ++misuse;  // calibration blocks: never while a run is in flight
    for (const Stream& stream : streams) {
      if (stream.device >= 0) calibrated = true;
    }
  }

  Stamp stamp(const Stream& stream) override {
    std::lock_guard<std::mutex> lock(mutex_);
    ++stamps;
    if (stream.device < 0) return Stamp{gpipe_fast::steady_now_ns(), -1};
    if (!calibrated) ++misuse;
    const std::int64_t id = next_++;
    pending_[id] = gpipe_fast::steady_now_ns() + kDeviceOffsetNs;
    return Stamp{0, id};
  }

  std::int64_t resolve(const Stamp& stamp) override {
    std::lock_guard<std::mutex> lock(mutex_);
    ++resolves;
    if (running) ++misuse;  // resolving waits for the device: never during a run
    if (stamp.event < 0) return stamp.ns;
    if (fail_resolves) throw std::runtime_error("device lost");
    const auto it = pending_.find(stamp.event);
    if (it == pending_.end()) throw InvalidArgument("resolve of an unknown or released event");
    const std::int64_t ns = it->second;
    pending_.erase(it);
    return ns;
  }

  void discard(const Stamp& stamp) noexcept override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stamp.event >= 0) pending_.erase(stamp.event);
  }

  std::int64_t live_events() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return static_cast<std::int64_t>(pending_.size());
  }
  std::int64_t pooled_events() const override { return 0; }

  // Set by the test around runs; read under the clock's lock.
  void set_running(bool on) {
    std::lock_guard<std::mutex> lock(mutex_);
    running = on;
  }

  std::atomic<int> calibrations{0};
  std::atomic<int> stamps{0};
  std::atomic<int> resolves{0};
  std::atomic<int> misuse{0};
  std::atomic<bool> fail_resolves{false};

 private:
  mutable std::mutex mutex_;
  bool running = false;
  bool calibrated = false;
  std::int64_t next_ = 0;
  std::unordered_map<std::int64_t, std::int64_t> pending_;
};

struct Rig {
  explicit Rig(std::vector<Stream> streams)
      : clock(std::make_shared<DeferredClock>()),
        sync(gpipe_fast::make_host_sync()),
        executor(static_cast<int>(streams.size()), sync, {}, clock) {
    executor.set_streams(std::move(streams));
  }

  // Runs to the end with the clock told when the run is in flight (from start()'s return,
  // which may calibrate before it hands the run to the workers, to the run's end).
  void run(const std::shared_ptr<const Schedule>& schedule, const gpipe_fast::TaskFn& fn) {
    executor.start(schedule, fn);
    clock->set_running(true);
    executor.wait_for(std::chrono::milliseconds(5000));
    clock->set_running(false);
    executor.finish();
  }

  std::shared_ptr<DeferredClock> clock;
  std::shared_ptr<gpipe_fast::StreamSync> sync;
  Executor executor;
};

// A mixed pipeline: cells 0 and 2 on (fake) device streams, cell 1 on the host.
std::vector<Stream> mixed_streams() { return {Stream{0, 1}, Stream{-1, 0}, Stream{0, 2}}; }

void check_spans_follow_schedule(const Schedule& s, const std::vector<TaskSpan>& spans) {
  CHECK_EQ(spans.size(), s.tasks().size());
  if (spans.size() != s.tasks().size()) return;
  for (std::size_t i = 0; i < spans.size(); ++i) {
    CHECK_EQ(spans[i].task, static_cast<int>(i));
    CHECK(spans[i].start_ns <= spans[i].end_ns);
    for (int dep : s.task(static_cast<int>(i)).deps) {
      CHECK(spans[i].start_ns >= spans[static_cast<std::size_t>(dep)].end_ns);
    }
  }
}

}  // namespace

TEST(timing_off_makes_no_clock_calls) {
  Rig rig(mixed_streams());
  const auto s = std::make_shared<const Schedule>(gpipe_fast::gpipe_forward(3, 4));
  rig.run(s, [](const Task&) {});
  CHECK(rig.executor.last_spans().empty());
  CHECK_EQ(rig.clock->calibrations.load(), 0);
  CHECK_EQ(rig.clock->stamps.load(), 0);
  CHECK_EQ(rig.clock->resolves.load(), 0);
}

TEST(timing_stamps_around_each_task_and_resolves_only_when_read) {
  Rig rig(mixed_streams());
  CHECK(rig.executor.worker_clocks() == (std::vector<std::string>{"deferred", "host", "deferred"}));
  rig.executor.set_recording(true);
  CHECK_EQ(rig.clock->calibrations.load(), 1);  // at switch-on, outside any run
  const auto s = std::make_shared<const Schedule>(gpipe_fast::gpipe_backward(3, 4, {true, false, true, false}));
  const int tasks = static_cast<int>(s->tasks().size());
  const int device_tasks = static_cast<int>(s->order(0).size() + s->order(2).size());
  rig.run(s, [](const Task&) {});
  CHECK_EQ(rig.clock->stamps.load(), 2 * tasks);
  CHECK_EQ(rig.clock->resolves.load(), 0);  // nothing read until the spans are
  CHECK_EQ(rig.clock->live_events(), std::int64_t{2 * device_tasks});
  const auto spans = rig.executor.last_spans();
  CHECK_EQ(rig.clock->live_events(), std::int64_t{0});
  CHECK_EQ(rig.clock->misuse.load(), 0);
  check_spans_follow_schedule(*s, spans);
  CHECK_EQ(rig.clock->resolves.load(), 2 * tasks);  // host stamps pass through resolve too
  // A second read returns the same spans without resolving again.
  const int resolves = rig.clock->resolves.load();
  const auto again = rig.executor.last_spans();
  CHECK_EQ(rig.clock->resolves.load(), resolves);
  CHECK_EQ(again.size(), spans.size());
  CHECK(!again.empty() && again.front().start_ns == spans.front().start_ns);
  CHECK_EQ(rig.sync->live_events(), std::int64_t{0});
}

TEST(timing_unread_run_is_released_by_the_next_run_and_at_teardown) {
  const auto s = std::make_shared<const Schedule>(gpipe_fast::gpipe_forward(3, 2));
  std::shared_ptr<DeferredClock> clock;
  {
    Rig rig(mixed_streams());
    clock = rig.clock;
    rig.executor.set_recording(true);
    rig.run(s, [](const Task&) {});
    CHECK(clock->live_events() > 0);  // unread: the events wait for last_spans()
    rig.run(s, [](const Task&) {});   // the unread run's events go back at its start
    CHECK_EQ(clock->live_events(), std::int64_t{2 * 2 * 2});  // this run's: 2 cells x 2 x 2
    check_spans_follow_schedule(*s, rig.executor.last_spans());
    rig.run(s, [](const Task&) {});
    CHECK(clock->live_events() > 0);
  }  // destroyed with a run unread
  CHECK_EQ(clock->live_events(), std::int64_t{0});
  CHECK_EQ(clock->resolves.load(), 2 * static_cast<int>(s->tasks().size()));
  CHECK_EQ(clock->misuse.load(), 0);
}

TEST(timing_failed_task_leaves_no_span_and_no_event) {
  Rig rig(mixed_streams());
  rig.executor.set_recording(true);
  const auto s = std::make_shared<const Schedule>(gpipe_fast::gpipe_forward(3, 3));
  bool threw = false;
  try {
    rig.run(s, [](const Task& task) {
      if (task.stage == 2 && task.microbatch == 1) throw std::runtime_error("boom");
    });
  } catch (const std::runtime_error&) {
    threw = true;
  }
  CHECK(threw);
  const auto spans = rig.executor.last_spans();
  CHECK_EQ(rig.clock->live_events(), std::int64_t{0});
  const bool failed_has_span = std::any_of(spans.begin(), spans.end(), [&](const TaskSpan& span) {
    const Task& task = s->task(span.task);
    return task.stage == 2 && task.microbatch >= 1;
  });
  CHECK(!failed_has_span);
  CHECK(!spans.empty());
}

TEST(timing_read_failure_releases_every_event_and_rethrows) {
  Rig rig(mixed_streams());
  rig.executor.set_recording(true);
  const auto s = std::make_shared<const Schedule>(gpipe_fast::gpipe_forward(3, 3));
  rig.run(s, [](const Task&) {});
  rig.clock->fail_resolves = true;
  CHECK_THROWS(rig.executor.last_spans(), std::runtime_error);
  CHECK_EQ(rig.clock->live_events(), std::int64_t{0});
  CHECK(rig.executor.last_spans().empty());  // that run's spans are lost, nothing stale
  rig.clock->fail_resolves = false;
  rig.run(s, [](const Task&) {});
  check_spans_follow_schedule(*s, rig.executor.last_spans());
}

TEST(timing_last_spans_refused_during_a_run) {
  Rig rig(mixed_streams());
  rig.executor.set_recording(true);
  const auto s = std::make_shared<const Schedule>(gpipe_fast::gpipe_forward(3, 1));
  std::atomic<bool> release{false};
  std::atomic<bool> inside{false};
  rig.executor.start(s, [&](const Task& task) {
    if (task.stage != 0) return;
    inside = true;
    while (!release) std::this_thread::yield();
  });
  while (!inside) std::this_thread::yield();
  CHECK_THROWS(rig.executor.last_spans(), InvalidArgument);
  release = true;
  rig.executor.finish();
  check_spans_follow_schedule(*s, rig.executor.last_spans());
  CHECK_EQ(rig.clock->live_events(), std::int64_t{0});
}

TEST(timing_calibrates_before_runs_when_recording_was_switched_on_mid_run) {
  Rig rig(mixed_streams());
  const auto s = std::make_shared<const Schedule>(gpipe_fast::gpipe_forward(3, 1));
  std::atomic<bool> release{false};
  std::atomic<bool> inside{false};
  rig.executor.start(s, [&](const Task& task) {
    if (task.stage != 0) return;
    inside = true;
    while (!release) std::this_thread::yield();
  });
  rig.clock->set_running(true);
  while (!inside) std::this_thread::yield();
  rig.executor.set_recording(true);  // takes effect with the next run; calibrates there
  CHECK_EQ(rig.clock->calibrations.load(), 0);
  release = true;
  rig.executor.wait_for(std::chrono::milliseconds(5000));
  rig.clock->set_running(false);
  rig.executor.finish();
  CHECK(rig.executor.last_spans().empty());
  rig.run(s, [](const Task&) {});
  CHECK_EQ(rig.clock->calibrations.load(), 1);
  check_spans_follow_schedule(*s, rig.executor.last_spans());
  CHECK_EQ(rig.clock->misuse.load(), 0);
}

TEST(timing_host_executor_keeps_steady_clock_spans) {
  // The default clock: every cell timed on its worker by the steady clock, as before.
  Executor executor(2, gpipe_fast::make_host_sync());
  CHECK(executor.worker_clocks() == (std::vector<std::string>{"host", "host"}));
  executor.set_recording(true);
  const auto s = std::make_shared<const Schedule>(gpipe_fast::gpipe_forward(2, 3));
  const std::int64_t before = gpipe_fast::steady_now_ns();
  executor.run(s, [](const Task&) { std::this_thread::sleep_for(std::chrono::milliseconds(1)); });
  const std::int64_t after = gpipe_fast::steady_now_ns();
  const auto spans = executor.last_spans();
  check_spans_follow_schedule(*s, spans);
  for (const TaskSpan& span : spans) {
    CHECK(before <= span.start_ns && span.end_ns <= after);
    CHECK(span.end_ns - span.start_ns >= 1'000'000);  // the sleep is inside the span
  }
  CHECK_EQ(executor.clock().live_events(), std::int64_t{0});
}
