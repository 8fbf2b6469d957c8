"""torchgpipe's import path for the balancing helpers: `from gpipe_fast.balance import ...`."""

from gpipe_fast.balancing.balance import (
    balance_by_costs,
    balance_by_params,
    balance_by_size,
    balance_by_time,
    partition,
)

__all__ = [
    "balance_by_costs",
    "balance_by_params",
    "balance_by_size",
    "balance_by_time",
    "partition",
]
