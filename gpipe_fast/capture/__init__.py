"""Any model as a pipe's cells: the module calls of its own forward, cut into stages, untraced.

`discover` runs the model's forward on fake copies of its tensors (its inputs stay real) and
records which modules it calls in which order; split points cut that order into stages, every
tensor of the glue between them is keyed by what makes it (`identity`), and every value a
stage needs from another (a hidden state, rotary cos/sin, an encoder's output, router logits
a hook recorded) gets a route from the stage that makes it (`routes`). `CapturedCell` then runs
the model's own forward on every stage: the modules of its stage for real, the others' as fake
placeholders of the right shape, the routed values taken and put where the same identities
come up, checked as they are put."""
