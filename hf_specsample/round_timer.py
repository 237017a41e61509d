"""Splitting a round's wall time into phases, for the adaptive lookahead's cost model."""

from __future__ import annotations

import time

import torch


class PhaseTimer:
    """Marks phase boundaries; on CUDA each mark synchronises first, so queued kernels count in their phase.

    That is one extra device sync per phase boundary, paid only when a policy needs the costs (adaptive K).
    """

    def __init__(self, enabled: bool, devices: list[torch.device]):
        self.enabled = enabled
        self.cuda = enabled and any(device.type == "cuda" for device in devices)
        self.marks: list[float] = []

    def start(self) -> None:
        self.marks = [self._now()] if self.enabled else []

    def mark(self) -> None:
        if self.enabled:
            self.marks.append(self._now())

    def durations(self) -> list[float]:
        """Seconds between consecutive marks (empty when disabled)."""
        return [end - start for start, end in zip(self.marks, self.marks[1:])]

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()
