// The executor on the host backend: ordering, reuse, errors, spans, cancel and teardown.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <typeinfo>
#include <utility>
#include <vector>

#include "check.hpp"
#include "gpipe_fast/device.hpp"
#include "gpipe_fast/error.hpp"
#include "gpipe_fast/executor.hpp"
#include "gpipe_fast/generators.hpp"
#include "gpipe_fast/kinds.hpp"
#include "gpipe_fast/schedule.hpp"

using gpipe_fast::Executor;
using gpipe_fast::InvalidArgument;
using gpipe_fast::Schedule;
using gpipe_fast::Task;
using gpipe_fast::RunControl;
using gpipe_fast::StepTimeout;
using gpipe_fast::Interrupted;

namespace {

// A schedule as the executor takes it.
std::shared_ptr<const Schedule> shared(Schedule schedule) {
  return std::make_shared<const Schedule>(std::move(schedule));
}

// Generous bound for "the run ends" (a hang fails the check instead of blocking forever).
constexpr std::chrono::milliseconds kNoHang{5000};

// Id of a task handed to a TaskFn: the executor passes references into schedule.tasks().
int id_of(const Schedule& schedule, const Task& task) {
  const auto& tasks = schedule.tasks();
  if (tasks.empty() || &task < tasks.data() || &task >= tasks.data() + tasks.size()) return -1;
  return static_cast<int>(&task - tasks.data());
}

// Records what ran: per-cell (cell, microbatch) lists, a global log of finished task ids,
// and violations (a task that started before one of its dependencies finished).
struct Recorder {
  explicit Recorder(const Schedule& s)
      : schedule(s), per_cell(static_cast<std::size_t>(s.workers())) {}

  void operator()(const Task& task) {
    const int id = id_of(schedule, task);
    std::lock_guard<std::mutex> lock(mutex);
    if (id < 0) {
      ++violations;
      return;
    }
    for (int dep : task.deps) {
      if (std::find(log.begin(), log.end(), dep) == log.end()) ++violations;
    }
    // Earlier tasks of the same cell are implied dependencies.
    const auto& order = schedule.order(task.worker);
    for (int earlier : order) {
      if (earlier == id) break;
      if (std::find(log.begin(), log.end(), earlier) == log.end()) ++violations;
    }
    per_cell[static_cast<std::size_t>(task.worker)].push_back(id);
    log.push_back(id);
  }

  void reset() {
    std::lock_guard<std::mutex> lock(mutex);
    for (auto& cell : per_cell) cell.clear();
    log.clear();
    violations = 0;
  }

  const Schedule& schedule;
  std::mutex mutex;
  std::vector<std::vector<int>> per_cell;
  std::vector<int> log;
  int violations = 0;
};

// A TaskFn that forwards to a Recorder owned by the test (TaskFn must be copyable).
gpipe_fast::TaskFn recording(Recorder& recorder) {
  return [&recorder](const Task& task) { recorder(task); };
}

}  // namespace

TEST(executor_runs_tasks_after_their_dependencies_in_worker_order) {
  auto sync = gpipe_fast::make_host_sync();
  Executor executor(3, sync);
  CHECK_EQ(executor.workers(), 3);
  const auto s = shared(gpipe_fast::gpipe_forward(3, 4));
  Recorder recorder(*s);
  executor.run(s, recording(recorder));
  CHECK_EQ(recorder.violations, 0);
  CHECK_EQ(recorder.log.size(), s->tasks().size());
  for (int cell = 0; cell < 3; ++cell) {
    CHECK(recorder.per_cell[static_cast<std::size_t>(cell)] == s->order(cell));
    // The forward schedule's cell order is micro-batch 0..3.
    std::vector<int> microbatches;
    for (int id : recorder.per_cell[static_cast<std::size_t>(cell)]) {
      microbatches.push_back(s->task(id).microbatch);
    }
    CHECK(microbatches == (std::vector<int>{0, 1, 2, 3}));
  }
  CHECK_EQ(sync->live_events(), std::int64_t{0});
  CHECK_EQ(executor.runs(), std::int64_t{1});
}

TEST(executor_is_reusable_for_many_runs) {
  auto sync = gpipe_fast::make_host_sync();
  Executor executor(3, sync);
  const auto forward = shared(gpipe_fast::gpipe_forward(3, 4));
  const auto backward = shared(gpipe_fast::gpipe_backward(3, 4, {true, false, true, false}));
  for (int run = 0; run < 50; ++run) {
    const auto& s = run % 2 == 0 ? forward : backward;
    Recorder recorder(*s);
    executor.run(s, recording(recorder));
    CHECK_EQ(recorder.violations, 0);
    CHECK_EQ(recorder.log.size(), s->tasks().size());
    for (int cell = 0; cell < 3; ++cell) {
      CHECK(recorder.per_cell[static_cast<std::size_t>(cell)] == s->order(cell));
    }
    CHECK_EQ(sync->live_events(), std::int64_t{0});
  }
  CHECK_EQ(executor.runs(), std::int64_t{50});
}

TEST(executor_rethrows_task_error_and_recovers) {
  auto sync = gpipe_fast::make_host_sync();
  Executor executor(3, sync);
  const auto s = shared(gpipe_fast::gpipe_forward(3, 4));
  Recorder recorder(*s);
  std::atomic<int> cell1_calls{0};
  const gpipe_fast::TaskFn failing = [&](const Task& task) {
    if (task.stage == 1) {
      ++cell1_calls;
      throw std::runtime_error("cell 1 exploded");
    }
    recorder(task);
  };

  // First via start/wait_for/finish, so a hang fails a check rather than blocking.
  executor.start(s, failing);
  const bool ended = executor.wait_for(kNoHang);
  CHECK(ended);
  if (!ended) return;  // the destructor cancels the run
  bool caught = false;
  try {
    executor.finish();
  } catch (const std::runtime_error& e) {
    caught = true;
    CHECK(typeid(e) == typeid(std::runtime_error));
    CHECK_EQ(std::string(e.what()), std::string("cell 1 exploded"));
  }
  CHECK(caught);
  CHECK_EQ(cell1_calls.load(), 1);  // cell 1 stopped at its first failure
  CHECK(recorder.per_cell[2].empty());  // cell 2 waits on cell 1 and must never start
  CHECK_EQ(recorder.violations, 0);
  CHECK_EQ(sync->live_events(), std::int64_t{0});

  // Then through run(): same type and message.
  cell1_calls = 0;
  recorder.reset();
  caught = false;
  try {
    executor.run(s, failing);
  } catch (const std::runtime_error& e) {
    caught = true;
    CHECK(typeid(e) == typeid(std::runtime_error));
    CHECK_EQ(std::string(e.what()), std::string("cell 1 exploded"));
  }
  CHECK(caught);
  CHECK_EQ(cell1_calls.load(), 1);
  CHECK(recorder.per_cell[2].empty());
  CHECK_EQ(sync->live_events(), std::int64_t{0});

  // The next run succeeds in full.
  recorder.reset();
  executor.run(s, recording(recorder));
  CHECK_EQ(recorder.violations, 0);
  CHECK_EQ(recorder.log.size(), s->tasks().size());
  CHECK_EQ(sync->live_events(), std::int64_t{0});
  CHECK_EQ(executor.runs(), std::int64_t{3});
}

TEST(executor_rethrows_exact_exception_type) {
  struct CustomError : std::runtime_error {
    using std::runtime_error::runtime_error;
  };
  auto sync = gpipe_fast::make_host_sync();
  Executor executor(2, sync);
  const auto s = shared(gpipe_fast::gpipe_forward(2, 3));
  bool caught = false;
  try {
    executor.run(s, [](const Task& task) {
      if (task.stage == 1 && task.microbatch == 2) {
        throw CustomError("custom " + std::to_string(task.microbatch));
      }
    });
  } catch (const CustomError& e) {
    caught = true;
    CHECK_EQ(std::string(e.what()), std::string("custom 2"));
  }
  CHECK(caught);
  CHECK_EQ(sync->live_events(), std::int64_t{0});
}

TEST(executor_records_spans_respecting_dependencies) {
  auto sync = gpipe_fast::make_host_sync();
  Executor executor(3, sync);
  const auto s = shared(gpipe_fast::gpipe_backward(3, 4, {true, true, false, true}));
  executor.run(s, [](const Task&) {});
  CHECK(executor.last_spans().empty());  // recording is off by default

  executor.set_recording(true);
  executor.run(s, [](const Task&) {});
  const auto spans = executor.last_spans();
  CHECK_EQ(spans.size(), s->tasks().size());
  if (spans.size() != s->tasks().size()) return;
  for (std::size_t i = 0; i < spans.size(); ++i) {
    CHECK_EQ(spans[i].task, static_cast<int>(i));
    CHECK(spans[i].start_ns <= spans[i].end_ns);
    for (int dep : s->task(static_cast<int>(i)).deps) {
      CHECK(spans[i].start_ns >= spans[static_cast<std::size_t>(dep)].end_ns);
    }
    // Same-cell order is an implied dependency.
    const auto& order = s->order(s->task(static_cast<int>(i)).worker);
    const auto at = std::find(order.begin(), order.end(), static_cast<int>(i));
    if (at != order.begin()) {
      CHECK(spans[i].start_ns >= spans[static_cast<std::size_t>(*(at - 1))].end_ns);
    }
  }
  CHECK_EQ(sync->live_events(), std::int64_t{0});

  executor.set_recording(false);
  executor.run(s, [](const Task&) {});
  CHECK(executor.last_spans().empty());
}

TEST(executor_rejects_schedule_with_wrong_worker_count) {
  auto sync = gpipe_fast::make_host_sync();
  Executor executor(3, sync);
  const auto two = shared(gpipe_fast::gpipe_forward(2, 2));
  const auto four = shared(gpipe_fast::gpipe_forward(4, 2));
  CHECK_THROWS(executor.run(two, [](const Task&) {}), InvalidArgument);
  CHECK_THROWS(executor.run(four, [](const Task&) {}), InvalidArgument);
  CHECK_THROWS(executor.start(two, [](const Task&) {}), InvalidArgument);
  CHECK_THROWS(executor.finish(), InvalidArgument);  // nothing in flight
  // Still usable afterwards.
  const auto three = shared(gpipe_fast::gpipe_forward(3, 2));
  std::atomic<int> calls{0};
  executor.run(three, [&](const Task&) { ++calls; });
  CHECK_EQ(calls.load(), 6);
  CHECK_EQ(executor.runs(), std::int64_t{1});
}

TEST(executor_rejects_bad_construction_and_invalid_schedule) {
  CHECK_THROWS(Executor(0, gpipe_fast::make_host_sync()), InvalidArgument);
  CHECK_THROWS(Executor(2, nullptr), InvalidArgument);
  Executor executor(1, gpipe_fast::make_host_sync());
  Schedule cyclic(1, 2);
  cyclic.add(gpipe_fast::action::Forward, 0, 0, {1});
  cyclic.add(gpipe_fast::action::Forward, 0, 1);
  CHECK_THROWS(executor.run(shared(cyclic), [](const Task&) {}), InvalidArgument);
  CHECK_THROWS(executor.run(shared(gpipe_fast::gpipe_forward(1, 1)), gpipe_fast::TaskFn{}),
               InvalidArgument);
}

TEST(executor_destroyed_while_idle_joins_cleanly) {
  std::atomic<int> exits{0};
  {
    Executor never_ran(4, gpipe_fast::make_host_sync(), [&] { ++exits; });
  }
  CHECK_EQ(exits.load(), 4);
  exits = 0;
  auto sync = gpipe_fast::make_host_sync();
  {
    Executor executor(3, sync, [&] { ++exits; });
    const auto s = shared(gpipe_fast::gpipe_forward(3, 2));
    executor.run(s, [](const Task&) {});
    executor.run(s, [](const Task&) {});
  }
  CHECK_EQ(exits.load(), 3);
  CHECK_EQ(sync->live_events(), std::int64_t{0});
}

TEST(executor_cancel_stops_run_without_remaining_tasks) {
  auto sync = gpipe_fast::make_host_sync();
  Executor executor(3, sync);
  const auto s = shared(gpipe_fast::gpipe_forward(3, 4));
  std::atomic<bool> sleeping{false};
  std::atomic<int> ran{0};
  const gpipe_fast::TaskFn fn = [&](const Task& task) {
    ++ran;
    if (task.stage == 0 && task.microbatch == 0) {
      sleeping = true;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  };
  executor.start(s, fn);
  const auto deadline = std::chrono::steady_clock::now() + kNoHang;
  while (!sleeping && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
  CHECK(sleeping.load());
  CHECK(!executor.wait_for(std::chrono::milliseconds(0)));  // the first task is still sleeping
  executor.cancel();
  const bool ended = executor.wait_for(kNoHang);
  CHECK(ended);
  if (!ended) return;
  executor.finish();  // a cancelled run is not an error
  CHECK_EQ(ran.load(), 1);  // only the task already running when cancel() came
  CHECK_EQ(sync->live_events(), std::int64_t{0});

  // The executor runs the full schedule afterwards.
  ran = 0;
  executor.run(s, [&](const Task&) { ++ran; });
  CHECK_EQ(ran.load(), static_cast<int>(s->tasks().size()));
  CHECK_EQ(sync->live_events(), std::int64_t{0});
}

TEST(executor_destroyed_during_run_does_not_hang) {
  auto sync = gpipe_fast::make_host_sync();
  const auto s = shared(gpipe_fast::gpipe_forward(2, 3));
  std::atomic<bool> started{false};
  {
    Executor executor(2, sync);
    executor.start(s, [&](const Task& task) {
      if (task.stage == 0 && task.microbatch == 0) {
        started = true;
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    });
    const auto deadline = std::chrono::steady_clock::now() + kNoHang;
    while (!started && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
  }  // destroyed without finish(): cancels, joins and releases the run's events
  CHECK(started.load());
  CHECK_EQ(sync->live_events(), std::int64_t{0});
}

TEST(executor_runs_several_stages_per_worker) {
  // Interleaved: 4 stages on 2 workers, stage s on worker s mod 2.
  auto sync = gpipe_fast::make_host_sync();
  Executor executor(2, sync);
  const auto s = shared(gpipe_fast::make_schedule("interleaved", 4, 2, 5,
                                                  gpipe_fast::Checkpoint::ExceptLast));
  Recorder recorder(*s);
  executor.run(s, recording(recorder));
  CHECK_EQ(recorder.violations, 0);
  CHECK_EQ(recorder.log.size(), s->tasks().size());
  for (int worker = 0; worker < 2; ++worker) {
    CHECK(recorder.per_cell[static_cast<std::size_t>(worker)] == s->order(worker));
    for (int id : s->order(worker)) CHECK_EQ(s->task(id).stage % 2, worker);
  }
}

TEST(executor_run_times_out_naming_each_stage_and_recovers) {
  auto sync = gpipe_fast::make_host_sync();
  Executor executor(2, sync);
  const auto s = shared(gpipe_fast::gpipe_forward(2, 2));
  std::atomic<bool> release{false};
  const gpipe_fast::TaskFn slow = [&](const Task& task) {
    if (task.stage == 0 && task.microbatch == 1) {
      while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  };
  RunControl control;
  control.timeout_s = 0.05;
  control.poll = std::chrono::milliseconds(5);
  // The stuck task is released only after the report was made; it returns within patience.
  control.interrupted = [&] { return false; };
  std::string message;
  std::thread releaser([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    release = true;
  });
  try {
    executor.run(s, slow, control);
  } catch (const StepTimeout& e) {
    message = e.what();
  }
  releaser.join();
  CHECK(message.find("cell 0 never finished its forward of micro-batch 1") != std::string::npos);
  CHECK(message.find("no longer run") == std::string::npos);
  CHECK(!executor.abandoned());
  std::atomic<int> calls{0};
  executor.run(s, [&](const Task&) { ++calls; });  // usable again
  CHECK_EQ(calls.load(), 4);
  CHECK_EQ(sync->live_events(), std::int64_t{0});
}

TEST(executor_abandons_a_stuck_task_and_refuses_further_runs) {
  auto sync = gpipe_fast::make_host_sync();
  auto release = std::make_shared<std::atomic<bool>>(false);
  auto exited = std::make_shared<std::atomic<int>>(0);
  {
    Executor executor(2, sync, [exited] { ++*exited; });
    const auto s = shared(gpipe_fast::gpipe_forward(2, 1));
    RunControl control;
    // Long enough for cell 1's worker to be waiting by then on a loaded machine (at 20 ms
    // it sometimes had not been scheduled yet, and the message could not name its wait).
    control.timeout_s = 0.3;
    control.poll = std::chrono::milliseconds(5);
    control.patience = std::chrono::milliseconds(20);
    std::string message;
    try {
      executor.run(s, [release](const Task& task) {
        if (task.stage == 0) {
          while (!*release) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
      }, control);
    } catch (const StepTimeout& e) {
      message = e.what();
    }
    CHECK(message.find("cell 0 never finished its forward of micro-batch 0") != std::string::npos);
    CHECK(message.find("cell 1 was waiting to start its forward of micro-batch 0") !=
          std::string::npos);
    CHECK(message.find("can no longer run steps") != std::string::npos);
    CHECK(executor.abandoned());
    CHECK_THROWS(executor.run(s, [](const Task&) {}), InvalidArgument);
  }  // destroyed with the task still stuck: detaches, does not wait for it
  CHECK(exited->load() < 2);  // the stuck worker is still inside its task
  *release = true;  // the abandoned worker returns, exits and frees the shared state
  const auto deadline = std::chrono::steady_clock::now() + kNoHang;
  while (exited->load() < 2 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  CHECK_EQ(exited->load(), 2);
}

TEST(executor_run_stops_when_interrupted_after_current_tasks) {
  auto sync = gpipe_fast::make_host_sync();
  Executor executor(2, sync);
  const auto s = shared(gpipe_fast::gpipe_forward(2, 4));
  std::atomic<int> ran{0};
  std::atomic<bool> inside{false};
  std::atomic<bool> finished_first{false};
  RunControl control;
  control.poll = std::chrono::milliseconds(5);
  control.interrupted = [&] { return inside.load(); };  // "Ctrl-C" once the first task runs
  bool caught = false;
  try {
    executor.run(s, [&](const Task& task) {
      ++ran;
      if (task.stage == 0 && task.microbatch == 0) {
        inside = true;
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        finished_first = true;  // the interrupt waited for this task to end
      }
    }, control);
  } catch (const Interrupted&) {
    caught = true;
  }
  CHECK(caught);
  CHECK(finished_first.load());
  CHECK(ran.load() < 8);
  CHECK_EQ(sync->live_events(), std::int64_t{0});
  ran = 0;
  executor.run(s, [&](const Task&) { ++ran; });
  CHECK_EQ(ran.load(), 8);
}
