"""One rank of a two-process job whose step fails (or not), then exits: tests/test_exit_codes.py.

Usage (rank, world and the store's address in the environment, as torchrun sets them):
python exit_case.py FAILING_RANK ENDING, where ENDING is how the rank ends: "raise" lets the
error escape (exit code 1), "destroy" destroys the process group first and then raises,
"exit3" catches it and calls sys.exit(3); FAILING_RANK -1 runs a step that succeeds.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

import gpipe_fast as gf


class _Fail(nn.Module):
    """Raises on `rank` in its second forward."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank, self.calls = rank, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() == self.rank:
            self.calls += 1
            if self.calls == 2:
                raise ValueError(f"planted on rank {self.rank}")
        return x


def main(failing: int, ending: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    layers: list[nn.Module] = []
    for _ in range(2):
        layers += [nn.Linear(16, 16), _Fail(failing)]
    pipe = gf.GPipe(nn.Sequential(*layers), [2, 2], chunks=4, schedule="1f1b",
                    pp_group=dist.group.WORLD, timeout=20)  # fmt: skip
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    try:
        pipe.train_step(x, y, nn.functional.mse_loss)
    except Exception as error:
        print(f"rank {dist.get_rank()} caught {type(error).__name__}: {error}", file=sys.stderr)
        if ending == "exit3":
            sys.exit(3)
        if ending == "destroy":
            dist.destroy_process_group()
        raise


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
