// Bindings for the process's shutdown: threads the interpreter ends park, not abort.
#include "bindings.hpp"
#include "gpipe_fast/exit_guard.hpp"

namespace py = pybind11;

namespace gpipe_fast::bindings {

void bind_process(py::module_& m) {
  m.def("install_exit_guard", &install_exit_guard,
        "Installs the terminate handler that parks, rather than aborts, a thread the "
        "interpreter ends while it shuts down (once; later calls do nothing).");
  m.def("interpreter_exiting", &interpreter_exiting,
        "Called from an atexit handler on the finalising thread: from now on another thread "
        "ended by the shutdown parks instead of aborting the process.");
}

}  // namespace gpipe_fast::bindings
