"""What turns the target's logits into a verdict: the rules as pure tensor functions (`rules`), the one `Verifier`
that applies them, and tensor-parallel ranks taking rank 0's verdict (`distributed`)."""
