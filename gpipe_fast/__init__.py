"""gpipe_fast: GPipe pipeline parallelism for PyTorch with a native C++/CUDA runtime.

Its layers, lowest first, are listed in gpipe_fast/layers.py: a module imports only from its
own layer or lower ones, and no modules import each other in a cycle (tests/test_layers.py).
"""

# Loaded first, so that a missing build fails here with advice. Private: reach it as
# gpipe_fast._C; it is not in __all__.
try:
    from gpipe_fast import _C  # noqa: F401
except ImportError as error:  # no silent fallback: the engine is native
    raise ImportError(
        "gpipe_fast's native core (gpipe_fast._C) is missing or failed to load. Build and "
        "install the package with `pip install .` (needs cmake and a C++17 compiler); "
        f"the loader said: {error}"
    ) from error

from gpipe_fast.api.any_model import ModelPipe, pipeline
from gpipe_fast.api.gpipe import GPipe
from gpipe_fast.api.grad_scaler import GradScaler
from gpipe_fast.balancing.balance import (
    balance_by_costs,
    balance_by_params,
    balance_by_size,
    balance_by_time,
    partition,
)
from gpipe_fast.errors import PeerFailure
from gpipe_fast.nn.checkpoint import is_checkpointing, is_recomputing
from gpipe_fast.nn.items import ItemMean
from gpipe_fast.planning.entry import plan
from gpipe_fast.planning.memory import CellMemory
from gpipe_fast.planning.plan import CellPlan, Plan
from gpipe_fast.planning.tune import tune as _tune  # noqa: F401  (installs the tuner of "auto")
from gpipe_fast.planning.tuning import TunedCandidate, Tuning
from gpipe_fast.runtime.memory import CellMemoryStats
from gpipe_fast.runtime.timeline import TaskSpan, Timeline
from gpipe_fast.schedule.registry import (
    Need,
    builtin_schedules,
    register_action,
    register_schedule_kind,
    schedules,
    unregister_schedule_kind,
)

__all__ = [
    "CellMemory",
    "CellMemoryStats",
    "CellPlan",
    "GPipe",
    "GradScaler",
    "ItemMean",
    "ModelPipe",
    "Need",
    "PeerFailure",
    "Plan",
    "TaskSpan",
    "Timeline",
    "TunedCandidate",
    "Tuning",
    "balance_by_costs",
    "balance_by_params",
    "balance_by_size",
    "balance_by_time",
    "builtin_schedules",
    "is_checkpointing",
    "is_recomputing",
    "partition",
    "pipeline",
    "plan",
    "register_action",
    "register_schedule_kind",
    "schedules",
    "unregister_schedule_kind",
]
__version__ = "0.1.0"
