// Bindings for actions, schedule kinds, tasks, schedules, the generators, lowering, the dry run
// and the simulator: conversions only, the logic is the core's.
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "bindings.hpp"
#include "gpipe_fast/error.hpp"
#include "gpipe_fast/generators.hpp"
#include "gpipe_fast/kinds.hpp"
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

// A need as Python writes it: ([(action, stage offset), ...], "same" | "every", required).
using PyNeed = std::tuple<std::vector<std::pair<std::string, int>>, std::string, bool>;

NeedSpec need_from_python(const PyNeed& need) {
  const auto& [any_of, microbatches, required] = need;
  GF_EXPECTS(microbatches == "same" || microbatches == "every",
             "needs: a need's micro-batches must be 'same' or 'every', got '" + microbatches + "'");
  return NeedSpec{any_of, microbatches == "every", required};
}

Program from_python(const PyProgram& program) {
  Program out;
  for (const auto& steps : program) {
    auto& order = out.emplace_back();
    for (const auto& [name, stage, microbatch] : steps) order.push_back({action_named(name), stage, microbatch});
  }
  return out;
}

// A Python callable held for native code: called and released under the GIL, from whatever
// thread makes a schedule.
std::shared_ptr<py::object> hold(py::object callable) {
  return std::shared_ptr<py::object>(new py::object(std::move(callable)), [](py::object* held) {
    py::gil_scoped_acquire gil;
    delete held;
  });
}

Generator python_generator(py::object generator) {
  return [held = hold(std::move(generator))](int stages, int workers, int microbatches) {
    py::gil_scoped_acquire gil;
    const py::object out = (*held)(stages, workers, microbatches);
    PyProgram program;
    try {
      program = out.cast<PyProgram>();
    } catch (const py::cast_error&) {
      throw InvalidArgument("its generator must return, per worker, a list of (action, stage, "
                            "micro-batch); got " + std::string(py::repr(out)));
    }
    return from_python(program);
  };
}

PlacementRule python_placement(const std::string& kind, py::object rule) {
  if (py::isinstance<py::str>(rule)) {
    const auto name = rule.cast<std::string>();
    if (name == "round_robin") return round_robin;
    if (name == "zigzag") return zigzag;
    throw InvalidArgument("schedule '" + kind + "': placement must be 'round_robin', 'zigzag' "
                          "or a callable (stage, stages, workers) -> worker, got '" + name + "'");
  }
  if (!PyCallable_Check(rule.ptr())) {
    throw InvalidArgument("schedule '" + kind + "': placement must be 'round_robin', 'zigzag' "
                          "or a callable (stage, stages, workers) -> worker, got " +
                          std::string(py::repr(rule)));
  }
  return [held = hold(std::move(rule))](int stage, int stages, int workers) {
    py::gil_scoped_acquire gil;
    return (*held)(stage, stages, workers).cast<int>();
  };
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
      "Every action's name, indexed by its id (as registered now: actions may be added).");
  py::class_<ActionInfo>(m, "Action", "An action's facts (its dependency rule stays native).")
      .def_readonly("name", &ActionInfo::name)
      .def_readonly("communication", &ActionInfo::communication,
                    "Runs on a communication worker, not its stage's compute worker.")
      .def_property_readonly(
          "cost", [](const ActionInfo& a) { return std::string(cost_class_name(a.cost)); },
          "What its task costs: none | forward | backward | backward_input | backward_weight | "
          "loss (the StageCosts field the simulator prices it by).")
      .def_property_readonly("unit_cost", [](const ActionInfo& a) { return unit_cost(a.cost); })
      .def_property_readonly(
          "sends", [](const ActionInfo& a) { return std::string(message_name(a.wire.sends)); },
          "The message a communication task sends: none | activation | skips | gradient | "
          "skip_gradients | reduced_gradients.")
      .def_property_readonly(
          "receives",
          [](const ActionInfo& a) { return std::string(message_name(a.wire.receives)); },
          "The message a communication task receives (as sends).")
      .def_property_readonly(
          "produces",
          [](const ActionInfo& a) { return std::string(message_name(a.wire.produces)); },
          "The message a compute task makes for a neighbouring stage (lowering sends it).")
      .def_property_readonly(
          "consumes",
          [](const ActionInfo& a) { return std::string(message_name(a.wire.consumes)); },
          "The message a compute task takes from a neighbouring stage (received before it).")
      .def("__repr__", [](const ActionInfo& a) { return "Action('" + a.name + "')"; });
  m.def(
      "action_facts",
      [] {
        std::vector<ActionInfo> facts;
        for (int id = 0; id < action_count(); ++id) facts.push_back(action_info(id));
        return facts;
      },
      "Every action's facts, indexed by its id.");
  m.def(
      "register_action",
      [](const std::string& name, const std::vector<PyNeed>& needs, bool communication,
         const std::string& cost) {
        std::vector<NeedSpec> specs;
        for (const PyNeed& need : needs) specs.push_back(need_from_python(need));
        return register_action(name, specs, communication, parse_cost_class(cost));
      },
      py::arg("name"), py::arg("needs"), py::arg("communication") = false,
      py::arg("cost") = "none",
      "Adds an action for good and returns its id. `needs`: its dependency rule as data, one "
      "(alternatives, micro-batches, required) per prerequisite: the first of alternatives "
      "[(action, stage offset), ...] (the new action may name itself) the schedule holds, on "
      "the task's own micro-batch "
      "('same') or one prerequisite per micro-batch ('every'); alternatives off the pipeline's "
      "ends are left out. Its tasks call Stage.<name>(micro_batch).");

  py::class_<ScheduleKind>(m, "ScheduleKind", "A schedule kind's facts (generator native).")
      .def_readonly("name", &ScheduleKind::name)
      .def_readonly("stages_per_worker", &ScheduleKind::stages_per_worker,
                    "Stages on each worker; 0: any number V (stages a multiple of workers).")
      .def_readonly("split_backward", &ScheduleKind::split_backward,
                    "Backward runs as backward_input then backward_weight.")
      .def_readonly("summary", &ScheduleKind::summary)
      .def_readonly("registered", &ScheduleKind::registered,
                    "Added at run time (register_schedule_kind), not built in.")
      .def("__repr__", [](const ScheduleKind& k) { return "ScheduleKind('" + k.name + "')"; });
  m.def("schedule_kinds", &schedule_kinds, "Every schedule kind, in the registry's order.");
  m.def("schedule_kind", &schedule_kind, py::arg("name"),
        "The kind named `name`; ValueError listing the kinds otherwise.");
  m.def(
      "register_schedule_kind",
      [](const std::string& name, py::object generator, py::object placement,
         int stages_per_worker, bool split_backward, const std::string& summary) {
        if (!PyCallable_Check(generator.ptr())) {
          throw InvalidArgument("schedule '" + name + "': generator must be a callable "
                                "(stages, workers, microbatches) -> program, got " +
                                std::string(py::repr(generator)));
        }
        ScheduleKind kind;
        kind.name = name;
        kind.generate = python_generator(std::move(generator));
        kind.placement = python_placement(name, std::move(placement));
        kind.stages_per_worker = stages_per_worker;
        kind.split_backward = split_backward;
        kind.summary = summary;
        register_schedule_kind(std::move(kind));
      },
      py::arg("name"), py::arg("generator"), py::arg("placement") = "round_robin",
      py::arg("stages_per_worker") = 1, py::arg("split_backward") = false,
      py::arg("summary") = "",
      "Adds a schedule kind whose generator(stages, workers, microbatches) returns each "
      "worker's list of (action, stage, micro-batch); its programs are validated as they are "
      "made (ValueError naming the kind).");
  m.def("unregister_schedule_kind", &unregister_schedule_kind, py::arg("name"),
        "Removes a kind added by register_schedule_kind (ValueError for a built-in one).");
  m.def("placement", &placement, py::arg("kind"), py::arg("stages"), py::arg("workers"),
        "The worker of each stage under `kind`; ValueError when it cannot run them there.");
  m.def("ideal_bubble", &ideal_bubble, py::arg("kind"), py::arg("stages"), py::arg("workers"),
        py::arg("microbatches"),
        "The kind's training-step bubble simulated with equal stages and no overheads.");

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
      "The validated training-step schedule of a kind (schedule_kinds()), stages placed by it.");
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
         const std::string& checkpoint, std::vector<int> worker_ranks, bool reduce_grad, int rank,
         const SkipPairs& skips, const std::vector<int>& inline_receives) {
        return std::make_shared<Schedule>(rank_schedule(kind, stages, workers, microbatches,
                                                        parse_checkpoint(checkpoint),
                                                        std::move(worker_ranks), reduce_grad, rank,
                                                        skips, inline_receives));
      },
      py::arg("kind"), py::arg("stages"), py::arg("workers"), py::arg("microbatches"),
      py::arg("checkpoint"), py::arg("worker_ranks"), py::arg("reduce_grad"), py::arg("rank"),
      py::arg("skips") = SkipPairs{}, py::arg("inline_receives") = std::vector<int>{},
      "Rank `rank`'s schedule of a kind lowered onto ranks (compute worker w on "
      "worker_ranks[w]): its compute workers, then its communication workers (sends, receives, "
      "gradient reductions), and the sends and receives of `skips` ((stash stage, pop stage) "
      "pairs of skip connections) between ranks; the ranks in `inline_receives` receive on "
      "their compute workers, right before the task that needs each message. Dry-run first "
      "across every rank.");
  m.def(
      "rank_forward_schedule",
      [](const std::string& kind, int stages, int workers, int microbatches, bool loss,
         std::vector<int> worker_ranks, int rank, const SkipPairs& skips,
         const std::vector<int>& inline_receives) {
        return std::make_shared<Schedule>(rank_forward_schedule(kind, stages, workers,
                                                                microbatches, loss,
                                                                std::move(worker_ranks), rank,
                                                                skips, inline_receives));
      },
      py::arg("kind"), py::arg("stages"), py::arg("workers"), py::arg("microbatches"),
      py::arg("loss"), py::arg("worker_ranks"), py::arg("rank"), py::arg("skips") = SkipPairs{},
      py::arg("inline_receives") = std::vector<int>{},
      "Rank `rank`'s forward-only schedule (see forward_program) lowered onto ranks like "
      "rank_schedule: sends after the forwards, receives on the communication workers (or "
      "inline), no "
      "gradient and no reduction. Dry-run first across every rank.");
  m.def(
      "lowered_program",
      [](const std::string& kind, int stages, int workers, int microbatches,
         const std::string& checkpoint, std::vector<int> worker_ranks, bool reduce_grad,
         const SkipPairs& skips, const std::vector<int>& inline_receives) {
        const Lowered lowered = lower_schedule(kind, stages, workers, microbatches,
                                               parse_checkpoint(checkpoint),
                                               std::move(worker_ranks), reduce_grad, skips,
                                               inline_receives);
        return py::make_tuple(to_python(lowered.program), lowered.worker_rank);
      },
      py::arg("kind"), py::arg("stages"), py::arg("workers"), py::arg("microbatches"),
      py::arg("checkpoint"), py::arg("worker_ranks"), py::arg("reduce_grad"),
      py::arg("skips") = SkipPairs{}, py::arg("inline_receives") = std::vector<int>{},
      "Every worker's lowered program and rank: compute workers, then two communication "
      "workers per rank (empty of receives for the ranks in `inline_receives`).");
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
  m.def("unit_costs", &equal_stage_costs, py::arg("schedule"),
        "Each task's cost with equal stages: its action's unit cost.");
  m.def(
      "recomputed", [](const Schedule& schedule) { return recomputed(schedule); },
      py::arg("schedule"), "Which (stage, micro-batch) the schedule recomputes: flags[stage][m].");
}

}  // namespace gpipe_fast::bindings
