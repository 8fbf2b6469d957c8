"""An input's signature (nn/signature.py): its tensors' shapes and dtypes, the same in every
process."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from gpipe_fast.nn.signature import input_signature


def test_the_signature_is_of_shapes_and_dtypes_not_values() -> None:
    x, mask = torch.randn(4, 8), torch.ones(4, 8, dtype=torch.bool)
    signature = input_signature((x, mask))
    assert 0 < signature < 2**62  # fits the int64 message it travels in
    assert input_signature((torch.randn(4, 8), torch.zeros(4, 8, dtype=torch.bool))) == signature
    assert input_signature((torch.randn(5, 8), mask)) != signature
    assert input_signature((x.double(), mask)) != signature
    assert input_signature((mask, x)) != signature
    assert input_signature((x,)) != signature


def test_every_process_computes_the_same_signature() -> None:
    # Python salts its own str hash per process; the signature must not depend on it.
    code = (
        "import torch; from gpipe_fast.nn.signature import input_signature; "
        "print(input_signature((torch.empty(3, 5), torch.empty(2, dtype=torch.int64))))"
    )
    found = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout.strip()
        for seed in ("1", "2")
    }  # fmt: skip
    here = input_signature((torch.empty(3, 5), torch.empty(2, dtype=torch.int64)))
    assert found == {str(here)}
