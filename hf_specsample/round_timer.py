"""A round's wall time split into drafting and the rest, for the adaptive lookahead's cost model, without syncs.

On the CPU the marks are `time.perf_counter()`. On CUDA each mark records an event on the token buffer's device
instead of synchronising: a synchronisation per phase would drain the queue of kernels the host had launched
ahead, which on a launch-bound GPU costs what the host needs to fill it again. An event's time is known once the
device has passed it; the round's one host sync (`StopCheck.read_round`) passes every event of the round
before, so a round's durations reach the policy one round late (`finish` hands back the records whose events
have completed).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from .round_costs import RoundRecord


class PhaseTimer:
    """Marks the start of a round, the end of its drafting and its end; `finish` turns them into durations."""

    def __init__(self, enabled: bool, device: torch.device):
        """
        Args:
            enabled: the policy learns from durations (`LookaheadPolicy.needs_timing`); else nothing is timed.
            device: the token buffer's device: events there on CUDA, the host clock elsewhere.
        """
        self.enabled = enabled
        self.device = device if enabled and device.type == "cuda" else None
        self._marks: list = []
        self._pending: list[tuple[RoundRecord, Any, list]] = []  # CUDA: records waiting for their events

    @staticmethod
    def record(lookahead: int, num_accepted: list[int], prefill: bool, refeed_forwards: int) -> RoundRecord:
        """The round's record for `finish` (`RoundRecord.untimed`): its durations are filled in there."""
        return RoundRecord.untimed(lookahead, num_accepted, prefill, refeed_forwards)

    def start(self) -> None:
        self._marks = []
        self.mark()

    def mark(self) -> None:
        if not self.enabled:
            return
        if self.device is None:
            self._marks.append(time.perf_counter())
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        self._marks.append(event)

    def finish(self, record: RoundRecord, tag: Any = None) -> list[tuple[RoundRecord, Any]]:
        """The rounds whose durations are known now, each as (its record with `draft_seconds` from the start to
        the first mark and `verify_seconds` from there to the last, the `tag` it was finished with): this one's
        where timing needs no device (or nothing is timed), on CUDA the earlier ones whose events completed."""
        if not self.enabled:
            return [(record, tag)]
        if self.device is None:
            start, drafted, end = self._marks
            return [(dataclasses.replace(record, draft_seconds=drafted - start, verify_seconds=end - drafted), tag)]
        self._pending.append((record, tag, self._marks))
        done = []
        while self._pending and self._pending[0][2][-1].query():  # completed: reading it waits for nothing
            pending, pending_tag, (start, drafted, end) = self._pending.pop(0)
            seconds = start.elapsed_time(drafted) / 1e3, drafted.elapsed_time(end) / 1e3
            done.append(
                (dataclasses.replace(pending, draft_seconds=seconds[0], verify_seconds=seconds[1]), pending_tag)
            )
        return done
