"""Whether a call's forwards run as graphs (compiled runners) or eagerly, and why in words.

On a GPU an eager decoding step is launch-bound (a 7B step 19.7 ms against 3.5 ms of weight streaming on an H200),
and a graph replays the same kernels without the launches; but compiling costs seconds (minutes for a large model)
once per shape. The caller asks for it with `SpeculativeConfig(compile=True)`; otherwise the rounds run eagerly.
`choose_graphs` is that decision, a pure function of the device and the ask; its reason goes to
`SpeculativeStats.graphs`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..cache.runner import RunnerBackend


class GraphChoice(NamedTuple):
    """The backend a call's runners use, or None (no runners: the forwards run as before), and why, in words."""

    backend: RunnerBackend | None
    reason: str


def choose_graphs(device: torch.device, compile_asked: bool) -> GraphChoice:
    """Graphs or eager forwards for a call on `device`.

    Args:
        compile_asked: `SpeculativeConfig(compile=True)`: the caller asked for compiled forwards.
    """
    if device.type != "cuda":
        return GraphChoice(None, f"eager: CUDA graphs need a CUDA device (this call runs on {device.type})")
    if compile_asked:
        return GraphChoice(RunnerBackend.COMPILED, "graphs: compile=True (compiled runners, CUDA graphs)")
    return GraphChoice(None, "eager: graphs run where compile=True asks for them (compiled runners, CUDA graphs)")
