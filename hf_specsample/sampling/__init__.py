"""What drafters and verifiers both use: logits processors along a path, draws (keyed and from a generator), argmax
and row chunks."""
