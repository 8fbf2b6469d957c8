// Declarations of the per-area binding functions that module.cpp calls.
#pragma once

#include <pybind11/pybind11.h>

namespace gpipe_fast::bindings {

void bind_schedule(pybind11::module_& m);
void bind_executor(pybind11::module_& m);
void bind_device(pybind11::module_& m);
void bind_partition(pybind11::module_& m);
void bind_memory(pybind11::module_& m);
void bind_copy(pybind11::module_& m);
void bind_process(pybind11::module_& m);
void bind_shm(pybind11::module_& m);

}  // namespace gpipe_fast::bindings
