"""The demo job, `python -m gpipe_fast demo`: a model trained through the pipe, explained."""

from gpipe_fast.demo.job import run_demo

__all__ = ["run_demo"]
