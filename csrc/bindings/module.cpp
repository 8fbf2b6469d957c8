// The gpipe_fast._C module: one entry point that registers each binding area.
#include "bindings.hpp"

PYBIND11_MODULE(_C, m) {
  m.doc() = "Native core of gpipe_fast: schedules, executor, stream sync, partitioning, memory, boundary copies, same-host channels.";
  gpipe_fast::bindings::bind_schedule(m);
  gpipe_fast::bindings::bind_device(m);
  gpipe_fast::bindings::bind_executor(m);
  gpipe_fast::bindings::bind_partition(m);
  gpipe_fast::bindings::bind_memory(m);  // after bind_executor: its defaults are Streams
  gpipe_fast::bindings::bind_copy(m);
  gpipe_fast::bindings::bind_process(m);
  gpipe_fast::bindings::bind_shm(m);
}
