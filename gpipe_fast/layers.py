"""The package's layers, lowest first: a module imports only from its own layer or a lower one.

tests/test_layers.py checks every import against this list (and that no modules import each
other in a cycle), and that docs/architecture.md's table of layers says what it says."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layer:
    """Modules (dotted names under gpipe_fast: a package takes its modules with it; a module
    belongs to the layer of its longest matching name) and what they hold, in words."""

    modules: tuple[str, ...]
    holds: str


LAYERS: tuple[Layer, ...] = (
    Layer(
        ("_C", "arguments", "errors", "layers"),
        "the native core; argument checks shared by every layer; the errors a step raises "
        "wherever it runs; this list",
    ),
    Layer(
        ("nn", "device", "skip"),
        "what a pipe does to layers (micro-batches, checkpointing, BatchNorm, randomness, "
        "buffers a forward writes, compiled layers, ties, meta-device builds); streams, copies, "
        "recompute pools, host cores; skippable layers, their trackers and the skip layout",
    ),
    Layer(
        ("capture",),
        "any model cut into stages, untraced: its forward's module calls found, planned and "
        "split, every value that crosses stages keyed by what makes it and checked as it is put",
    ),
    Layer(
        ("schedule",),
        "the registry of schedule kinds and actions (read from `_C`), each pipe's schedule cache",
    ),
    Layer(
        ("pictures",),
        "pictures of a step's timeline: what they show, drawn as PNG or SVG, or written as a "
        "Chrome trace",
    ),
    Layer(
        ("transport",),
        "the transports, in one home: the `Transport` protocol, the in-process transport, the "
        "wire format and the media's choice (the transport across processes, "
        "`transport/processes/`, sits with `distributed/`, whose guard and layout it uses)",
    ),
    Layer(
        ("distributed", "transport.processes"),
        "process layouts, the ranks' agreement at build, the guard of every wait, process "
        "groups, gradient reductions, sharded stages and their guarded collectives, the "
        "cross-process side of the step path; the transport across processes and its media",
    ),
    Layer(
        ("runtime",),
        "each stage's lasting cell, the pipeline (composition root), the step path and its "
        "one-process side, `pipe(x)` through autograd, the runner (phase drivers), a step's "
        "state and dispatch, the `Stage`, the autograd bridge, timelines, "
        "memory",
    ),
    Layer(
        ("balancing",),
        "layers profiled and partitioned: the partitioner behind `balance=None`",
    ),
    Layer(
        ("api",),
        "`GPipe`, a facade over its builder (layout, cells, meta tensors, ties, threads) and "
        "its naming (the model's keys), `gf.pipeline`, clipping, the loss scaler, state-dict "
        'hooks, device defaults, live pipes, what "auto" tunes and the pipes it rebuilds',
    ),
    Layer(
        ("planning",),
        "`gf.plan`: plans, predictions and calibration; the runtime's cost per task, measured "
        'through a pipe; the tuning of "auto" pipes: candidates priced, measured, agreed',
    ),
    Layer(
        ("integrations",),
        "frameworks that drive a pipe, imported only by who uses them: transformers' Trainer "
        "(`PipelineTrainer`), pretrained directories read and written by each rank",
    ),
    Layer(
        ("__init__", "balance"),
        "the package's own names (`gf.*`); torchgpipe's import path of the balancing helpers",
    ),
    Layer(("demo",), "`python -m gpipe_fast demo`"),
    Layer(("__main__",), "the command line"),
)
