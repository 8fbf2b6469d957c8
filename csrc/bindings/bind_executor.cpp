// Bindings for the executor: Python task callbacks on worker threads, interruptible waits.
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <chrono>
#include <memory>
#include <string>

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

// Owns the native executor; joins its workers with the GIL released so that exiting
// workers can drop their Python state.
class PyExecutor {
 public:
  PyExecutor(int workers, const std::string& backend)
      : executor_(std::make_unique<Executor>(workers, make_sync(backend), drop_python_state)) {}

  ~PyExecutor() { close(); }

  void close() {
    if (!executor_) return;
    py::gil_scoped_release nogil;
    executor_.reset();
  }

  Executor& get() {
    if (!executor_) throw InvalidArgument("the executor is closed");
    return *executor_;
  }

  // Runs the schedule, calling fn(kind, cell, microbatch) on each task's worker. Waits in
  // short slices without the GIL and checks for signals between them, so Ctrl-C stops the
  // step: workers finish their current task, start no other, and KeyboardInterrupt is raised.
  void run(const Schedule& schedule, const py::function& fn) {
    Executor& executor = get();
    executor.start(schedule, [fn](const Task& task) { call_python(fn, task); });
    for (;;) {
      bool ended = false;
      {
        py::gil_scoped_release nogil;
        ended = executor.wait_for(std::chrono::milliseconds(50));
      }
      if (ended) break;
      if (PyErr_CheckSignals() != 0) {
        py::error_already_set interrupt;
        executor.cancel();
        {
          py::gil_scoped_release nogil;
          while (!executor.wait_for(std::chrono::milliseconds(50))) {
          }
        }
        try {
          executor.finish();
        } catch (...) {
          // A task error raised while stopping is dropped: the interrupt is what happened.
        }
        throw interrupt;
      }
    }
    executor.finish();
  }

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
      .def("run", &PyExecutor::run, py::arg("schedule"), py::arg("fn"),
           "Run a schedule; fn(kind, cell, microbatch) runs on the cell's worker. Re-raises "
           "the first task error; KeyboardInterrupt stops the run.")
      .def("close", &PyExecutor::close, "Join the workers; the executor is unusable after.")
      .def_property_readonly("workers", [](PyExecutor& e) { return e.get().workers(); })
      .def_property_readonly("backend", [](PyExecutor& e) { return e.get().sync().name(); })
      .def_property_readonly("runs", [](PyExecutor& e) { return e.get().runs(); })
      .def_property_readonly("live_events", [](PyExecutor& e) { return e.get().sync().live_events(); })
      .def_property_readonly("pooled_events", [](PyExecutor& e) { return e.get().sync().pooled_events(); })
      .def("set_streams", [](PyExecutor& e, std::vector<Stream> s) { e.get().set_streams(std::move(s)); },
           py::arg("streams"), "One stream per cell for the next runs.")
      .def("set_recording", [](PyExecutor& e, bool on) { e.get().set_recording(on); }, py::arg("on"),
           "Record task start/end times in the next runs.")
      .def("last_spans",
           [](PyExecutor& e) {
             py::list out;
             for (const auto& s : e.get().last_spans()) out.append(py::make_tuple(s.task, s.start_ns, s.end_ns));
             return out;
           },
           "(task id, start ns, end ns) of each task of the last run, when recording.");
}

}  // namespace gpipe_fast::bindings
