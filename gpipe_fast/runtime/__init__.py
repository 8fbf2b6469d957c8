"""Running steps: the pipeline, its steps and stages, the runner, bridge, timeline, memory."""
