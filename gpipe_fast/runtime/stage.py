"""One stage of one step: its buffers and a method per action (forward, loss, backward, ...)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack, nullcontext
from typing import Any

import torch
from torch import Tensor

from gpipe_fast.nn.buffer_writes import Snapshot
from gpipe_fast.nn.pytree import Tree, tensors_of, with_tensors
from gpipe_fast.nn.randomness import LOSS, TaskStream, task_seed
from gpipe_fast.runtime.backward_calls import (
    aligned,
    grad_of,
    run_backward,
    run_grad,
    whole_backward,
    with_graph,
)
from gpipe_fast.runtime.cell import Boundary, Cell
from gpipe_fast.runtime.context import StepContext
from gpipe_fast.runtime.micro_loss import scalar_loss, weighted
from gpipe_fast.skip.cell_tracker import CellSkipTracker
from gpipe_fast.skip.tracker import SkipKey
from gpipe_fast.transport.protocol import ACTIVATION, GRADIENT, Flow


class Stage:
    """Stage `cell.index` of one step (whose shared state, and the pipe's services, come in
    `context`). The executor calls one
    method per task, named as the task's action; each reads what it needs from the step's
    transport or its own buffers and leaves what the next action needs there."""

    def __init__(self, cell: Cell, context: StepContext, last: bool) -> None:
        self.cell = cell
        self.context = context
        self.index = cell.index
        self.last = last
        count = context.count
        self.inputs: list[Tree] = [None] * count  # stashed for recompute and backward
        self.outputs: list[Tree] = [None] * count  # with their graphs, until backward
        self.boundaries: list[list[Boundary] | None] = [None] * count  # split backward only
        # Per checkpointed micro-batch, the buffers its forward wrote, as they were before it.
        self.snapshots: list[Snapshot | None] = [None] * count
        # Split backward: per micro-batch, the (outputs, gradients) of each learning layer,
        # left by backward_input for backward_weight.
        self.weight_roots: list[list[tuple[list[Tensor], list[Tensor]]] | None] = [None] * count
        # Set while receiving, so that an error there is named as the boundary copy.
        self.copying = False
        # Skip connections from (sends) and into (receives) this stage: (key, the other
        # stage); per micro-batch the leaves received (skips_in, until backward) and the
        # stashed tensors with their graph (skips_out, until backward; whole-stage backward
        # only, the split one keeps them in its boundaries).
        skips = context.services.skips
        self.skips = skips
        self.has_skips = skips is not None and any(
            self.index in (route.stash_cell, route.pop_cell) for route in skips.routes
        )
        self.sends: list[tuple[SkipKey, int]] = []
        self.receives: list[tuple[SkipKey, int]] = []
        if skips is not None:
            for route in skips.crossing():
                if route.stash_cell == self.index:
                    self.sends.append((route.key, route.pop_cell))
                elif route.pop_cell == self.index:
                    self.receives.append((route.key, route.stash_cell))
        self.skips_in: list[dict[SkipKey, Tensor | None] | None] = [None] * count
        self.skips_out: list[dict[SkipKey, Tensor | None] | None] = [None] * count
        sharding = context.services.sharding
        self.sharded = sharding.cells.get(self.index) if sharding is not None else None

    def release(self) -> None:
        """Drops every micro-batch's stashed values (after a failed step). They hold their
        graphs, whose nodes hold the step: a cycle through autograd's C++ nodes that Python's
        collector cannot see, so a failed step's activations would otherwise stay allocated
        for good (an out-of-memory error in recompute kept the whole batch's)."""
        count = self.context.count
        self.inputs = [None] * count
        self.outputs = [None] * count
        self.boundaries = [None] * count
        self.snapshots = [None] * count
        self.weight_roots = [None] * count
        self.skips_in = [None] * count
        self.skips_out = [None] * count
        if self.sharded is not None:
            self.sharded.reset()

    def sharded_task(self, name: str, method: Callable[[int], None]) -> Callable[[int], None]:
        """`method` (the action `name`) run as one task of the sharded cell: alone, recorded
        for the replicas' comparison; a weight half on gathered units; the micro-batch's
        last backward task followed by what the sharding policy reduces then."""
        sharded = self.sharded
        assert sharded is not None
        last_backward = "backward_weight" if self.context.split else "backward"
        count = self.context.count

        def run(m: int) -> None:
            with sharded.task(name, m):
                if name == "backward_weight":
                    sharded.gather()
                method(m)
                if name == last_backward:
                    sharded.backward_done(count)

        return run

    # -- actions ---------------------------------------------------------------------------

    def forward(self, m: int) -> None:
        context, k = self.context, self.index
        self.copying = True
        received = context.transport.recv(ACTIVATION, k, m)
        self.copying = False
        # Any pytree: its tensors (fresh leaves, detached by the transport) are what may need
        # a gradient; its other leaves are values, passed on as they are.
        value = received
        tensors = tensors_of(received)
        for tensor, needs in zip(tensors, context.input_grad_flags(k, tensors), strict=True):
            tensor.requires_grad_(needs)
        checkpointing = context.track and context.checkpointed[k][m]
        keep_graph = context.track and not checkpointing
        boundaries: list[Boundary] | None = [] if context.split and keep_graph else None
        tracker = self._receive_skips(m, cut=boundaries is not None) if self.has_skips else None
        output = self._run(
            value,
            m,
            grad=keep_graph,
            checkpointing=checkpointing,
            boundaries=boundaries,
            skips=tracker,
        )
        if tracker is not None:
            self._send_skips(m, tracker, keep=keep_graph and boundaries is None)
        if context.track:
            self.inputs[m] = value
        if boundaries is not None:
            self.boundaries[m] = boundaries
        if self.last or (keep_graph and boundaries is None):
            self.outputs[m] = output
        if not self.last:
            context.transport.send(ACTIVATION, k, m, output)

    def recompute(self, m: int) -> None:
        boundaries: list[Boundary] | None = [] if self.context.split else None
        memory = self.context.services.recompute_memory
        tracker = None
        if self.has_skips:  # the skips received in forward, popped again
            tracker = CellSkipTracker(
                self.skips,  # type: ignore[arg-type]
                self.index,
                self.skips_in[m],
                cut=boundaries is not None,
            )
        with nullcontext() if memory is None else memory.use(self.index):
            output = self._run(
                self.inputs[m],
                m,
                grad=True,
                recomputing=True,
                boundaries=boundaries,
                skips=tracker,
            )
        if tracker is not None and boundaries is None and self.sends:
            # The stashes re-made with their graph: backward starts from them, not from
            # forward's (computed without one); they are not sent again.
            self.skips_out[m] = tracker.outgoing
        if boundaries is not None:
            self.boundaries[m] = boundaries
        else:
            self.outputs[m] = output

    def loss(self, m: int) -> None:
        """The micro-batch's loss, weighted by its share of the batch, and its gradient with
        respect to the stage's output, handed to this stage's backward. In a step that
        records no graph (an evaluation), the loss alone."""
        if not self.context.track:
            self._loss_value(m)
            return
        context = self.context
        output = self.outputs[m]
        assert output is not None and context.loss_fn is not None, "loss runs after a forward"
        leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in tensors_of(output)]
        if not self.context.track or self.context.checkpointed[self.index][m]:
            self.outputs[m] = None  # no graph: the recompute rebuilds it
        target = context.target(self.index, m)
        with ExitStack() as stack:
            self._enter_loss_context(stack, m)
            if not torch.is_grad_enabled():
                stack.enter_context(torch.enable_grad())
            value = scalar_loss(context.loss_fn(with_tensors(output, leaves), target))
            # The weight enters as the loss's incoming gradient: no extra op in the graph.
            weight = context.loss_weights[m]
            wanted = [t for t in leaves if t.requires_grad]
            grads: tuple[Any, ...] = (None,) * len(leaves)
            if value.requires_grad and wanted and weight == 0.0:
                # A micro-batch that weighs nothing (no counted item: its mean is 0/0, whose
                # backward would be NaN): zero gradients, without running the loss's backward.
                grads = tuple(torch.zeros_like(t) if t.requires_grad else None for t in leaves)
            elif value.requires_grad and wanted:
                seed = torch.full_like(value, weight)
                # A grad_scaler's scale: the loss returned stays unscaled.
                if context.loss_scale is not None:
                    seed = seed * context.loss_scale.to(seed.device, non_blocking=True)
                grads = aligned(leaves, wanted, run_grad((value,), (seed,), wanted, False))
        context.losses[m] = weighted(value.detach(), weight)
        context.transport.deliver(GRADIENT, self.index, m, grads)

    def _loss_value(self, m: int) -> None:
        """The micro-batch's weighted loss under no_grad: no graph, no gradient for anyone."""
        context = self.context
        output = self.outputs[m]
        assert output is not None and context.loss_fn is not None, "loss runs after a forward"
        self.outputs[m] = None
        target = context.target(self.index, m)
        with ExitStack() as stack:
            self._enter_loss_context(stack, m)
            stack.enter_context(torch.no_grad())
            value = scalar_loss(context.loss_fn(output, target))
        context.losses[m] = weighted(value, context.loss_weights[m])

    def _enter_loss_context(self, stack: ExitStack, m: int) -> None:
        """What loss_fn runs under: the stage's stream, the caller's autocast and, in a step
        whose cells may draw random numbers, a random stream of its own (the generators
        are then the tasks', one at a time)."""
        if self.cell.stream is not None:
            stack.enter_context(self.cell.streams.on(self.index))
        if self.context.autocast.enabled:
            self.context.autocast.enter(stack)
        if self.context.random:
            seed = task_seed(self.context.seed, self.index, m, LOSS)
            stack.enter_context(TaskStream(seed, self.cell.device))

    def backward(self, m: int) -> None:
        grads = self._receive_gradient(m)
        outputs = tensors_of(self.outputs[m])
        roots, root_grads = [], []
        for output, grad in zip(outputs, grads, strict=True):
            if output.requires_grad and grad is not None:
                roots.append(output)
                root_grads.append(grad)
        if self.sends:  # the stashed skips' gradients, from the stages that popped them
            stashed = self.skips_out[m] or {}
            for key, _ in self.sends:
                grad = self._recv_skip(GRADIENT, m, key)
                tensor = stashed.get(key)
                if grad is not None and isinstance(tensor, Tensor) and tensor.requires_grad:
                    roots.append(tensor)
                    root_grads.append(grad)
        if roots:
            stream = self.cell.backward_stream(self.context.seed, m, "backward")
            if stream is None and self.cell.stream is None and torch.is_grad_enabled():
                run_backward(roots, root_grads)  # the common CPU case: no context to enter
            else:
                with self.cell.streams.on(self.index), torch.enable_grad():
                    with stream if stream is not None else nullcontext():
                        run_backward(roots, root_grads)
                self.cell.backward_seen(stream, "backward", ran=True)
        inputs = tensors_of(self.inputs[m])
        if self.receives:
            received = self.skips_in[m] or {}
            self._send_skip_grads(m, {key: grad_of(received.get(key)) for key, _ in self.receives})
        self._pass_back(m, tuple(t.grad if t.requires_grad else None for t in inputs))

    def backward_input(self, m: int) -> None:
        """The gradient of the stage's input only, layer by layer; each learning layer's
        output gradient is kept for backward_weight. A compiled layer's backward is one
        compiled function, which computes the gradients of its inputs and weights together:
        its weights' gradients are accumulated here, in the same call (backward_weight would
        run that whole backward again)."""
        grads: tuple[Any, ...] = self._receive_gradient(m)
        boundaries = self.boundaries[m]
        assert boundaries is not None, "backward_input needs the split forward's boundaries"
        self.boundaries[m] = None
        learning = self._layer_parameters()
        whole = self.cell.whole_backward if self.sharded is None else None
        weight_roots = []
        # Skip gradients by key: those of this stage's stashes (from the stages that popped
        # them), then those of pops inside the stage, found layer by layer going back.
        skip_grads: dict[SkipKey, Any] = {
            key: self._recv_skip(GRADIENT, m, key) for key, _ in self.sends
        }
        stream = self.cell.backward_stream(self.context.seed, m, "backward_input")
        ran = False
        with ExitStack() as stack:
            stack.enter_context(self.cell.streams.on(self.index))
            stack.enter_context(torch.enable_grad())
            if stream is not None:
                stack.enter_context(stream)
            for i in reversed(range(len(boundaries))):
                inputs, outputs, popped, stashed = boundaries[i]
                if stashed:
                    grads = (*grads, *(skip_grads.pop(key, None) for key in stashed))
                pairs = [
                    (o, g)
                    for o, g in zip(outputs, grads, strict=True)
                    if g is not None and o.requires_grad
                ]
                roots, root_grads = [o for o, _ in pairs], [g for _, g in pairs]
                wanted = [t for t in inputs if t.requires_grad]
                ran = ran or bool(roots and (wanted or learning[i]))
                if whole is not None and whole[i] and learning[i]:
                    grads = whole_backward(roots, root_grads, inputs, wanted, learning[i])
                else:
                    if roots and learning[i]:
                        graphed = with_graph(roots, root_grads)
                        if graphed[0]:
                            weight_roots.append(graphed)
                    if roots and wanted:
                        got = run_grad(roots, root_grads, wanted, bool(learning[i]))
                        grads = aligned(inputs, wanted, got)
                    else:
                        grads = (None,) * len(inputs)
                if popped:
                    first = len(inputs) - len(popped)
                    skip_grads.update(zip(popped, grads[first:], strict=True))
                    grads = grads[:first]
        self.cell.backward_seen(stream, "backward_input", ran=ran)
        self.weight_roots[m] = weight_roots
        if self.receives:
            self._send_skip_grads(m, {key: skip_grads.get(key) for key, _ in self.receives})
        self._pass_back(m, grads)

    def backward_weight(self, m: int) -> None:
        """The weights' gradients of the micro-batch, from what backward_input kept."""
        pending = self.weight_roots[m]
        self.weight_roots[m] = None
        if not pending:
            return
        roots = [root for roots, _ in pending for root in roots]
        grads = [grad for _, grads in pending for grad in grads]
        params = {id(p): p for layer in self._layer_parameters() for p in layer}
        stream = self.cell.backward_stream(self.context.seed, m, "backward_weight")
        with self.cell.streams.on(self.index), torch.enable_grad():
            with stream if stream is not None else nullcontext():
                torch.autograd.backward(roots, grads, inputs=list(params.values()))
        self.cell.backward_seen(stream, "backward_weight", ran=True)

    # -- communication: run on the process's communication worker --------------------------

    def send_forward(self, m: int) -> None:
        self.context.transport.post(ACTIVATION, self.index, m)

    def recv_forward(self, m: int) -> None:
        self.context.transport.fetch(ACTIVATION, self.index, m)

    def send_backward(self, m: int) -> None:
        self.context.transport.post(GRADIENT, self.index, m)

    def recv_backward(self, m: int) -> None:
        self.context.transport.fetch(GRADIENT, self.index, m)

    def send_skips(self, m: int) -> None:
        self.context.transport.post_skips(ACTIVATION, self.index, m)

    def recv_skips(self, m: int) -> None:
        self.context.transport.fetch_skips(ACTIVATION, self.index, m)

    def send_skip_grads(self, m: int) -> None:
        self.context.transport.post_skips(GRADIENT, self.index, m)

    def recv_skip_grads(self, m: int) -> None:
        self.context.transport.fetch_skips(GRADIENT, self.index, m)

    def reduce_grad(self, m: int) -> None:
        """The stage's gradients summed over the data-parallel replicas (after its last
        backward; `m` is 0)."""
        reduce = self.context.services.reduce_gradients
        assert reduce is not None, "reduce_grad runs only in a pipe with dp_group"
        reduce(self.index)

    # -- helpers ---------------------------------------------------------------------------

    def _layer_parameters(self) -> list[list[Tensor]]:
        """Per layer, its learning parameters as its graph holds them."""
        if self.sharded is not None:
            return self.sharded.layer_parameters()
        return self.cell.layer_parameters()

    def _run(self, value: Tree, m: int, **kwargs: Any) -> Tree:
        context = self.context
        return self.cell.run(
            value,
            seed=context.seed,
            microbatch=m,
            autocast=context.autocast,
            snapshots=self.snapshots,
            **kwargs,
        )

    def _receive_gradient(self, m: int) -> tuple[Any, ...]:
        self.copying = True
        grads = self.context.transport.recv(GRADIENT, self.index, m)
        self.copying = False
        return tuple(grads) if isinstance(grads, tuple) else (grads,)

    def _receive_skips(self, m: int, *, cut: bool) -> CellSkipTracker:
        """The tracker of micro-batch m's forward, holding the skips sent from earlier
        stages as leaves (which require a gradient when the stashing stage computes one)."""
        context = self.context
        received: dict[SkipKey, Tensor | None] = {}
        for key, source in self.receives:
            tensor = self._recv_skip(ACTIVATION, m, key)
            if tensor is not None:
                needs = context.computes_grad[source] and tensor.is_floating_point()
                tensor.requires_grad_(needs)
            received[key] = tensor
        if context.track and self.receives:
            self.skips_in[m] = received  # for recompute and backward
        return CellSkipTracker(self.skips, self.index, received, cut=cut)  # type: ignore[arg-type]

    def _send_skips(self, m: int, tracker: CellSkipTracker, *, keep: bool) -> None:
        """Sends what the forward stashed for later stages straight to them; `keep`: with
        its graph, for this stage's backward."""
        transport = self.context.transport
        for key, receiver in self.sends:
            transport.send_skip(ACTIVATION, self.index, receiver, m, key, tracker.outgoing.get(key))
        if keep and self.sends:
            self.skips_out[m] = tracker.outgoing

    def _recv_skip(self, flow: Flow, m: int, key: SkipKey) -> Tensor | None:
        self.copying = True
        tensor = self.context.transport.recv_skip(flow, self.index, m, key)
        self.copying = False
        return tensor

    def _send_skip_grads(self, m: int, grads: dict[SkipKey, Any]) -> None:
        """The gradients of the skips this stage popped, to the stages that stashed them
        (None where there is none); the received leaves go."""
        transport = self.context.transport
        for key, source in self.receives:
            transport.send_skip(GRADIENT, self.index, source, m, key, grads.get(key))
        self.skips_in[m] = None

    def _pass_back(self, m: int, grads: tuple[Any, ...]) -> None:
        """Hands the input's gradient to the stage before, or to the step (stage 0); the
        micro-batch's buffers go."""
        if self.index > 0:
            self.context.transport.send(GRADIENT, self.index, m, grads)
        else:
            self.context.input_grads[m] = grads
        self.inputs[m] = self.outputs[m] = None
        self.skips_in[m] = self.skips_out[m] = None
