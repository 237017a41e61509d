"""The drafts `draft_model=` accepts by name instead of a model."""

from __future__ import annotations

import enum


class NamedDraft(str, enum.Enum):
    """`draft_model="auto"` / `draft_model="prompt_lookup"` (a `str` enum: the plain strings compare equal)."""

    AUTO = "auto"  # a draft made from the target: an int8 copy on the CPU, a layer-skipping view elsewhere
    PROMPT_LOOKUP = "prompt_lookup"  # n-gram continuations from the prompt and the text so far; no model runs

    def __str__(self) -> str:
        return self.value
