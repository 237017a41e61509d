"""Kernels hf_specsample builds itself: `small_rows` (a CPU linear layer for the few rows a round verifies)."""
