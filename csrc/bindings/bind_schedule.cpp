// Bindings for actions, tasks, schedules, the generators, the dry run and the simulator.
#include <pybind11/stl.h>

#include <algorithm>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "bindings.hpp"
#include "gpipe_fast/error.hpp"
#include "gpipe_fast/generators.hpp"
#include "gpipe_fast/lower.hpp"
#include "gpipe_fast/schedule.hpp"

namespace py = pybind11;

namespace gpipe_fast::bindings {
namespace {

// A program step as Python sees it: (action name, stage, micro-batch).
using PyStep = std::tuple<std::string, int, int>;
using PyProgram = std::vector<std::vector<PyStep>>;

ActionId action_named(const std::string& name) {
  const auto id = find_action(name);
  if (!id) throw InvalidArgument("unknown action '" + name + "'");
  return *id;
}

PyProgram to_python(const Program& program) {
  PyProgram out;
  for (const auto& order : program) {
    auto& steps = out.emplace_back();
    for (const TaskKey& key : order) steps.emplace_back(action_info(key.action).name, key.stage, key.microbatch);
  }
  return out;
}

Program from_python(const PyProgram& program) {
  Program out;
  for (const auto& steps : program) {
    auto& order = out.emplace_back();
    for (const auto& [name, stage, microbatch] : steps) order.push_back({action_named(name), stage, microbatch});
  }
  return out;
}

// Stage s on worker s mod workers, as every generator places them.
std::vector<int> round_robin(int stages, int workers) {
  std::vector<int> stage_workers;
  for (int s = 0; s < stages; ++s) stage_workers.push_back(s % std::max(workers, 1));
  return stage_workers;
}

}  // namespace

void bind_schedule(py::module_& m) {
  m.def(
      "actions",
      [] {
        std::vector<std::string> names;
        for (int id = 0; id < action_count(); ++id) names.push_back(action_info(id).name);
        return names;
      },
      "Every action's name, indexed by its id.");

  py::class_<Task>(m, "Task", "One unit of work: an action of one stage on one micro-batch.")
      .def_readonly("action", &Task::action, "The action's id (see actions()).")
      .def_property_readonly("action_name", [](const Task& t) { return action_info(t.action).name; })
      .def_readonly("stage", &Task::stage)
      .def_readonly("microbatch", &Task::microbatch)
      .def_readonly("worker", &Task::worker, "The worker that runs the task's stage.")
      .def_readonly("deps", &Task::deps, "Ids of the tasks that must finish first.")
      .def("__repr__", [](const Task& t) { return "Task(" + describe(t.key()) + ")"; });

  py::class_<Schedule, std::shared_ptr<Schedule>>(
      m, "Schedule", "Tasks with dependencies and each worker's run order.")
      .def(py::init<int, int, std::vector<int>>(), py::arg("stages"), py::arg("microbatches"),
           py::arg("stage_workers") = std::vector<int>{})
      .def(
          "add",
          [](Schedule& s, const std::string& action, int stage, int microbatch, std::vector<int> deps) {
            return s.add(action_named(action), stage, microbatch, std::move(deps));
          },
          py::arg("action"), py::arg("stage"), py::arg("microbatch"),
          py::arg("deps") = std::vector<int>{}, "Append a task to its worker's order; returns its id.")
      .def_property_readonly("stages", &Schedule::stages)
      .def_property_readonly("workers", &Schedule::workers)
      .def_property_readonly("microbatches", &Schedule::microbatches)
      .def_property_readonly("stage_workers", &Schedule::stage_workers)
      .def_property_readonly("tasks", &Schedule::tasks, "All tasks, indexed by id.")
      .def("order", &Schedule::order, py::arg("worker"), "Task ids in the order the worker runs them.")
      .def("validate", &Schedule::validate,
           "Raise ValueError on a bad dependency, an order that breaks one, or a deadlock.");

  m.def(
      "program",
      [](const std::string& kind, int stages, int workers, int microbatches, const std::string& checkpoint) {
        return to_python(make_program(kind, stages, workers, microbatches, parse_checkpoint(checkpoint)));
      },
      py::arg("kind"), py::arg("stages"), py::arg("workers"), py::arg("microbatches"),
      py::arg("checkpoint") = "never",
      "Each worker's program of (action, stage, micro-batch) for a schedule kind.");
  m.def(
      "link",
      [](const PyProgram& program, int stages, int microbatches, std::vector<int> stage_workers,
         const std::vector<std::string>& given) {
        std::vector<ActionId> given_ids;
        for (const auto& name : given) given_ids.push_back(action_named(name));
        return std::make_shared<Schedule>(
            link(from_python(program), stages, microbatches, std::move(stage_workers), given_ids));
      },
      py::arg("program"), py::arg("stages"), py::arg("microbatches"),
      py::arg("stage_workers") = std::vector<int>{}, py::arg("given") = std::vector<std::string>{},
      "A schedule running the program, dependencies from the actions' rules (not validated).");
  m.def(
      "make_schedule",
      [](const std::string& kind, int stages, int workers, int microbatches, const std::string& checkpoint) {
        return std::make_shared<Schedule>(
            make_schedule(kind, stages, workers, microbatches, parse_checkpoint(checkpoint)));
      },
      py::arg("kind"), py::arg("stages"), py::arg("workers"), py::arg("microbatches"),
      py::arg("checkpoint") = "never",
      "The validated training-step schedule of a kind: gpipe | 1f1b | interleaved | zero_bubble.");
  m.def(
      "forward_program",
      [](const std::string& kind, int stages, int workers, int microbatches, bool loss) {
        return to_python(forward_only_program(kind, stages, workers, microbatches, loss));
      },
      py::arg("kind"), py::arg("stages"), py::arg("workers"), py::arg("microbatches"),
      py::arg("loss") = true,
      "Each worker's forward-only program of a kind (an evaluation step): its training "
      "program's forwards in order, each last-stage forward followed by its loss when `loss`.");
  m.def(
      "forward_schedule",
      [](const std::string& kind, int stages, int workers, int microbatches, bool loss) {
        return std::make_shared<Schedule>(
            make_forward_schedule(kind, stages, workers, microbatches, loss));
      },
      py::arg("kind"), py::arg("stages"), py::arg("workers"), py::arg("microbatches"),
      py::arg("loss") = true, "The validated forward-only schedule of forward_program.");
  m.def(
      "gpipe_forward",
      [](int stages, int microbatches, std::vector<int> stage_workers) {
        return std::make_shared<Schedule>(gpipe_forward(stages, microbatches, std::move(stage_workers)));
      },
      py::arg("stages"), py::arg("microbatches"), py::arg("stage_workers") = std::vector<int>{},
      "GPipe fill-drain forward: micro-batch m runs stage k at tick m + k.");
  m.def(
      "gpipe_backward",
      [](int stages, int microbatches, const std::vector<bool>& recompute,
         std::vector<int> stage_workers) {
        return std::make_shared<Schedule>(
            gpipe_backward(stages, microbatches, recompute, std::move(stage_workers)));
      },
      py::arg("stages"), py::arg("microbatches"), py::arg("recompute"),
      py::arg("stage_workers") = std::vector<int>{},
      "GPipe fill-drain backward, last micro-batch first, flagged micro-batches recomputed ahead.");

  m.def(
      "rank_schedule",
      [](const std::string& kind, int stages, int workers, int microbatches,
         const std::string& checkpoint, std::vector<int> worker_ranks, bool reduce_grad, int rank) {
        return std::make_shared<Schedule>(rank_schedule(
            make_program(kind, stages, workers, microbatches, parse_checkpoint(checkpoint)), stages,
            microbatches, round_robin(stages, workers), std::move(worker_ranks), reduce_grad, rank));
      },
      py::arg("kind"), py::arg("stages"), py::arg("workers"), py::arg("microbatches"),
      py::arg("checkpoint"), py::arg("worker_ranks"), py::arg("reduce_grad"), py::arg("rank"),
      "Rank `rank`'s schedule of a kind lowered onto ranks (compute worker w on "
      "worker_ranks[w]): its compute workers, then its communication worker (sends, receives, "
      "gradient reductions). Dry-run first across every rank.");
  m.def(
      "rank_forward_schedule",
      [](const std::string& kind, int stages, int workers, int microbatches, bool loss,
         std::vector<int> worker_ranks, int rank) {
        return std::make_shared<Schedule>(rank_schedule(
            forward_only_program(kind, stages, workers, microbatches, loss), stages, microbatches,
            round_robin(stages, workers), std::move(worker_ranks), false, rank));
      },
      py::arg("kind"), py::arg("stages"), py::arg("workers"), py::arg("microbatches"),
      py::arg("loss"), py::arg("worker_ranks"), py::arg("rank"),
      "Rank `rank`'s forward-only schedule (see forward_program) lowered onto ranks like "
      "rank_schedule: sends after the forwards, receives on the communication workers, no "
      "gradient and no reduction. Dry-run first across every rank.");
  m.def(
      "lowered_program",
      [](const std::string& kind, int stages, int workers, int microbatches,
         const std::string& checkpoint, std::vector<int> worker_ranks, bool reduce_grad) {
        std::vector<int> stage_workers;
        for (int s = 0; s < stages; ++s) stage_workers.push_back(s % std::max(workers, 1));
        const Lowered lowered =
            lower(make_program(kind, stages, workers, microbatches, parse_checkpoint(checkpoint)),
                  stages, microbatches, stage_workers, std::move(worker_ranks), reduce_grad);
        return py::make_tuple(to_python(lowered.program), lowered.worker_rank);
      },
      py::arg("kind"), py::arg("stages"), py::arg("workers"), py::arg("microbatches"),
      py::arg("checkpoint"), py::arg("worker_ranks"), py::arg("reduce_grad"),
      "Every worker's lowered program and rank: compute workers, then one communication "
      "worker per rank.");
  m.def(
      "dry_run",
      [](const Schedule& schedule) {
        std::vector<std::tuple<int, int, int>> out;
        for (const Stuck& s : dry_run(schedule)) out.emplace_back(s.worker, s.task, s.waits_for);
        return out;
      },
      py::arg("schedule"),
      "Run without costs: (worker, task, awaited task) of each stuck worker; empty = no deadlock.");

  py::class_<SimulatedTimeline>(m, "SimulatedTimeline", "Predicted start/end of every task.")
      .def_readonly("start", &SimulatedTimeline::start)
      .def_readonly("end", &SimulatedTimeline::end)
      .def_readonly("makespan", &SimulatedTimeline::makespan)
      .def_readonly("bubble", &SimulatedTimeline::bubble, "Idle share of worker-time.");
  m.def("simulate", &simulate, py::arg("schedule"), py::arg("cost"),
        "Predict the timeline of a schedule given each task's cost.");
}

}  // namespace gpipe_fast::bindings
