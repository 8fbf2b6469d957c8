// Bindings for tasks, schedules, the fill-drain generators and the simulator.
#include <pybind11/stl.h>

#include "bindings.hpp"
#include "gpipe_fast/schedule.hpp"

namespace py = pybind11;

namespace gpipe_fast::bindings {

void bind_schedule(py::module_& m) {
  py::enum_<TaskKind>(m, "TaskKind", "What a task does to its (cell, micro-batch).")
      .value("Forward", TaskKind::Forward)
      .value("Recompute", TaskKind::Recompute)
      .value("Backward", TaskKind::Backward);

  py::class_<Task>(m, "Task", "One unit of work: a pass of one cell over one micro-batch.")
      .def_readonly("kind", &Task::kind)
      .def_readonly("cell", &Task::cell)
      .def_readonly("microbatch", &Task::microbatch)
      .def_readonly("deps", &Task::deps, "Ids of the tasks that must finish first.")
      .def("__repr__", [](const Task& t) {
        return "Task(" + std::string(to_string(t.kind)) + ", cell=" + std::to_string(t.cell) +
               ", microbatch=" + std::to_string(t.microbatch) + ")";
      });

  py::class_<Schedule>(m, "Schedule", "Tasks with dependencies and each cell's run order.")
      .def(py::init<int, int>(), py::arg("cells"), py::arg("microbatches"))
      .def("add", &Schedule::add, py::arg("kind"), py::arg("cell"), py::arg("microbatch"),
           py::arg("deps") = std::vector<int>{}, "Append a task to its cell's order; returns its id.")
      .def_property_readonly("cells", &Schedule::cells)
      .def_property_readonly("microbatches", &Schedule::microbatches)
      .def_property_readonly("tasks", &Schedule::tasks, "All tasks, indexed by id.")
      .def("order", &Schedule::order, py::arg("cell"), "Task ids in the order the cell runs them.")
      .def("validate", &Schedule::validate, "Raise ValueError on a bad dependency or a cycle.");

  m.def("gpipe_forward", &gpipe_forward, py::arg("cells"), py::arg("microbatches"),
        "GPipe fill-drain forward: micro-batch m runs cell k at tick m + k.");
  m.def("gpipe_backward", &gpipe_backward, py::arg("cells"), py::arg("microbatches"),
        py::arg("recompute"),
        "GPipe fill-drain backward, last micro-batch first; Recompute before Backward where flagged.");

  py::class_<SimulatedTimeline>(m, "SimulatedTimeline", "Predicted start/end of every task.")
      .def_readonly("start", &SimulatedTimeline::start)
      .def_readonly("end", &SimulatedTimeline::end)
      .def_readonly("makespan", &SimulatedTimeline::makespan)
      .def_readonly("bubble", &SimulatedTimeline::bubble, "Idle share of cell-time.");
  m.def("simulate", &simulate, py::arg("schedule"), py::arg("cost"),
        "Predict the timeline of a schedule given each task's cost.");
}

}  // namespace gpipe_fast::bindings
