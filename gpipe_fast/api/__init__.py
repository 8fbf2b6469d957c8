"""The facade: GPipe, its argument checks, state dict, and the pipes kept alive."""
