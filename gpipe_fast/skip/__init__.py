"""Skip connections (``torchgpipe.skip``'s API): ``@skippable`` layers that stash and pop."""

from gpipe_fast.skip.cell_tracker import CellSkipTracker
from gpipe_fast.skip.layout import SkipLayout, SkipRoute, inspect_skip_layout
from gpipe_fast.skip.namespace import Namespace
from gpipe_fast.skip.skippable import Skippable, pop, skippable, stash
from gpipe_fast.skip.tracker import SkipTracker, current_skip_tracker, use_skip_tracker
from gpipe_fast.skip.verify import verify_skippables

__all__ = [
    "CellSkipTracker",
    "Namespace",
    "SkipLayout",
    "SkipRoute",
    "SkipTracker",
    "Skippable",
    "current_skip_tracker",
    "inspect_skip_layout",
    "pop",
    "skippable",
    "stash",
    "use_skip_tracker",
    "verify_skippables",
]
