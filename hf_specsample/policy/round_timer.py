"""A round's wall time split into drafting and the rest, for the adaptive lookahead's cost model, without syncs.

On the CPU the marks are `time.perf_counter()`. On CUDA each mark records an event on the token buffer's device
instead of synchronising: a synchronisation per phase would drain the queue of kernels the host had launched
ahead, which on a launch-bound GPU costs what the host needs to fill it again. An event's time is known once the
device has passed it; the round's one host sync (`StopCheck.read_round`) passes every event of the round
before, so a round's durations reach the policy one round late (`finish` hands back the records whose events
have completed).

Where the phases are timed on the host clock (`host_clock`), each mark also reads the host seconds the call's logits
processors have taken so far (`PositionwiseProcessor.seconds`), so that each phase's processing is known apart
(`round_costs.ProcessingCost`). Not against CUDA events: a processor that reads a tensor on the host waits there for
the forward queued before it, so its host seconds would hold the device's time too.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, NamedTuple

import torch

from ..sampling.processing import PositionwiseProcessor
from .round_costs import RoundRecord


def host_clock(device: torch.device) -> bool:
    """Whether a round's phases on `device` are timed on the host clock (everywhere but CUDA), and with them the
    processors' seconds."""
    return device.type != "cuda"


class Mark(NamedTuple):
    """A point of a round: its clock reading (seconds, or a CUDA event) and the processors' seconds so far."""

    clock: Any
    processing: float


class PhaseTimer:
    """Marks the start of a round, the end of its drafting and its end; `finish` turns them into durations."""

    def __init__(self, enabled: bool, device: torch.device, processor: PositionwiseProcessor | None = None):
        """
        Args:
            enabled: the policy learns from durations (`LookaheadPolicy.needs_timing`); else nothing is timed.
            device: the token buffer's device: events there on CUDA, the host clock elsewhere.
            processor: the call's processors (drafter's and verifier's), whose seconds each mark reads on the host
                clock; None: none.
        """
        self.enabled = enabled
        self.device = device if enabled and not host_clock(device) else None
        self.processor = processor if self.device is None else None
        self._marks: list[Mark] = []
        self._pending: list[tuple[RoundRecord, Any, list[Mark]]] = []  # CUDA: records waiting for their events

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
        processing = self.processor.seconds if self.processor is not None else 0.0
        if self.device is None:
            self._marks.append(Mark(time.perf_counter(), processing))
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        self._marks.append(Mark(event, processing))

    def finish(self, record: RoundRecord, tag: Any = None) -> list[tuple[RoundRecord, Any]]:
        """The rounds whose durations are known now, each as (its record with `draft_seconds` from the start to
        the first mark and `verify_seconds` from there to the last, the processors' seconds within each, the `tag`
        it was finished with): this one's where timing needs no device (or nothing is timed), on CUDA the earlier
        ones whose events completed."""
        if not self.enabled:
            return [(record, tag)]
        if self.device is None:
            start, drafted, end = self._marks
            return [(_timed(record, drafted.clock - start.clock, end.clock - drafted.clock, self._marks), tag)]
        self._pending.append((record, tag, self._marks))
        done = []
        while self._pending and self._pending[0][2][-1].clock.query():  # completed: reading it waits for nothing
            pending, pending_tag, marks = self._pending.pop(0)
            start, drafted, end = (mark.clock for mark in marks)
            seconds = start.elapsed_time(drafted) / 1e3, drafted.elapsed_time(end) / 1e3
            done.append((_timed(pending, *seconds, marks), pending_tag))
        return done


def _timed(record: RoundRecord, draft_seconds: float, verify_seconds: float, marks: list[Mark]) -> RoundRecord:
    """`record` with its phases' durations and, from the `marks` (start, drafted, end), their processing."""
    start, drafted, end = (mark.processing for mark in marks)
    return dataclasses.replace(
        record,
        draft_seconds=draft_seconds,
        verify_seconds=verify_seconds,
        draft_processing_seconds=drafted - start,
        verify_processing_seconds=end - drafted,
    )
