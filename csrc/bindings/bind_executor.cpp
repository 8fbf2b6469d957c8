// Bindings for the executor: Python task callbacks on worker threads, Ctrl-C and timeouts.
#include <pybind11/functional.h>
#include <pybind11/stl.h>

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

void drop_python_state() {
  if (worker_state == nullptr) return;
  PyThreadState* state = worker_state;
  worker_state = nullptr;
  if (interpreter_finalizing()) return;  // finalisation clears every thread state itself
  PyEval_RestoreThread(state);
  PyGILState_Release(PyGILState_UNLOCKED);  // last reference: deletes the state, drops the GIL
}

// The Python callable of a run, owned so that its last reference drops under the GIL from
// whichever thread lets go of it (an abandoned run's worker, possibly).
std::shared_ptr<PyObject> hold(const py::function& fn) {
  return std::shared_ptr<PyObject>(fn.inc_ref().ptr(), [](PyObject* object) {
    if (interpreter_finalizing()) return;
    py::gil_scoped_acquire gil;
    Py_DECREF(object);
  });
}

// Calls fn(action, stage, microbatch) with plain ints; a Python error becomes a C++
// exception that the executor carries back to the caller.
TaskFn python_task(const py::function& fn) {
  return [callable = hold(fn)](const Task& task) {
    if (worker_state == nullptr) {
      PyGILState_Ensure();                 // creates this thread's state; GIL held
      worker_state = PyEval_SaveThread();  // keep the state, drop the GIL
    }
    py::gil_scoped_acquire gil;
    PyObject* args[] = {PyLong_FromLong(task.action), PyLong_FromLong(task.stage),
                        PyLong_FromLong(task.microbatch)};
    PyObject* result = PyObject_Vectorcall(callable.get(), args, 3, nullptr);
    for (PyObject* arg : args) Py_XDECREF(arg);
    if (result == nullptr) throw py::error_already_set();
    Py_DECREF(result);
  };
}

std::shared_ptr<StreamSync> make_sync(const std::string& backend) {
  if (backend == "host") return make_host_sync();
  if (backend == "cuda") return make_cuda_sync();
  throw InvalidArgument("backend must be 'host' or 'cuda', got '" + backend + "'");
}

// The cuda backend's clock times CUDA workers by events and CPU workers on the host.
std::shared_ptr<TaskClock> make_clock(const std::string& backend) {
  return backend == "cuda" ? make_cuda_clock() : make_host_clock();
}

// Owns the native executor; closing joins its workers with the GIL released so that exiting
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
    if (!executor_) throw InvalidArgument("the executor is closed");
    return *executor_;
  }

  void run(std::shared_ptr<const Schedule> schedule, const py::function& fn, double timeout_s,
           const py::object& on_interrupt) {
    Executor& executor = get();
    RunControl control;
    control.timeout_s = timeout_s;
    control.interrupted = [&executor, &on_interrupt] {
      py::gil_scoped_acquire gil;
      if (PyErr_CheckSignals() == 0) return false;
      // Cancelled while the GIL is still held: a worker woken by the signal handler (which
      // ran just now) cannot start another task before the run is cancelled.
      executor.cancel();
      if (!on_interrupt.is_none()) {
        // Told while the workers still run their tasks: a task waiting on another process
        // learns of it and ends, rather than holding the run until its wait's timeout.
        py::error_scope pending;  // the KeyboardInterrupt, set aside for the call
        try {
          on_interrupt();
        } catch (py::error_already_set& error) {
          error.discard_as_unraisable("gpipe_fast: the executor's on_interrupt");
        }
      }
      return true;  // KeyboardInterrupt stays pending for the caller
    };
    try {
      py::gil_scoped_release nogil;
      executor.run(std::move(schedule), python_task(fn), control);
    } catch (const Interrupted&) {
      throw py::error_already_set();  // the pending KeyboardInterrupt
    }
  }

 private:
  std::unique_ptr<Executor> executor_;
};

}  // namespace

void bind_executor(py::module_& m) {
  py::register_exception_translator([](std::exception_ptr error) {
    try {
      if (error) std::rethrow_exception(error);
    } catch (const StepTimeout& timeout) {
      PyErr_SetString(PyExc_TimeoutError, timeout.what());
    }
  });

  py::class_<Stream>(m, "Stream", "A stream as plain facts: device index and raw handle.")
      .def(py::init<int, std::uintptr_t>(), py::arg("device"), py::arg("handle"))
      .def_readonly("device", &Stream::device)
      .def_readonly("handle", &Stream::handle);

  py::class_<PyExecutor>(m, "Executor", "One persistent worker thread per worker.")
      .def(py::init<int, const std::string&>(), py::arg("workers"), py::arg("backend") = "host")
      .def("run", &PyExecutor::run, py::arg("schedule"), py::arg("fn"), py::arg("timeout_s") = 0.0,
           py::arg("on_interrupt") = py::none(),
           "Run a schedule; fn(action, stage, microbatch) runs on the stage's worker. Re-raises "
           "the first task error; KeyboardInterrupt stops the run once each worker has ended "
           "its task (on_interrupt(), when given, is called first, while they run); with "
           "timeout_s > 0, TimeoutError names each stage's unfinished task.")
      .def("close", &PyExecutor::close, "Join the workers; the executor is unusable after.")
      .def_property_readonly("workers", [](PyExecutor& e) { return e.get().workers(); })
      .def_property_readonly("backend", [](PyExecutor& e) { return e.get().sync().name(); })
      .def_property_readonly("runs", [](PyExecutor& e) { return e.get().runs(); })
      .def_property_readonly("abandoned", [](PyExecutor& e) { return e.get().abandoned(); })
      .def_property_readonly("live_events", [](PyExecutor& e) { return e.get().sync().live_events(); })
      .def_property_readonly("pooled_events", [](PyExecutor& e) { return e.get().sync().pooled_events(); })
      .def("set_streams", [](PyExecutor& e, std::vector<Stream> s) { e.get().set_streams(std::move(s)); },
           py::arg("streams"), "One stream per worker for the next runs.")
      .def_property_readonly("live_timing_events", [](PyExecutor& e) { return e.get().clock().live_events(); })
      .def_property_readonly("pooled_timing_events", [](PyExecutor& e) { return e.get().clock().pooled_events(); })
      .def("set_recording", [](PyExecutor& e, bool on) { e.get().set_recording(on); }, py::arg("on"),
           "Record task start/end times in the next runs (on CUDA workers: by CUDA events).")
      .def("worker_clocks", [](PyExecutor& e) { return e.get().worker_clocks(); },
           "Per worker, what times its tasks: 'host' (steady clock) or 'cuda' (CUDA events).")
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
