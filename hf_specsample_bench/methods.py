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
        num_lookahead: for SPECULATIVE, K (None: the library default, adaptive); ignored otherwise.
        draft_quantization: for SPECULATIVE, "auto" / "int8" / "none" (None: the library default).
        draft_vocabulary: for SPECULATIVE, the N most frequent tokens the draft may propose (None: all).
    """

    method: Method
    num_lookahead: int | None = None
    draft_quantization: str | None = None
    draft_vocabulary: int | None = None

    @property
    def label(self) -> str:
        if self.method is not Method.SPECULATIVE:
            return self.method.value
        parts = [self.method.value, f"K={self.num_lookahead}" if self.num_lookahead else "K=auto"]
        if self.draft_quantization is not None:
            parts.append(f"draft {self.draft_quantization}")
        if self.draft_vocabulary is not None:
            parts.append(f"vocab {self.draft_vocabulary // 1000}k")
        return " ".join(parts) if len(parts) > 2 or self.num_lookahead else f"{self.method.value} default"

    @property
    def uses_draft(self) -> bool:
        return self.method is not Method.TARGET

    def speculative_config(self, tokenizer=None):
        """The `SpeculativeConfig` of a SPECULATIVE method (frequent tokens need the tokenizer)."""
        from hf_specsample.config import SpeculativeConfig
        from hf_specsample.vocabulary import frequent_tokens

        options: dict[str, Any] = {"num_lookahead": self.num_lookahead}
        if self.draft_quantization is not None:
            options["draft_quantization"] = self.draft_quantization
        if self.draft_vocabulary is not None:
            options["draft_vocabulary"] = frequent_tokens(tokenizer, self.draft_vocabulary)
        return SpeculativeConfig(**options)

    def generate_kwargs(self, draft, tokenizer=None) -> dict[str, Any]:
        """The arguments this method adds to generate()."""
        if self.method is Method.ASSISTED:
            return {"assistant_model": draft}
        if self.method is Method.SPECULATIVE:
            config = self.speculative_config(tokenizer)
            return {"draft_model": draft, "return_dict_in_generate": True, "speculative_config": config}
        return {}


def sampling_kwargs(mode: Mode, temperature: float, top_p: float) -> dict[str, Any]:
    """Decoding arguments of a mode (all methods get the same)."""
    if mode is Mode.GREEDY:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": temperature, "top_p": top_p}


def parse_methods(text: str) -> list[MethodSpec]:
    """`"target,assisted,hf_specsample,hf_specsample:4,hf_specsample:auto:none:32000"` -> specs.

    After `hf_specsample`, colon-separated: K (a number, or `auto`), the draft quantization (`auto`, `int8`,
    `none`) and the draft vocabulary size (N most frequent tokens).
    """
    specs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, *fields = item.split(":")
        fields += [""] * (3 - len(fields))
        lookahead, quantization, vocabulary = fields[:3]
        specs.append(
            MethodSpec(
                Method(name),
                int(lookahead) if lookahead and lookahead != "auto" else None,
                quantization or None,
                int(vocabulary) if vocabulary else None,
            )
        )
    return specs
