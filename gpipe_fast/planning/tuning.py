"""What a tuning found: each candidate's predicted and measured step, the choice and its plan."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpipe_fast.api.auto import Config
from gpipe_fast.planning.plan import Plan


@dataclass(frozen=True)
class Fit:
    """gf.plan calibrated from the measured steps: the measured tasks' time over gf.plan's
    profiled time (`scale`), the runtime's seconds per task between tasks (`handoff`) and a
    step's seconds around its tasks (`call`), medians over the measured candidates; then, per
    schedule kind measured, the median of its measured steps over their prediction so far
    (`by_kind`): kinds differ in what gf.plan's simulation leaves out (one worker's cells
    taking turns, the backward's halves apart)."""

    scale: float
    handoff: float
    call: float
    by_kind: dict[str, float] = field(default_factory=dict, hash=False)

    def of_kind(self, kind: str) -> Fit:
        """The fit for one schedule kind: its correction folded into the scale, the hand-off
        and the call (a step simulated with every cost times k lasts k times as long)."""
        k = self.by_kind.get(kind, 1.0)
        return Fit(self.scale * k, self.handoff * k, self.call * k)


@dataclass
class TunedCandidate:
    """One candidate: its configuration, gf.plan's predicted step before calibration
    (`predicted_s`; None when it could not be priced in seconds) and after it
    (`calibrated_s`, from the steps measured), its median measured step across the ranks
    (`measured_s`, the slowest rank's; None when not run), its predicted peak memory per
    device, and why it failed to run (`error`)."""

    config: Config
    predicted_s: float | None
    peak_memory: int
    calibrated_s: float | None = None
    measured_s: float | None = None
    error: str | None = None


@dataclass
class Tuning:
    """``pipe.tuning``: what a tuning chose (`choice`) among `candidates` (ranked by gf.plan's
    prediction; those run have `measured_s`), for the input `signature` it ran at; `plan`,
    the choice's gf.plan calibrated from its own measured steps, predicts its step
    (``plan.step_time``); `seconds`, what the tuning took."""

    choice: Config
    candidates: list[TunedCandidate]
    plan: Plan | None
    seconds: float
    signature: int
    fit: Fit | None = None
    measured_steps: int = 0  # timed steps per measured candidate
    notes: list[str] = field(default_factory=list)  # what the tuning left out, and why

    @property
    def measured(self) -> list[TunedCandidate]:
        return [c for c in self.candidates if c.measured_s is not None]

    @property
    def chosen(self) -> TunedCandidate:
        return next(c for c in self.candidates if c.config == self.choice)

    def __str__(self) -> str:
        lines = [
            f"gpipe_fast tuning: chose {self.choice} in {self.seconds:.1f} s "
            f"({len(self.measured)} of {len(self.candidates)} candidates run, "
            f"at least {self.measured_steps} timed steps each)"
        ]
        if self.plan is not None:
            lines.append(f"its calibrated plan predicts {self.plan.step_time * 1e3:.2f} ms a step")
        header = ("", "configuration", "predicted ms", "calibrated ms", "measured ms")
        rows = [header]
        shown = self.measured + [c for c in self.candidates if c.measured_s is None][:5]
        for candidate in shown:
            mark = "*" if candidate.config == self.choice else ""
            rows.append((
                mark,
                str(candidate.config),
                _ms(candidate.predicted_s),
                _ms(candidate.calibrated_s),
                candidate.error or _ms(candidate.measured_s),
            ))  # fmt: skip
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        for row in rows:
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))
        hidden = len(self.candidates) - len(shown)
        if hidden > 0:
            lines.append(f"... and {hidden} more not run")
        lines += self.notes
        return "\n".join(line.rstrip() for line in lines)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"
