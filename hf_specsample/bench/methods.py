"""What is compared: the target alone, transformers' assisted generation, and hf_specsample, greedy or sampling."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any


class Choice(str, Enum):
    """A string enum that prints as its value (command-line choices, JSON)."""

    def __str__(self) -> str:
        return self.value


class Method(Choice):
    TARGET = "target"  # plain model.generate()
    ASSISTED = "assisted"  # transformers' model.generate(assistant_model=draft)
    SPECULATIVE = "hf_specsample"  # model.generate(draft_model=draft)


class Mode(Choice):
    GREEDY = "greedy"
    SAMPLING = "sampling"


@dataclass(frozen=True)
class MethodSpec:
    """One column of the comparison.

    Attributes:
        method: which generate() path.
        num_lookahead: for SPECULATIVE, K (None: the library default); ignored otherwise.
    """

    method: Method
    num_lookahead: int | None = None

    @property
    def label(self) -> str:
        if self.method is Method.SPECULATIVE:
            return f"{self.method.value} K={self.num_lookahead}" if self.num_lookahead else f"{self.method.value} default"
        return self.method.value

    @property
    def uses_draft(self) -> bool:
        return self.method is not Method.TARGET

    def generate_kwargs(self, draft) -> dict[str, Any]:
        """The arguments this method adds to generate()."""
        if self.method is Method.ASSISTED:
            return {"assistant_model": draft}
        if self.method is Method.SPECULATIVE:
            kwargs: dict[str, Any] = {"draft_model": draft, "return_dict_in_generate": True}
            if self.num_lookahead is not None:
                kwargs["num_lookahead"] = self.num_lookahead
            return kwargs
        return {}


def sampling_kwargs(mode: Mode, temperature: float, top_p: float) -> dict[str, Any]:
    """Decoding arguments of a mode (all methods get the same)."""
    if mode is Mode.GREEDY:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": temperature, "top_p": top_p}


def parse_methods(text: str) -> list[MethodSpec]:
    """`"target,assisted,hf_specsample,hf_specsample:4"` -> specs (`name:K` fixes the lookahead)."""
    specs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, lookahead = item.partition(":")
        specs.append(MethodSpec(Method(name), int(lookahead) if lookahead else None))
    return specs
