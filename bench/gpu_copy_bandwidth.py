"""Boundary copy bandwidth on a GPU: gpipe_fast's native copier against cupy and torch, same
stream, interleaved; every copy checked byte for byte first."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import gpu_harness as harness
import torch
from reporting import MIB, fmt, fmt_size, markdown_table, median, ratio

from gpipe_fast import _C

NAME = "copy_bandwidth"
COPIERS = ("gpipe_fast", "cupy", "torch")


@dataclass(frozen=True)
class Config:
    sizes: tuple[int, ...]  # bytes
    reps: int
    bytes_per_sample: int  # small copies are timed in batches of about this many bytes
    max_batch: int
    time_box_s: float


SCALES = {
    "full": Config(
        sizes=tuple(MIB * 4**i for i in range(6)),  # 1 MiB .. 1 GiB
        reps=10,
        bytes_per_sample=64 * MIB,
        max_batch=64,
        time_box_s=45,
    ),
    "quick": Config(
        sizes=(MIB, 16 * MIB, 256 * MIB),
        reps=5,
        bytes_per_sample=64 * MIB,
        max_batch=64,
        time_box_s=20,
    ),
    # CPU only, for tests: torch's copy at toy sizes, timed on the host.
    "smoke": Config(sizes=(4096, 65536), reps=2, bytes_per_sample=65536, max_batch=4, time_box_s=5),
}


def cupy_available() -> bool:
    try:
        import cupy  # noqa: F401
    except Exception:
        return False
    return True


def _cupy_stream(stream: torch.cuda.Stream) -> Any:
    import cupy

    try:
        return cupy.cuda.ExternalStream(stream.cuda_stream, stream.device.index)
    except TypeError:  # cupy < 10 takes the handle alone
        return cupy.cuda.ExternalStream(stream.cuda_stream)


def enable_peer_access(copier: Any, a: int, b: int) -> dict[str, bool]:
    """Lets each of devices a and b reach the other's memory through the native copier."""
    return {
        f"{a}->{b}": bool(copier.enable_peer_access(a, b)),
        f"{b}->{a}": bool(copier.enable_peer_access(b, a)),
    }


def make_copy_launcher(
    name: str,
    dst: torch.Tensor,
    src: torch.Tensor,
    stream: torch.cuda.Stream | None,
    copier: Any = None,
) -> Callable[[], None]:
    """A call that enqueues one copy of `src` into `dst` on `stream` (its device: dst's), with
    gpipe_fast's native copier, cupy's runtime API on the same stream, or torch's copy_."""
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("copies need contiguous tensors")
    nbytes = src.numel() * src.element_size()
    if dst.numel() * dst.element_size() != nbytes:
        raise ValueError("src and dst differ in size")
    dst_ptr, src_ptr = dst.data_ptr(), src.data_ptr()
    if name == "torch":

        def torch_copy() -> None:
            if stream is None:
                dst.copy_(src)
                return
            with torch.cuda.stream(stream):  # on another device torch copies on src's stream
                dst.copy_(src, non_blocking=True)

        return torch_copy
    if stream is None:
        raise ValueError(f"the {name} copier needs a CUDA stream")
    dst_index, src_index = dst.device.index, src.device.index
    if name == "gpipe_fast":
        copier = copier if copier is not None else _C.BoundaryCopier()
        # Consumer and copy stream are one stream here: the copy's own bandwidth is measured.
        native_stream = _C.Stream(stream.device.index, stream.cuda_stream)

        def native_copy() -> None:
            copier.copy(
                dst_ptr, dst_index, src_ptr, src_index, nbytes, native_stream, native_stream
            )

        return native_copy
    if name == "cupy":
        import cupy

        handle = _cupy_stream(stream).ptr
        runtime = cupy.cuda.runtime
        if dst_index == src_index:
            kind = runtime.memcpyDeviceToDevice
            return lambda: runtime.memcpyAsync(dst_ptr, src_ptr, nbytes, kind, handle)
        return lambda: runtime.memcpyPeerAsync(
            dst_ptr, dst_index, src_ptr, src_index, nbytes, handle
        )
    raise ValueError(f"unknown copier {name!r}")


def copy_batch(nbytes: int, bytes_per_sample: int, max_batch: int) -> int:
    """How many copies one timed sample enqueues back to back: small copies take less time
    than the events' resolution, so they are timed in batches."""
    return max(1, min(max_batch, bytes_per_sample // max(nbytes, 1)))


def gigabytes_per_second(nbytes: int, copies: int, seconds: float) -> float:
    return ratio(nbytes * copies / 1e9, seconds)


def _sleep_cycles_per_second(device: torch.device) -> float:
    """GPU clock ticks per second as torch.cuda._sleep counts them, timed with events."""
    stream = torch.cuda.current_stream(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 20_000_000
    torch.cuda._sleep(1000)  # warm the kernel up
    start.record(stream)
    torch.cuda._sleep(cycles)
    end.record(stream)
    end.synchronize()
    return cycles / (start.elapsed_time(end) / 1e3)


def time_copies(
    launchers: Mapping[str, Callable[[], None]],
    batch: int,
    reps: int,
    stream: torch.cuda.Stream | None,
    cycles_per_s: float,
) -> dict[str, list[dict[str, float]]]:
    """`reps` samples per contender, interleaved, each of `batch` copies back to back:
    {"gpu_s": event-timed, "host_s": time to enqueue them, "head_start_s": how long the GPU
    was held back while the host enqueued}. Before each sample the stream sleeps on the GPU
    so the host enqueues the whole batch first: the events then time the copies alone, not
    the host's launch gaps (head_start_s < host_s flags a sample where they may show)."""
    names = list(launchers)
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    # 1 ms plus 50 us per launch: several times what a launch costs the host.
    head_start_s = 1e-3 + 50e-6 * batch
    for rep in range(reps):
        pending = []
        for name in harness.rotated(names, rep):
            launch = launchers[name]
            if stream is None:  # CPU smoke: host timing only
                start_s = time.perf_counter()
                for _ in range(batch):
                    launch()
                host_s = time.perf_counter() - start_s
                samples[name].append({"gpu_s": host_s, "host_s": host_s, "head_start_s": 0.0})
                continue
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                torch.cuda._sleep(int(head_start_s * cycles_per_s))
            start.record(stream)
            start_s = time.perf_counter()
            for _ in range(batch):
                launch()
            host_s = time.perf_counter() - start_s
            end.record(stream)
            pending.append((name, start, end, host_s))
        if stream is not None:
            stream.synchronize()  # one round at a time keeps the queue short
            for name, start, end, host_s in pending:
                samples[name].append(
                    {
                        "gpu_s": start.elapsed_time(end) / 1e3,
                        "host_s": host_s,
                        "head_start_s": head_start_s,
                    }
                )
    return samples


def copy_routes(device: torch.device) -> list[tuple[torch.device, torch.device]]:
    """(source, destination): within the device, and to the next GPU when there is one."""
    routes = [(device, device)]
    if device.type == "cuda" and torch.cuda.device_count() > 1:
        routes.append(
            (device, torch.device("cuda", (device.index + 1) % torch.cuda.device_count()))
        )
    return routes


def measure(device: torch.device, cfg: Config) -> harness.Section:
    on_cuda = device.type == "cuda"
    unavailable: dict[str, str] = {}
    if not on_cuda:
        unavailable["gpipe_fast"] = unavailable["cupy"] = "needs CUDA"
    else:
        if not hasattr(_C, "BoundaryCopier"):
            unavailable["gpipe_fast"] = "gpipe_fast._C has no BoundaryCopier in this build"
        elif not _C.cuda_compiled():
            unavailable["gpipe_fast"] = "gpipe_fast._C was built without CUDA"
        if not cupy_available():
            unavailable["cupy"] = "cupy is not importable"
    names = [name for name in COPIERS if name not in unavailable]
    failed: dict[str, str] = {}  # contenders that raised: left out from then on

    def fail(name: str, error: Exception) -> None:
        failed[name] = f"{type(error).__name__}: {error}"
        print(f"  {name} FAILED: {failed[name]}", flush=True)

    copier = None
    if "gpipe_fast" in names:
        try:
            copier = _C.BoundaryCopier()
        except Exception as error:
            fail("gpipe_fast", error)
    cycles_per_s = _sleep_cycles_per_second(device) if on_cuda else 0.0
    deadline = time.monotonic() + cfg.time_box_s
    results: list[dict[str, Any]] = []
    peers: dict[str, Any] = {}
    rows = []
    for src_device, dst_device in copy_routes(device):
        route = f"{src_device} -> {dst_device}"
        if on_cuda and src_device != dst_device:
            # torch enables peer access for a pair on its first copy between them; doing it
            # here gives every contender the same path (cupy has no call of its own for it).
            torch.zeros(1, device=dst_device).copy_(torch.zeros(1, device=src_device))
            harness.synchronize(dst_device)
            peers[route] = {
                "torch_can_access_peer": torch.cuda.can_device_access_peer(
                    dst_device.index, src_device.index
                ),
                "native_enabled": None,
            }
            if copier is not None and "gpipe_fast" not in failed:
                try:
                    peers[route]["native_enabled"] = enable_peer_access(
                        copier, dst_device.index, src_device.index
                    )
                except Exception as error:
                    fail("gpipe_fast", error)
        stream = torch.cuda.Stream(dst_device) if on_cuda else None
        for nbytes in cfg.sizes:
            if time.monotonic() > deadline:
                print(f"  time box reached: skipping {route} {fmt_size(nbytes)} and larger")
                break
            src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=src_device)
            dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_device)
            launchers: dict[str, Callable[[], None]] = {}
            for name in names:
                if name not in failed:
                    try:
                        launchers[name] = make_copy_launcher(name, dst, src, stream, copier)
                    except Exception as error:
                        fail(name, error)
            reference = src if src_device == dst_device else src.to(dst_device)
            harness.synchronize(src_device)  # the copies run on `stream`, not where src was written
            equal: dict[str, bool] = {}
            for name, launch in list(launchers.items()):  # each copier must move every byte
                dst.zero_()
                harness.synchronize(dst_device)
                try:
                    launch()
                    if stream is not None:
                        stream.synchronize()
                except Exception as error:
                    fail(name, error)
                    del launchers[name]
                    continue
                equal[name] = torch.equal(dst, reference)
                if not equal[name]:
                    print(f"  MISMATCH: {name} copied {route} {fmt_size(nbytes)} wrongly")
            del reference
            batch = copy_batch(nbytes, cfg.bytes_per_sample, cfg.max_batch)
            samples = time_copies(launchers, batch, cfg.reps, stream, cycles_per_s)
            entry: dict[str, Any] = {
                "route": route,
                "bytes": nbytes,
                "copies_per_sample": batch,
                "bytes_equal": equal,
                "samples": samples,
                "gbps": {},
                "host_us_per_copy": {},
                "host_outran_head_start": {},
            }
            for name, values in samples.items():
                entry["gbps"][name] = median(
                    [gigabytes_per_second(nbytes, batch, v["gpu_s"]) for v in values]
                )
                entry["host_us_per_copy"][name] = median(
                    [v["host_s"] / batch * 1e6 for v in values]
                )
                entry["host_outran_head_start"][name] = (
                    sum(v["host_s"] > v["head_start_s"] for v in values) if on_cuda else 0
                )
            gbps = entry["gbps"]
            entry["gpipe_fast_vs_cupy"] = ratio(gbps.get("gpipe_fast"), gbps.get("cupy"))
            entry["gpipe_fast_vs_torch"] = ratio(gbps.get("gpipe_fast"), gbps.get("torch"))
            results.append(entry)
            rows.append(
                (
                    route,
                    fmt_size(nbytes),
                    *(fmt(gbps.get(name), 1) for name in COPIERS),
                    fmt(entry["gpipe_fast_vs_cupy"], 3),
                    fmt(entry["gpipe_fast_vs_torch"], 3),
                    ", ".join(f"{n}: {'yes' if ok else 'NO'}" for n, ok in equal.items()),
                    " / ".join(fmt(entry["host_us_per_copy"].get(n), 1) for n in COPIERS),
                )
            )
            print(
                f"  {route} {fmt_size(nbytes)}: "
                + ", ".join(f"{n} {fmt(g, 1)} GB/s" for n, g in gbps.items()),
                flush=True,
            )
            del src, dst, launchers
            harness.release_memory(dst_device)
    table = markdown_table(
        (
            "route",
            "size",
            "gpipe_fast GB/s",
            "cupy GB/s",
            "torch GB/s",
            "gpipe_fast / cupy",
            "gpipe_fast / torch",
            "bytes equal",
            "host us per copy (gf / cupy / torch)",
        ),
        rows,
    )
    if unavailable:
        table += "\n\nnot measured: " + "; ".join(f"{n}: {why}" for n, why in unavailable.items())
    if failed:
        table += "\n\nFAILED: " + "; ".join(f"{n}: {why}" for n, why in failed.items())
    outran = sum(n for entry in results for n in entry["host_outran_head_start"].values())
    timing = "CUDA events, the stream held back while the host enqueued" if on_cuda else "host"
    table += (
        f"\n\nGB/s = 1e9 bytes per second; median of {cfg.reps} samples per cell, each a batch "
        f"of back-to-back copies timed by {timing}; samples whose enqueueing outlasted that "
        f"head start (bandwidth possibly understated): {outran}"
    )
    data = {
        "unavailable": unavailable,
        "failed": failed,
        "peer_access": peers,
        "sleep_cycles_per_s": cycles_per_s,
        "results": results,
    }
    return harness.Section(data, table, "error" if failed else "ok")


measurement, main = harness.scaled_script(__file__, __doc__, NAME, SCALES, measure)


if __name__ == "__main__":
    sys.exit(main())
