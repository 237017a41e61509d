"""What is compared: the target alone, transformers' assisted generation, and hf_specsample, greedy or sampling."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from enum import Enum
from typing import Any

from hf_specsample import DraftForm, DraftShape, PreparedDraft, SpeculativeConfig, frequent_tokens, prepare_draft


class Choice(str, Enum):
    """A string enum that prints as its value (command-line choices, JSON)."""

    def __str__(self) -> str:
        return self.value


class Method(Choice):
    TARGET = "target"  # plain model.generate()
    ASSISTED = "assisted"  # transformers' model.generate(assistant_model=draft)
    LOOKUP = "lookup"  # transformers' own prompt-lookup decoding: model.generate(prompt_lookup_num_tokens=N)
    SPECULATIVE = "hf_specsample"  # model.generate(draft_model=draft)


class Drafter(Choice):
    """What drafts for an hf_specsample method."""

    MODEL = "model"  # the pair's draft model (as prepared by prepare_draft)
    PROMPT_LOOKUP = "prompt_lookup"  # draft_model="prompt_lookup": n-gram continuations, no model


DEFAULT_LOOKUP_TOKENS = 10  # N of `lookup` and `lookup=` when none is given (transformers' examples use 10)

# `--levers`: each lever of hf_specsample switched off (or forced) on its own, next to the default and the peers.
LEVER_METHODS = (
    "target,assisted,hf_specsample,hf_specsample:4,hf_specsample:auto:as_given,hf_specsample:auto:dynamic_int8,"
    "hf_specsample:::32000,hf_specsample:verify=token,hf_specsample:processors=plain"
)
# `--levers` on code-editing prompts adds the prompt-lookup drafters and transformers' own prompt lookup.
LOOKUP_LEVER_METHODS = "lookup,hf_specsample:draft=prompt_lookup,hf_specsample:lookup=10"


class Mode(Choice):
    GREEDY = "greedy"
    SAMPLING = "sampling"


@dataclass(frozen=True)
class MethodSpec:
    """One column of the comparison.

    Attributes:
        method: which generate() path.
        num_lookahead: for SPECULATIVE, K (None: the library default, adaptive); ignored otherwise.
        draft_form: for SPECULATIVE, a `DraftForm` ("auto", "as_given", "dynamic_int8", "int8_weights",
            "int4_weights"; None: the library default).
        draft_vocabulary: for SPECULATIVE, the N most frequent tokens the draft may propose (None: all).
        verification: for SPECULATIVE, "token" or "block" (None: the library default).
        fast_processors: for SPECULATIVE, False runs transformers' processors as given (None: the default).
        lookup_tokens: LOOKUP's N, or for SPECULATIVE `prompt_lookup_num_tokens=N` (None: not passed).
        drafter: for SPECULATIVE, the draft model (default) or `draft_model="prompt_lookup"`.
        draft_shape: for SPECULATIVE, "chain" or "tree" (`SpeculativeConfig.draft_shape`; None: the default).
    """

    method: Method
    num_lookahead: int | None = None
    draft_form: str | None = None
    draft_vocabulary: int | None = None
    verification: str | None = None
    fast_processors: bool | None = None
    lookup_tokens: int | None = None
    drafter: Drafter = Drafter.MODEL
    draft_shape: str | None = None

    @property
    def label(self) -> str:
        if self.method is Method.LOOKUP:
            return f"transformers lookup {self.lookup_tokens or DEFAULT_LOOKUP_TOKENS}"
        if self.method is not Method.SPECULATIVE:
            return self.method.value
        parts = [self.method.value, f"K={self.num_lookahead}" if self.num_lookahead else "K=auto"]
        if self.drafter is Drafter.PROMPT_LOOKUP:
            parts.append("prompt_lookup")
        if self.draft_form is not None:
            parts.append(f"draft {self.draft_form}")
        if self.draft_vocabulary is not None:
            parts.append(f"vocab {self.draft_vocabulary // 1000}k")
        if self.verification is not None:
            parts.append(f"verify {self.verification}")
        if self.fast_processors is False:
            parts.append("processors plain")
        if self.lookup_tokens is not None:
            parts.append(f"lookup {self.lookup_tokens}")
        if self.draft_shape is not None:
            parts.append(self.draft_shape)
        return " ".join(parts) if len(parts) > 2 or self.num_lookahead else f"{self.method.value} default"

    @property
    def uses_draft(self) -> bool:
        """Whether the pair's draft model runs (or, for `assisted`, is passed)."""
        if self.method is Method.SPECULATIVE:
            return self.drafter is Drafter.MODEL
        return self.method is Method.ASSISTED

    @property
    def speculative_config(self) -> SpeculativeConfig | None:
        """The `speculative_config=` of a SPECULATIVE method whose verification or processors are not the default."""
        options = {}
        if self.verification is not None:
            options["verification"] = self.verification
        if self.fast_processors is not None:
            options["fast_processors"] = self.fast_processors
        if self.draft_shape is not None:
            options["draft_shape"] = self.draft_shape
        return SpeculativeConfig(**options) if options else None

    @property
    def draft_options(self) -> tuple[str | None, int | None]:
        """What the prepared draft of a SPECULATIVE method depends on (K does not change the draft)."""
        return self.draft_form, self.draft_vocabulary


class MethodDrafts:
    """What each method passes to generate(), made once per benchmark run and held by the caller.

    `assistant_model=` gets the draft as loaded. hf_specsample gets a `PreparedDraft` made by the public
    `hf_specsample.prepare_draft`, the object a user holds and passes as `draft_model=`, one per (form,
    vocabulary): so the benchmark times, and measures c on, exactly what users run, and no preparation happens
    inside a timed call.
    """

    def __init__(self, target, draft, tokenizer, draft_tokenizer=None):
        """`draft_tokenizer`: the draft's own tokenizer when it differs from the target's (else None)."""
        self.target, self.draft, self.tokenizer, self.draft_tokenizer = target, draft, tokenizer, draft_tokenizer
        self._prepared: dict[tuple[str | None, int | None], PreparedDraft] = {}
        # transformers' assisted generation with another tokenizer (5.23) prunes the assistant's LM head and input
        # embedding in place the first time it samples, after which greedy assisted calls on that model fail
        # ("mat1 and mat2 shapes cannot be multiplied"): it gets one copy per mode, and the draft the other methods
        # run stays intact.
        self._assistants = {mode: copy.deepcopy(draft) for mode in Mode} if draft_tokenizer is not None else {}

    def assistant(self, mode: Mode):
        """The model `assistant_model=` gets in `mode`."""
        return self._assistants.get(mode, self.draft)

    def counted_model(self, spec: MethodSpec, mode: Mode):
        """The draft model whose forward calls `spec`'s method makes in `mode` (None: the target alone)."""
        if not spec.uses_draft:
            return None
        return self.assistant(mode) if spec.method is Method.ASSISTED else self.draft

    @classmethod
    def wrap(cls, target, draft, tokenizer) -> MethodDrafts:
        """`draft` itself if it already is a `MethodDrafts` (shared across a run's sections), else a new one."""
        return draft if isinstance(draft, MethodDrafts) else cls(target, draft, tokenizer)

    @property
    def tokenizers(self) -> dict[str, Any]:
        """`tokenizer=` / `draft_tokenizer=` for prepare_draft when the draft has its own tokenizer, else nothing."""
        if self.draft_tokenizer is None:
            return {}
        return {"tokenizer": self.tokenizer, "draft_tokenizer": self.draft_tokenizer}

    def prepared(self, spec: MethodSpec) -> PreparedDraft:
        """The prepared draft of a SPECULATIVE method (frequent-token vocabularies are counted with the tokenizer).

        A draft with its own tokenizer is prepared with both tokenizers: the prepared draft holds them and the
        vocabulary they share, so no call builds it again (and none is timed doing so).
        """
        if spec.draft_options not in self._prepared:
            form = spec.draft_form or DraftForm.AUTO
            vocabulary = frequent_tokens(self.tokenizer, spec.draft_vocabulary) if spec.draft_vocabulary else None
            self._prepared[spec.draft_options] = prepare_draft(
                self.draft, self.target, form=form, vocabulary=vocabulary, **self.tokenizers
            )
        return self._prepared[spec.draft_options]

    def draft_input_ids(self, input_ids):
        """`(1, length)` target ids -> the same text in the draft's ids (for timing the draft on its own ids)."""
        if self.draft_tokenizer is None:
            return input_ids
        text = self.tokenizer.decode(input_ids[0], skip_special_tokens=False)
        return self.draft_tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]

    def generate_kwargs(self, spec: MethodSpec, mode: Mode | None = None) -> dict[str, Any]:
        """The arguments `spec`'s method adds to generate() in `mode` (default: sampling)."""
        mode = Mode.SAMPLING if mode is None else mode
        if spec.method is Method.ASSISTED:
            if self.draft_tokenizer is not None:  # transformers' universal assisted decoding
                return {"assistant_model": self.assistant(mode), "assistant_tokenizer": self.draft_tokenizer,
                        "tokenizer": self.tokenizer}  # fmt: skip
            return {"assistant_model": self.draft}
        if spec.method is Method.LOOKUP:
            return {"prompt_lookup_num_tokens": spec.lookup_tokens or DEFAULT_LOOKUP_TOKENS}
        if spec.method is Method.SPECULATIVE:
            drafter = self.prepared(spec) if spec.drafter is Drafter.MODEL else str(Drafter.PROMPT_LOOKUP)
            kwargs = {"draft_model": drafter, "num_lookahead": spec.num_lookahead, "return_dict_in_generate": True}
            if spec.speculative_config is not None:
                kwargs["speculative_config"] = spec.speculative_config
            if spec.lookup_tokens is not None:
                kwargs["prompt_lookup_num_tokens"] = spec.lookup_tokens
            return kwargs
        return {}


def sampling_kwargs(mode: Mode, temperature: float, top_p: float) -> dict[str, Any]:
    """Decoding arguments of a mode (all methods get the same)."""
    if mode is Mode.GREEDY:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": temperature, "top_p": top_p}


_NAMED_FIELDS = {  # name=value fields of an hf_specsample method -> (MethodSpec field, parser)
    "verify": ("verification", str),
    "processors": ("fast_processors", {"fast": True, "plain": False}.__getitem__),
    "lookup": ("lookup_tokens", int),
    "draft": ("drafter", Drafter),
    "shape": ("draft_shape", lambda value: str(DraftShape(value))),
}


def parse_methods(text: str) -> list[MethodSpec]:
    """`"target,assisted,lookup:10,hf_specsample,hf_specsample:4,hf_specsample:auto:as_given:32000"` -> specs.

    After `hf_specsample`, colon-separated: K (a number, or `auto`), the draft form (`auto`, `as_given`,
    `dynamic_int8`, `int8_weights`, `int4_weights`) and the draft vocabulary size (N most frequent tokens), then any
    of the named fields `verify=token` (or `block`), `processors=plain` (or `fast`), `lookup=N`
    (`prompt_lookup_num_tokens=N` with the model draft), `draft=prompt_lookup` and `shape=tree` (or `chain`). After
    `lookup` (transformers' prompt lookup): N.
    """
    specs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, *fields = item.split(":")
        named = dict(field.split("=", 1) for field in fields if "=" in field)
        unknown = set(named) - set(_NAMED_FIELDS)
        if unknown:
            raise ValueError(f"unknown method fields {sorted(unknown)} in {item!r}; known: {sorted(_NAMED_FIELDS)}")
        options = {_NAMED_FIELDS[key][0]: _NAMED_FIELDS[key][1](value) for key, value in named.items()}
        fields = [field for field in fields if "=" not in field]
        method = Method(name)
        if method is Method.LOOKUP:
            specs.append(MethodSpec(method, lookup_tokens=int(fields[0]) if fields and fields[0] else None))
            continue
        fields += [""] * (3 - len(fields))
        lookahead, form, vocabulary = fields[:3]
        specs.append(
            MethodSpec(
                method,
                int(lookahead) if lookahead and lookahead != "auto" else None,
                str(DraftForm(form)) if form else None,
                int(vocabulary) if vocabulary else None,
                **options,
            )
        )
    return specs
