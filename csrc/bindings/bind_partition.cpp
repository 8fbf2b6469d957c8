// Bindings for the optimal contiguous partitioner.
#include <pybind11/stl.h>

#include "bindings.hpp"
#include "gpipe_fast/partition.hpp"

namespace py = pybind11;

namespace gpipe_fast::bindings {

void bind_partition(py::module_& m) {
  m.def("partition", &partition, py::arg("costs"), py::arg("cells"),
        py::call_guard<py::gil_scoped_release>(),
        "Layers per cell of the contiguous split minimising the largest cell cost.");
}

}  // namespace gpipe_fast::bindings
