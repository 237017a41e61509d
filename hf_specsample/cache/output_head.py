"""A model's output head applied row chunk by row chunk, so that a round never holds all its logits at once.

A verification forward of ``rows`` rows makes `(rows, K + 1, vocab)` logits; over a large vocabulary and many rows
they are most of a round's memory (256 rows x 5 positions x 151,936 logits are 0.72 GiB in float32), while plain
`generate()` holds `(rows, 1, vocab)`. `OutputHead` runs the model's forward with the head's input captured (a
forward pre-hook on `get_output_embeddings()`), hands the head a slice of it so that it computes (almost) nothing,
and returns `HeadLogits`: the captured hidden states and the head, which make any rows' logits when they are read
(`verify.verifier.Verifier`, one row chunk at a time).

The head is the output embedding followed by what the architecture does to its output before returning logits
(`Tail`: Gemma's final soft-capping, Cohere's logit scale, Granite's logit scaling, or nothing). Which one is never
taken on trust: a call's first deferred forward hands the model's own head one row's last position and compares
the model's logits with each candidate's on that same input, bit for bit (the same operations on the same tensor
give the same bits); none equal (another architecture's post-processing, a head called twice, a head input of
another layout) and the forward runs again with the model's own full logits, as every later one of the call does,
and the model is remembered as such (weakly) so that its later calls do not run a forward twice.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from enum import Enum
from typing import Any, ContextManager

import torch
from torch import nn
from transformers import PreTrainedModel

Routed = Callable[[], ContextManager[Any]]  # the context the model's forward runs in (its kernel routing)
# Models whose head's output did not match any `Tail` (weakly): they never defer.
_FULL_LOGITS: weakref.WeakSet[nn.Module] = weakref.WeakSet()


class Tail(str, Enum):
    """What a model does to its output embedding's output before returning logits, named by the config field (or
    model attribute) that sets it; tried in this order (the specific ones first)."""

    SOFT_CAPPING = "final_logit_softcapping"  # Gemma 2 and 3: cap * tanh(logits / cap)
    SCALE = "logit_scale"  # Cohere: logits * scale
    SCALING = "logits_scaling"  # Granite: logits / scaling
    NONE = "none"

    def apply(self, model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The function the model applies (the same operations in the same order), or None where it has no such
        setting."""
        if self is Tail.NONE:
            return lambda logits: logits
        value = getattr(model, self.value, None)  # Cohere keeps its scale on the model
        value = value if value is not None else getattr(getattr(model, "config", None), self.value, None)
        if not isinstance(value, int | float) or isinstance(value, bool):
            return None
        if self is Tail.SOFT_CAPPING:
            return lambda logits: torch.tanh(logits / value) * value
        return (lambda logits: logits * value) if self is Tail.SCALE else (lambda logits: logits / value)


class HeadLogits:
    """A round's logits, made when read: `(rows, positions, hidden)` hidden states and the head that turns them
    into `(rows, positions, vocab)` logits, row slice by row slice (`self[rows]`)."""

    def __init__(
        self, hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], vocab: int, device: torch.device
    ):
        """
        Args:
            hidden: `(rows, positions, hidden)` what the head is applied to.
            head: hidden states -> the model's logits (`OutputHead`: the output embedding and its `Tail`, in the
                forward's kernel routing).
            vocab: the logits' width.
            device: where the logits go (the token buffer's device).
        """
        self.hidden, self.head, self.device = hidden, head, device
        self.shape = torch.Size((hidden.shape[0], hidden.shape[1], vocab))

    def __getitem__(self, rows: slice) -> torch.Tensor:
        """`(len(rows), positions, vocab)` float32 logits of `rows`, as the model's forward would have made them."""
        return self.head(self.hidden[rows]).to(device=self.device, dtype=torch.float32)


class OutputHead:
    """One call's output head of one model: its forwards' logits deferred where `deferred` asks (module docstring)."""

    def __init__(self, model: PreTrainedModel, usable: bool):
        """
        Args:
            model: the model.
            usable: its forwards may defer their logits (eager forwards on a cache without recurrent states, on one
                rank: a compiled forward's graph would see the hook, a re-run forward must be undone by a crop).
        """
        self.model, self.module = model, model.get_output_embeddings()
        self.usable = usable and isinstance(self.module, nn.Module) and model not in _FULL_LOGITS
        self.tail: Tail | None = None  # decided by the call's first deferral
        self.wanted = False  # set by `deferred`
        self.made: HeadLogits | None = None  # the deferred logits of the forward just run, for `take`

    @contextlib.contextmanager
    def deferred(self, wanted: bool) -> Iterator[None]:
        """While active, a forward of this model's own cache defers its logits (`take` returns them) if `wanted`."""
        self.wanted, self.made = wanted and self.usable, None
        try:
            yield
        finally:
            self.wanted = False

    def take(self, logits: torch.Tensor) -> torch.Tensor | HeadLogits:
        """The deferred logits of the forward just run, else its `logits`."""
        made, self.made = self.made, None
        return made if made is not None else logits

    def forward(
        self,
        run: Callable[[], Any],
        routed: Routed,
        rows: int,
        num_logits: int,
        device: torch.device,
        undo: Callable[[], None] | None,
    ) -> torch.Tensor:
        """The model's forward `run()` in `routed()`: its logits, or, where deferred, an empty `(rows, num_logits,
        0)` stand-in (`take` returns the `HeadLogits`).

        Args:
            rows: the forward's rows.
            num_logits: how many trailing positions' logits the caller keeps.
            device: where the caller wants the logits.
            undo: drops this forward's positions from the cache again (None: a forward that may not defer).
        """
        if not (self.wanted and undo is not None and self.usable):
            with routed():
                return run().logits
        probe = self.tail is None  # the call's first deferral: the model's head computes one row's last position
        captured, logits = self._captured_run(run, routed, rows, probe)
        if not captured:  # the head was not called: the model made its logits otherwise, in full
            assert logits is not None  # a forward that raised before its head raised its own error
            return logits
        hidden = captured[0] if len(captured) == 1 else None
        if hidden is not None and logits is not None and probe:
            self.tail = self._matching_tail(hidden[:1, -1:], logits, routed)
        if hidden is None or logits is None or self.tail is None:
            self.usable = False
            _FULL_LOGITS.add(self.model)
            undo()
            with routed():
                return run().logits
        tail, module = self.tail.apply(self.model), self.module
        assert tail is not None  # `_matching_tail` found it so

        def head(states: torch.Tensor) -> torch.Tensor:
            with routed():
                return tail(module(states))

        last = hidden[:, -num_logits:].contiguous()  # a copy where the forward's hidden states are wider: freed
        self.made = HeadLogits(last, head, vocab=logits.shape[-1], device=device)
        return logits.new_empty((rows, num_logits, 0))

    def _captured_run(
        self, run: Callable[[], Any], routed: Routed, rows: int, probe: bool
    ) -> tuple[list[torch.Tensor | None], torch.Tensor | None]:
        """`run()` with the head's input captured and the head handed a slice of it (`probe`: one row's last
        position, else nothing): the inputs the head was called with (None for one not captured: a second call,
        another layout), and the forward's logits (None where it raised after its head, on the slice)."""
        captured: list[torch.Tensor | None] = []

        def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
            hidden = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if captured or hidden is None or hidden.dim() != 3 or hidden.shape[0] != rows:
                captured.append(None)  # the forward runs again on full logits
                return None
            captured.append(hidden)
            return (hidden[:1, -1:] if probe else hidden[:, :0],) + args[1:]

        handle = self.module.register_forward_pre_hook(hook)
        try:
            with routed():
                return captured, run().logits
        except Exception:
            if not captured:  # raised before the head: the model's own error
                raise
            return captured, None
        finally:
            handle.remove()

    def _matching_tail(self, probe: torch.Tensor, logits: torch.Tensor, routed: Routed) -> Tail | None:
        """The first `Tail` whose head gives the model's `logits` for `probe` bit for bit (float32, as the loop
        reads them), else None."""
        if logits.shape[:2] != (1, 1):
            return None
        expected = logits.float()
        with routed():
            raw = self.module(probe)
        for candidate in Tail:
            tail = candidate.apply(self.model)
            if tail is not None:
                got = tail(raw).float()
                if got.shape == expected.shape and torch.allclose(got, expected, rtol=0, atol=0, equal_nan=True):
                    return candidate
        return None
