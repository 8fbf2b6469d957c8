"""What a pipe reports about how it runs: its threads, its transport, timelines, memory."""

from __future__ import annotations

from torch import nn

from gpipe_fast.device.host import Threads
from gpipe_fast.runtime.memory import CellMemoryStats, memory_stats
from gpipe_fast.runtime.pipeline import Pipeline
from gpipe_fast.runtime.timeline import Timeline
from gpipe_fast.transport.choice import TransportChoice


class PipeReports(nn.Module):
    """GPipe's reports: why its CPU cells run so many threads, how its tensors travel
    between processes, the timeline of a recorded step and the memory each cell holds."""

    _pipeline: Pipeline | None  # the runtime (None for an empty pipe), set by the pipe
    _threads: Threads
    schedule: str

    @property
    def threads_reason(self) -> str:
        """Why ``threads_per_cell`` is what it is: your setting (``threads_per_cell=``,
        OMP_NUM_THREADS, ``torch.set_num_threads``), which is never overridden, or the
        host's cores shared among the CPU cells (one process) or among the job's processes
        on this host (each rank tells the others its host name when the pipe is built)."""
        return self._threads.reason

    @property
    def transport_kind(self) -> str:
        """How tensors travel between this pipe's processes: "shared memory" between ranks
        of one host whose cells run on the CPU, else the process group's backend ("gloo",
        "nccl"; "shared memory and gloo" when some ranks share a host and others do not),
        or "in process" for a pipe of one process. GPIPE_FAST_TRANSPORT=gloo (on any rank)
        keeps CPU tensors on gloo. :attr:`transport_reason` says why."""
        return self._transport().media

    @property
    def transport_reason(self) -> str:
        """Why :attr:`transport_kind` is what it is."""
        return self._transport().reason

    def _transport(self) -> TransportChoice:
        if self._pipeline is None:
            return TransportChoice("in process", "the pipe has no cells")
        return self._pipeline.transport_choice

    @property
    def threads_per_cell(self) -> int | None:
        """Intra-op threads of each CPU cell's worker (None: PyTorch's own setting)."""
        return self._threads.per_cell

    def record_timeline(self, on: bool = True) -> None:
        """Records when each task of the next steps starts and ends (off by default: then
        nothing is timed). Turning it off also forgets the recorded step.

        CPU cells are timed on the host, CUDA cells by CUDA events on their streams (see
        :class:`~gpipe_fast.TaskSpan`). While on, each phase reads its CUDA events when its
        run ends, so ``pipe(x)`` and the backward return once the GPU has finished them."""
        if self._pipeline is not None:  # an empty pipe runs no tasks to record
            self._pipeline.set_recording(bool(on))

    def timeline(self) -> Timeline:
        """The task timeline of the last step run with recording on: its forward (``pipe(x)``)
        and, once ``loss.backward()`` has run, its backward."""
        if self._pipeline is None:
            raise RuntimeError("gpipe_fast: an empty pipe has no cells, so no timeline")
        if not self._pipeline.recording:
            raise RuntimeError(
                "gpipe_fast: timeline recording is off; call pipe.record_timeline() before "
                "the step to record"
            )
        recorded = self._pipeline.recorded
        if recorded is None:
            raise RuntimeError(
                "gpipe_fast: no step has run since pipe.record_timeline(); run pipe(x) "
                "(and its backward) or pipe.train_step(...) first"
            )
        return Timeline.from_runs(
            [
                (phase, *recorded[phase])
                for phase in ("forward", "backward", "step")
                if phase in recorded
            ],
            clocks=self._pipeline.executor.worker_clocks(),
            schedule=self.schedule if "step" in recorded else "gpipe",
            call_s=self._pipeline.recorded_call_s if "step" in recorded else 0.0,
            whole_backward=self._pipeline.whole_backward_cells() if "step" in recorded else (),
        )

    def memory_stats(self) -> list[CellMemoryStats]:
        """Memory facts per cell, one dict each, in cell order:

        - ``stash_bytes``: bytes of the cell inputs stashed by the steps now alive (from
          ``pipe(x)`` until their backward has passed the cell), each storage counted once;
          on cell 0 that is the storage of the input itself when it is already on the cell's
          device (micro-batches are views of it).
        - ``recompute_peak_bytes``: with ``recompute_pool=True``, the highest bytes the
          cell's re-materialisation has held from its native pool (segments PyTorch's caching
          allocator took for that cell's MemPool); None otherwise and on CPU cells.
        - ``torch_peak_allocated_bytes``: ``torch.cuda.max_memory_allocated`` of the cell's
          device (shared by the cells on one device; reset it with
          ``torch.cuda.reset_peak_memory_stats``); None for a CPU cell.
        """
        return [] if self._pipeline is None else memory_stats(self._pipeline)
