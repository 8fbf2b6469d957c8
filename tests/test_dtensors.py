"""is_dtensor: `import gpipe_fast` leaves FSDP and DTensor out, and still tells a DTensor."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from gpipe_fast.nn.dtensors import is_dtensor

# In a fresh interpreter, as a user's script starts: what `import gpipe_fast` imported, then a
# DTensor made once torch.distributed.tensor is imported (one rank of gloo).
FRESH = textwrap.dedent("""
    import json, sys
    import torch
    import gpipe_fast
    from gpipe_fast.nn.dtensors import is_dtensor
    heavy = ["torch.distributed.tensor", "torch.distributed.fsdp", "transformers"]
    loaded = [name for name in heavy if name in sys.modules]
    plain_before = is_dtensor(torch.ones(2))
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate
    dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 1), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    shared = DTensor.from_local(torch.ones(2), mesh, [Replicate()])
    print(json.dumps({"loaded": loaded, "plain_before": plain_before,
                      "dtensor": is_dtensor(shared), "plain_after": is_dtensor(torch.ones(2)),
                      "local": is_dtensor(shared.to_local())}))
    dist.destroy_process_group()
""")


def test_import_leaves_dtensor_out_and_a_dtensor_is_still_told(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", FRESH, str(tmp_path / "store")],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"loaded": [], "plain_before": False, "dtensor": True, "plain_after": False,
                    "local": False}  # fmt: skip


def test_values_that_are_not_tensors_are_not_dtensors() -> None:
    for value in (None, 1.0, [torch.ones(1)], torch.nn.Parameter(torch.ones(1))):
        assert not is_dtensor(value)
