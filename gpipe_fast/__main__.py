"""Command line: `python -m gpipe_fast demo` trains a small model through the pipe."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m gpipe_fast demo [options]   (demo --help for the options)")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from gpipe_fast.demo import run_demo

        return run_demo(rest)
    print(f"unknown command {command!r}; try: python -m gpipe_fast demo", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
