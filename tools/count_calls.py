"""How many library files and functions one `generate(draft_model=...)` call enters: a measure of how many places a
reader must visit to follow a call (issue 53's goal: a chain call at most 20 files and 170 functions, a tree call at
most 2 files and 25 functions more than a chain call).

    PYTHONPATH=. python tools/count_calls.py   # from the repository root (or with the library installed)

Tiny random Llama target and draft built from configs (as the tests build them), 8 new tokens, the draft as given,
the small-rows kernel off, greedy and sampling, chains and trees. Each call is made twice and the second one counted
(the first warms caches up: the implicit prepared draft, kernel routing, compiled code), with `sys.setprofile`:
every Python function of `hf_specsample/` entered at least once, by its file and qualified name (a comprehension
or a lambda counts as part of the function holding it).
`tests/test_structure.py` asserts the goals with it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_specsample

LIBRARY = Path(__file__).resolve().parents[1] / "hf_specsample"


def entered(call: Callable[[], Any]) -> set[tuple[str, str]]:
    """The library's (file, function) pairs `call` enters, as `sys.setprofile` sees Python calls."""
    seen: set[tuple[str, str]] = set()
    root = str(LIBRARY)

    def profile(frame, event, arg):  # noqa: ARG001 (sys.setprofile's signature)
        if event == "call":
            code = frame.f_code
            # comprehensions and lambdas are parts of the function that holds them (Python 3.12 inlines the former)
            if code.co_filename.startswith(root) and not code.co_name.startswith("<"):
                seen.add((code.co_filename, code.co_qualname))

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return seen


def count_calls(call: Callable[[], Any]) -> tuple[int, int]:
    """`(files, functions)` of the library that the second of two runs of `call` enters."""
    call()
    seen = entered(call)
    return len({filename for filename, _ in seen}), len(seen)


def tiny_pair() -> tuple[Any, Any]:
    """A tiny random Llama target (2 layers) and a perturbed copy as its draft, float32, vocabulary 64."""
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(0)
    target = LlamaForCausalLM(config).eval()
    draft = LlamaForCausalLM(config).eval()
    draft.load_state_dict(target.state_dict())
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return target, draft


def call_of(target: Any, draft: Any, do_sample: bool, shape: str) -> Callable[[], Any]:
    """One call of 8 new tokens on a 2-row prompt: greedy or sampling, `draft_shape=shape`."""
    prompt = torch.tensor([[5, 17, 42, 9, 33, 2], [7, 8, 15, 16, 23, 42]])
    config = hf_specsample.SpeculativeConfig(draft_shape=shape, linear_kernel="off")
    generator = torch.Generator().manual_seed(0)

    def call() -> Any:
        return target.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=8,
            do_sample=do_sample,
            pad_token_id=0,
            draft_model=draft,
            generator=generator,
            speculative_config=config,
        )

    return call


def table() -> dict[tuple[str, str], tuple[int, int]]:
    """`(files, functions)` per (mode, shape)."""
    target, draft = tiny_pair()
    return {
        (mode, shape): count_calls(call_of(target, draft, mode == "sampling", shape))
        for mode in ("greedy", "sampling")
        for shape in ("chain", "tree")
    }


def main() -> None:
    """Prints the table; with `--json`, one JSON object {"mode shape": [files, functions]} (`tests/test_structure.py`
    reads it from a fresh process: what a call enters depends on what the process ran before)."""
    counts = table()
    if "--json" in sys.argv[1:]:
        print(json.dumps({f"{mode} {shape}": list(pair) for (mode, shape), pair in counts.items()}))
        return
    print(f"{'mode':10} {'shape':6} {'files':>6} {'functions':>10}")
    for (mode, shape), (files, functions) in counts.items():
        print(f"{mode:10} {shape:6} {files:6d} {functions:10d}")


if __name__ == "__main__":
    main()
