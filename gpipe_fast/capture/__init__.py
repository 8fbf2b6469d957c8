"""Any model as a pipe's cells: the module calls of its own forward, cut into stages, untraced.

`discover` runs the model's forward once on fake tensors and records which modules it calls in
which order; split points cut that order into stages, and every value a stage needs from
another (a hidden state, rotary cos/sin, an encoder's output) gets a route from the stage that
computes it. `StageCell` then runs the model's own forward on every stage: the modules of its
stage for real, the others' as fake placeholders of the right shape, with the routed values
substituted where the plan says."""
