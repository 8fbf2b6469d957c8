// Bindings for build facts of the device layer.
#include "bindings.hpp"
#include "gpipe_fast/device.hpp"

namespace py = pybind11;

namespace gpipe_fast::bindings {

void bind_device(py::module_& m) {
  m.def("cuda_compiled", &cuda_compiled, "Whether this build has the CUDA backend.");
}

}  // namespace gpipe_fast::bindings
