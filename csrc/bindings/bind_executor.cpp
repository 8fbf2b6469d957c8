// Bindings for the executor: Python task callbacks on worker threads, interruptible waits.
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "bindings.hpp"
#include "gpipe_fast/error.hpp"
#include "gpipe_fast/executor.hpp"

namespace py = pybind11;

namespace gpipe_fast::bindings {
namespace {

bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

// Each worker keeps one Python thread state from its first callback until it ends, so
// Python thread-locals (and torch's per-thread settings made from Python) survive between
// tasks instead of being rebuilt every call.
thread_local PyThreadState* worker_state = nullptr;

void call_python(const py::function& fn, const Task& task) {
  if (worker_state == nullptr) {
    PyGILState_Ensure();                  // creates this thread's state; GIL held
    worker_state = PyEval_SaveThread();   // keep the state, drop the GIL
  }
  py::gil_scoped_acquire gil;
  fn(task.kind, task.cell, task.microbatch);
}

void drop_python_state() {
  if (worker_state == nullptr) return;
  PyThreadState* state = worker_state;
  worker_state = nullptr;
  if (interpreter_finalizing()) return;  // finalisation clears every thread state itself
  PyEval_RestoreThread(state);
  PyGILState_Release(PyGILState_UNLOCKED);  // last reference: deletes the state, drops the GIL
}

std::shared_ptr<StreamSync> make_sync(const std::string& backend) {
  if (backend == "host") return make_host_sync();
  if (backend == "cuda") return make_cuda_sync();
  throw InvalidArgument("backend must be 'host' or 'cuda', got '" + backend + "'");
}

// The cuda backend's clock times CUDA cells by events and CPU cells on the host.
std::shared_ptr<TaskClock> make_clock(const std::string& backend) {
  return backend == "cuda" ? make_cuda_clock() : make_host_clock();
}

// Owns the native executor; joins its workers with the GIL released so that exiting
// workers can drop their Python state.
class PyExecutor {
 public:
  PyExecutor(int workers, const std::string& backend)
      : executor_(std::make_unique<Executor>(workers, make_sync(backend), drop_python_state,
                                             make_clock(backend))) {}

  ~PyExecutor() { close(); }

  void close() {
    if (!executor_) return;
    py::gil_scoped_release nogil;
    executor_.reset();
  }

  Executor& get() {
    if (abandoned_) {
      throw InvalidArgument(
          "the executor was abandoned after a step timed out while a task was still running; "
          "build a new pipe");
    }
    if (!executor_) throw InvalidArgument("the executor is closed");
    return *executor_;
  }

  // Runs the schedule, calling fn(kind, cell, microbatch) on each task's worker. Waits in
  // short slices without the GIL and checks for signals between them, so Ctrl-C stops the
  // step: workers finish their current task, start no other, and KeyboardInterrupt is raised.
  // With timeout_s > 0, a run still going after that long is cancelled the same way and
  // TimeoutError names what each cell was doing.
  void run(const Schedule& schedule, const py::function& fn, double timeout_s) {
    Executor& executor = get();
    executor.start(schedule, [fn](const Task& task) { call_python(fn, task); });
    const auto started = std::chrono::steady_clock::now();
    for (;;) {
      bool ended = false;
      {
        py::gil_scoped_release nogil;
        ended = executor.wait_for(std::chrono::milliseconds(50));
      }
      if (ended) break;
      if (PyErr_CheckSignals() != 0) {
        py::error_already_set interrupt;
        stop(executor, std::chrono::hours(24 * 365));
        throw interrupt;
      }
      const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - started;
      if (timeout_s > 0 && elapsed.count() > timeout_s) {
        const std::string report = describe(schedule, executor.cell_states());
        // A task that is stuck cannot be stopped from outside; give running tasks a moment
        // to return, else leave the workers behind (never joined, never freed) and fail.
        const bool stopped = stop(executor, std::chrono::seconds(2));
        std::string message = "gpipe_fast: step timed out after " + std::to_string(timeout_s) +
                              " s; " + report;
        if (!stopped) {
          abandoned_ = true;
          static_cast<void>(executor_.release());
          message += " (a task is still running: this pipe can no longer run steps)";
        }
        PyErr_SetString(PyExc_TimeoutError, message.c_str());
        throw py::error_already_set();
      }
    }
    executor.finish();
  }

 private:
  // Cancels the run and waits up to `patience` for it to end; then finishes it, dropping any
  // task error (what stopped the run is the caller's reason). False if it did not end.
  template <typename Duration>
  bool stop(Executor& executor, Duration patience) {
    executor.cancel();
    const auto deadline = std::chrono::steady_clock::now() + patience;
    bool ended = false;
    {
      py::gil_scoped_release nogil;
      while (!(ended = executor.wait_for(std::chrono::milliseconds(50))) &&
             std::chrono::steady_clock::now() < deadline) {
      }
    }
    if (!ended) return false;
    try {
      executor.finish();
    } catch (...) {
    }
    return true;
  }

  static std::string describe(const Schedule& schedule, const std::vector<CellState>& states) {
    std::string out;
    for (std::size_t cell = 0; cell < states.size(); ++cell) {
      const CellState& state = states[cell];
      if (state.phase == CellState::Phase::Done) continue;
      const Task& task = schedule.task(state.task);
      if (!out.empty()) out += "; ";
      out += "cell " + std::to_string(cell) +
             (state.phase == CellState::Phase::Running ? " never finished its "
                                                       : " was waiting to start its ") +
             to_string(task.kind) + " of micro-batch " + std::to_string(task.microbatch);
    }
    return out.empty() ? "every cell had finished its tasks" : out;
  }

  bool abandoned_ = false;

 public:

 private:
  std::unique_ptr<Executor> executor_;
};

}  // namespace

void bind_executor(py::module_& m) {
  py::class_<Stream>(m, "Stream", "A stream as plain facts: device index and raw handle.")
      .def(py::init<int, std::uintptr_t>(), py::arg("device"), py::arg("handle"))
      .def_readonly("device", &Stream::device)
      .def_readonly("handle", &Stream::handle);

  py::class_<PyExecutor>(m, "Executor", "One persistent worker thread per cell.")
      .def(py::init<int, const std::string&>(), py::arg("workers"), py::arg("backend") = "host")
      .def("run", &PyExecutor::run, py::arg("schedule"), py::arg("fn"), py::arg("timeout_s") = 0.0,
           "Run a schedule; fn(kind, cell, microbatch) runs on the cell's worker. Re-raises "
           "the first task error; KeyboardInterrupt stops the run; with timeout_s > 0, "
           "TimeoutError names the cells' unfinished tasks.")
      .def("close", &PyExecutor::close, "Join the workers; the executor is unusable after.")
      .def_property_readonly("workers", [](PyExecutor& e) { return e.get().workers(); })
      .def_property_readonly("backend", [](PyExecutor& e) { return e.get().sync().name(); })
      .def_property_readonly("runs", [](PyExecutor& e) { return e.get().runs(); })
      .def_property_readonly("live_events", [](PyExecutor& e) { return e.get().sync().live_events(); })
      .def_property_readonly("pooled_events", [](PyExecutor& e) { return e.get().sync().pooled_events(); })
      .def("set_streams", [](PyExecutor& e, std::vector<Stream> s) { e.get().set_streams(std::move(s)); },
           py::arg("streams"), "One stream per cell for the next runs.")
      .def_property_readonly("live_timing_events", [](PyExecutor& e) { return e.get().clock().live_events(); })
      .def_property_readonly("pooled_timing_events", [](PyExecutor& e) { return e.get().clock().pooled_events(); })
      .def("set_recording", [](PyExecutor& e, bool on) { e.get().set_recording(on); }, py::arg("on"),
           "Record task start/end times in the next runs (on CUDA cells: by CUDA events).")
      .def("cell_clocks", [](PyExecutor& e) { return e.get().cell_clocks(); },
           "Per cell, what times its tasks: 'host' (steady clock) or 'cuda' (CUDA events).")
      .def("last_spans",
           [](PyExecutor& e) {
             Executor& executor = e.get();
             std::vector<TaskSpan> spans;
             {
               // Waits for a CUDA run's timing events: without the GIL.
               py::gil_scoped_release nogil;
               spans = executor.last_spans();
             }
             py::list out;
             for (const auto& s : spans) out.append(py::make_tuple(s.task, s.start_ns, s.end_ns));
             return out;
           },
           "(task id, start ns, end ns) of each task of the last run, when recording; steady "
           "clock ns. The first read of a CUDA run waits for its timing events.");
}

}  // namespace gpipe_fast::bindings
