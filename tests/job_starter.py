"""Starts the ranks of tests/jobs.py's jobs: imports torch and gpipe_fast once, then forks each
rank from itself, so that a rank costs its own work and not those imports (seconds each).

Each rank runs its script as `python SCRIPT ARGS` would, in a process of its own: the script
runs as __main__, an error that escapes it is printed and exits with code 1, sys.exit(N)
exits with N, and the interpreter ends as a script's does (atexit, threads joined, the native
module's teardown), which is what tests/test_exit_codes.py checks. Nothing has run in this
process but imports (no thread of torch's pools, no process group) when a rank is forked.

Protocol, one JSON line each way: a request {"script", "args", "world", "env", "folder"}; the
reply {"pids": [...]} once the ranks are forked, then {"codes": [...]} once they have all
ended (a negative code: killed by that signal). Rank r's stderr is `folder`/rank{r}.err.
"""

from __future__ import annotations

import gc
import json
import os
import runpy
import sys

# Imported here once, for every rank: what the ranks import, and torch's lazy imports that
# building a pipe takes (sympy's, and torch._dynamo's for cells that may draw random numbers),
# and FSDP, which gpipe_fast imports only where a stage is sharded.
import torch
import torch._dynamo
import torch.distributed
import torch.distributed.checkpoint
import torch.distributed.fsdp
import torch.fx.experimental.symbolic_shapes  # noqa: F401

import gpipe_fast  # noqa: F401


def _become_rank(script: str, args: list[str], env: dict[str, str], stderr: str) -> None:
    """In the forked child: the process `python script args` with `env` would be."""
    os.environ.clear()
    os.environ.update(env)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.dup2(os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    # An error escaping the script escapes this process's main module too: printed, exit 1.
    runpy.run_path(script, run_name="__main__")
    sys.exit(0)


def main() -> None:
    # The imports' objects are left out of the garbage collector's scans, in every rank too:
    # otherwise a rank's collections (the last as it exits) write to every page of them,
    # copying this process's whole heap into each rank (a second a rank).
    gc.freeze()
    for line in sys.stdin:
        request = json.loads(line)
        pids = []
        for rank in range(request["world"]):
            env = dict(request["env"], RANK=str(rank))
            stderr = os.path.join(request["folder"], f"rank{rank}.err")
            pid = os.fork()
            if pid == 0:
                _become_rank(request["script"], request["args"], env, stderr)
            pids.append(pid)
        print(json.dumps({"pids": pids}), flush=True)
        codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
        print(json.dumps({"codes": codes}), flush=True)


if __name__ == "__main__":
    main()
