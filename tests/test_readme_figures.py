"""bench/readme_figures.py, which measures the figures the README and the guide quote, runs
and reports each of them; the figures that do not depend on timing, the training text's
vocabulary and the simulator's bubble per schedule, are the ones the README and the guide
name."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_readme_names_the_vocabulary_train_lm_reads() -> None:
    spec = importlib.util.spec_from_file_location("train_lm", ROOT / "examples" / "train_lm.py")
    assert spec is not None and spec.loader is not None
    train_lm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_lm)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    quoted = re.findall(r"uniform over\s+the\s+(\d+)\s+characters", readme)
    assert quoted == [str(train_lm.Corpus().vocab)], "run python bench/readme_figures.py"


def test_the_guide_quotes_the_simulators_bubble_per_schedule() -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import readme_figures
    finally:
        sys.path.remove(str(ROOT / "bench"))
    concepts = (ROOT / "docs" / "concepts.md").read_text(encoding="utf-8")
    quoted = " ".join(concepts.split())  # the sentence wraps
    for schedule in readme_figures.SCHEDULES:
        share = f"{readme_figures.predicted_bubble(schedule, readme_figures.stages(schedule)):.1%}"
        assert share in quoted, (schedule, share, "run python bench/readme_figures.py")


@pytest.mark.slow
def test_the_figures_script_reports_every_figure() -> None:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "readme_figures.py"), "--steps", "4"],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1"),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for figure in ("vocabulary", "train loss", "validation", "k tokens/s", "a checkpoint:",
                   "examples/unet.py", "in 4 steps", "zbv", "load average"):  # fmt: skip
        assert figure in result.stdout, (figure, result.stdout)
