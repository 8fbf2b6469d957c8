// Bindings for the boundary copier (peer access, event-ordered device copies).
#include <cstdint>
#include <memory>

#include "bindings.hpp"
#include "gpipe_fast/copy.hpp"

namespace py = pybind11;

namespace gpipe_fast::bindings {

void bind_copy(py::module_& m) {
  py::class_<BoundaryCopier, std::shared_ptr<BoundaryCopier>>(
      m, "BoundaryCopier",
      "Device-to-device boundary copies on a copy stream, ordered by pooled CUDA events "
      "without host synchronisation. RuntimeError in a build without CUDA.")
      .def(py::init([] {
        return std::make_shared<BoundaryCopier>(make_cuda_sync(), make_cuda_copy_ops());
      }))
      .def("enable_peer_access", &BoundaryCopier::enable_peer_access, py::arg("device"),
           py::arg("peer"), py::call_guard<py::gil_scoped_release>(),
           "Let `device` access `peer`'s memory; False when the pair has no peer path. "
           "Asks the driver once per pair.")
      .def(
          "copy",
          [](BoundaryCopier& copier, std::uintptr_t destination, int destination_device,
             std::uintptr_t source, int source_device, std::size_t bytes, const Stream& consumer,
             const Stream& copy_stream) {
            copier.copy(DeviceBuffer{destination, destination_device},
                        DeviceBuffer{source, source_device}, bytes, consumer, copy_stream);
          },
          py::arg("destination"), py::arg("destination_device"), py::arg("source"),
          py::arg("source_device"), py::arg("bytes"), py::arg("consumer"),
          py::arg("copy_stream"), py::call_guard<py::gil_scoped_release>(),
          "Copy `bytes` on `copy_stream` after the consumer's work so far; the consumer "
          "stream then waits for the copy. Keep the source alive until the copy stream has "
          "read it.")
      .def_property_readonly(
          "live_events", [](const BoundaryCopier& c) { return c.sync().live_events(); },
          "Pooled events in use (0 between copies).")
      .def_property_readonly(
          "pooled_events", [](const BoundaryCopier& c) { return c.sync().pooled_events(); },
          "Events the pool has created.");
}

}  // namespace gpipe_fast::bindings
