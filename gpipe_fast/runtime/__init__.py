"""Running steps: the pipeline, its cells, steps and stages, runner, bridge, timeline, memory."""
