"""Whether a call's forwards run as graphs (compiled or captured runners) or eagerly: graphs where they pay.

On a GPU an eager decoding step is launch-bound (a 7B step 19.7 ms against 3.5 ms of weight streaming on an H200),
and a graph replays the same kernels without the launches; but compiling or capturing costs seconds once per shape.
Graphs pay where the rounds a call runs save more than the capture costs: `rounds * (eager - graph) > capture`,
with the capture counted as zero where runners kept from an earlier call of the process serve this one
(`cache.runner.runner_for`, kept with a pooled cache). `choose_graphs` is that decision, a pure function of the
timings it is handed (tested with injected timings, no clock); its reason goes to `SpeculativeStats.graphs`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .cache.runner import RunnerBackend


@dataclass(frozen=True)
class GraphTimings:
    """What the decision weighs, for one call.

    Attributes:
        capture_seconds: compiling or capturing this call's runners (0.0 where kept ones serve it).
        eager_round_seconds: one round's forwards (the draft's steps and the verification) eagerly.
        graph_round_seconds: the same forwards replayed as graphs.
        rounds: the rounds the call is expected to run (new tokens over the tokens a round commits).
    """

    capture_seconds: float
    eager_round_seconds: float
    graph_round_seconds: float
    rounds: int


class GraphChoice(NamedTuple):
    """The backend a call's runners use, or None (no runners: the forwards run as before), and why, in words."""

    backend: RunnerBackend | None
    reason: str


def choose_graphs(device: torch.device, compile_asked: bool, timings: GraphTimings | None) -> GraphChoice:
    """Graphs or eager forwards for a call on `device`.

    Args:
        compile_asked: `SpeculativeConfig(compile=True)`: the caller asked for compiled forwards.
        timings: what graphs would cost and save in this call, or None where nothing was timed.
    """
    if device.type != "cuda":
        return GraphChoice(None, f"eager: CUDA graphs need a CUDA device (this call runs on {device.type})")
    if compile_asked:
        return GraphChoice(RunnerBackend.COMPILED, "graphs: compile=True (compiled runners, CUDA graphs)")
    if timings is None:
        return GraphChoice(None, "eager: no graph timing for these models yet (compile=True runs graphs)")
    saved = timings.rounds * (timings.eager_round_seconds - timings.graph_round_seconds)
    figures = (
        f"{timings.rounds} rounds x ({timings.eager_round_seconds * 1e3:.1f} - "
        f"{timings.graph_round_seconds * 1e3:.1f}) ms = {saved:.2f} s saved against {timings.capture_seconds:.2f} s "
        "of capture"
    )
    if saved > timings.capture_seconds:
        return GraphChoice(RunnerBackend.COMPILED, f"graphs: {figures}")
    return GraphChoice(None, f"eager: {figures}")
