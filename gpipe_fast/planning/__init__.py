"""Planning: plans, their predicted steps and memory, calibration, the cost of a task measured."""
