"""What a pipe does to your layers: micro-batches, checkpoints, BatchNorm, randomness, ties."""
