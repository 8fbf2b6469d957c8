// Bindings for the memory resources, the recompute pool and the torch allocator's entry points.
#include <cstdint>
#include <memory>

#include "bindings.hpp"
#include "gpipe_fast/device.hpp"
#include "gpipe_fast/memory.hpp"
#include "gpipe_fast/pool_registry.hpp"

namespace py = pybind11;

namespace gpipe_fast::bindings {
namespace {

std::uintptr_t allocate(MemoryResource& resource, std::size_t bytes, const Stream& stream) {
  return reinterpret_cast<std::uintptr_t>(resource.allocate(bytes, stream));
}

void deallocate(MemoryResource& resource, std::uintptr_t address, std::size_t bytes,
                const Stream& stream) {
  resource.deallocate(reinterpret_cast<void*>(address), bytes, stream);
}

}  // namespace

void bind_memory(py::module_& m) {
  m.attr("ALLOCATION_ALIGNMENT") = kAllocationAlignment;

  py::class_<MemoryResource, std::shared_ptr<MemoryResource>>(
      m, "MemoryResource",
      "Where memory comes from. A block freed on a stream may be reused at once by work on "
      "that stream, by another stream only after it is ordered after that work.")
      .def("allocate", &allocate, py::arg("bytes"), py::arg("stream") = Stream{},
           py::call_guard<py::gil_scoped_release>(),
           "Allocate `bytes` for work on `stream`; returns the address (0 for 0 bytes). "
           "MemoryError when the resource is out of memory.")
      .def("deallocate", &deallocate, py::arg("address"), py::arg("bytes"),
           py::arg("stream") = Stream{}, py::call_guard<py::gil_scoped_release>(),
           "Free a block whose last use is the work on `stream` so far; `bytes` as allocated. "
           "ValueError where the resource detects a double free or a wrong size.");

  py::class_<HostMemoryResource, MemoryResource, std::shared_ptr<HostMemoryResource>>(
      m, "HostMemoryResource", "Host memory from aligned new/delete.")
      .def(py::init<>());

  py::class_<SimulatedMemoryResource, MemoryResource, std::shared_ptr<SimulatedMemoryResource>>(
      m, "SimulatedMemoryResource",
      "Fake aligned addresses from [base, base + capacity), never dereferenced: allocator "
      "policy without a GPU. MemoryError past capacity.")
      .def(py::init<std::size_t, std::uintptr_t>(), py::arg("capacity"),
           py::arg("base") = SimulatedMemoryResource::kDefaultBase)
      .def_property_readonly("capacity", &SimulatedMemoryResource::capacity)
      .def_property_readonly("allocated_bytes", &SimulatedMemoryResource::allocated_bytes,
                             "Bytes of the live blocks, each rounded up to the alignment.")
      .def_property_readonly("live_blocks", &SimulatedMemoryResource::live_blocks);

  py::class_<CudaMemoryResource, MemoryResource, std::shared_ptr<CudaMemoryResource>>(
      m, "CudaMemoryResource",
      "Device memory on the stream's device (cudaMallocAsync/cudaFreeAsync when "
      "stream_ordered, else cudaMalloc/cudaFree). RuntimeError in a build without CUDA.")
      .def(py::init<bool>(), py::arg("stream_ordered") = true)
      .def_property_readonly("stream_ordered", &CudaMemoryResource::stream_ordered);

  py::class_<PoolStats>(m, "PoolStats", "What a RecomputePool holds and has done.")
      .def_readonly("current_bytes", &PoolStats::current_bytes, "Requested bytes in use.")
      .def_readonly("peak_bytes", &PoolStats::peak_bytes,
                    "Highest current_bytes since construction or reset_peak().")
      .def_readonly("reserved_bytes", &PoolStats::reserved_bytes, "Bytes of upstream arenas held.")
      .def_readonly("arenas", &PoolStats::arenas, "Upstream arenas held.")
      .def_readonly("allocations", &PoolStats::allocations, "Allocations served.")
      .def_readonly("reuses", &PoolStats::reuses, "Allocations served by a freed block.")
      .def("as_dict", [](const PoolStats& s) {
        return py::dict(py::arg("current_bytes") = s.current_bytes,
                        py::arg("peak_bytes") = s.peak_bytes,
                        py::arg("reserved_bytes") = s.reserved_bytes,
                        py::arg("arenas") = s.arenas, py::arg("allocations") = s.allocations,
                        py::arg("reuses") = s.reuses);
      }, "The statistics as a dict.");

  py::class_<RecomputePool, MemoryResource, std::shared_ptr<RecomputePool>>(
      m, "RecomputePool",
      "Size-classed blocks carved from upstream arenas and reused between micro-batches. A "
      "block freed on a stream is reused by that stream at once, by the device's other streams "
      "after release_stream(stream).")
      .def(py::init<std::shared_ptr<MemoryResource>, std::size_t>(), py::arg("upstream"),
           py::arg("arena_bytes") = RecomputePool::kDefaultArenaBytes)
      .def_property_readonly("arena_bytes", &RecomputePool::arena_bytes)
      .def_static("size_class", &RecomputePool::size_class, py::arg("bytes"),
                  "The block size a request of `bytes` occupies.")
      .def("release_stream", &RecomputePool::release_stream, py::arg("stream"),
           py::call_guard<py::gil_scoped_release>(),
           "Blocks freed (and arenas allocated) on `stream` become usable by every stream of its "
           "device: call once the stream's work so far is finished or ordered before theirs.")
      .def("trim", &RecomputePool::trim, py::call_guard<py::gil_scoped_release>(),
           "Return arenas whose blocks are all free and released to upstream; returns the "
           "bytes. Only after the device work that used them has finished.")
      .def("stats", &RecomputePool::stats, "Current, peak, reserved bytes and counts.")
      .def("reset_peak", &RecomputePool::reset_peak, "Restart peak_bytes from current_bytes.");

  m.def(
      "torch_allocator_symbols",
      []() -> py::object {
        if (!cuda_compiled()) return py::none();
        return py::make_tuple(kTorchMallocSymbol, kTorchFreeSymbol);
      },
      "(malloc, free) names of this module's extern \"C\" functions for "
      "torch.cuda.memory.CUDAPluggableAllocator(_C.__file__, malloc, free); None without CUDA.");
  py::class_<PoolRegistry, std::shared_ptr<PoolRegistry>>(
      m, "PoolRegistry",
      "Recompute pools by id over one upstream resource; each block is freed to the pool "
      "that handed it out.")
      .def(py::init<std::shared_ptr<MemoryResource>, std::size_t>(), py::arg("upstream"),
           py::arg("arena_bytes") = RecomputePool::kDefaultArenaBytes)
      .def("create", &PoolRegistry::create, "A new pool; returns its id.")
      .def("pool", &PoolRegistry::pool, py::arg("id"), "The pool with that id.")
      .def_property_readonly("pools", &PoolRegistry::pools)
      .def(
          "allocate",
          [](PoolRegistry& r, int id, std::size_t bytes, const Stream& stream) {
            return reinterpret_cast<std::uintptr_t>(r.allocate(id, bytes, stream));
          },
          py::arg("id"), py::arg("bytes"), py::arg("stream") = Stream{},
          py::call_guard<py::gil_scoped_release>(), "Allocate from pool `id`; the address.")
      .def(
          "deallocate",
          [](PoolRegistry& r, std::uintptr_t address, std::size_t bytes, const Stream& stream) {
            r.deallocate(reinterpret_cast<void*>(address), bytes, stream);
          },
          py::arg("address"), py::arg("bytes"), py::arg("stream") = Stream{},
          py::call_guard<py::gil_scoped_release>(), "Free to the pool that allocated it.")
      .def("retire", &PoolRegistry::retire, py::arg("id"),
           py::call_guard<py::gil_scoped_release>(),
           "The pool's owner is gone: give its free arenas back now, the rest when freed. "
           "Only after the device work that used it has finished. Returns the bytes.");

  m.def(
      "torch_allocator_pools",
      []() -> py::object {
        const auto pools = torch_allocator_pools();
        return pools ? py::cast(pools) : py::none();
      },
      "The process-wide PoolRegistry behind the torch allocator functions (pool 0 is the "
      "default); None without CUDA.");
  m.def("select_torch_allocator_pool", &select_torch_allocator_pool, py::arg("id"),
        "Send this thread's allocations through the torch allocator functions to pool `id` "
        "(0: the default); returns the previous id. RuntimeError without CUDA.");
  m.def(
      "torch_allocator_pool",
      []() -> py::object {
        const auto pool = torch_allocator_pool();
        return pool ? py::cast(pool) : py::none();
      },
      "The process-wide RecomputePool behind the torch allocator functions; None without CUDA.");
}

}  // namespace gpipe_fast::bindings
