"""Seeded calls repeat, and the library draws nothing of its own.

A call draws exactly what its sampling needs, from the caller's `generator=` or else the global generator; nothing
the library does on its own (preparing a draft's forms, timings, the kernel's checks, warm-ups) draws from either.
So `torch.manual_seed(0)` + `generate()` gives the same tokens on a new draft's first call as on every later one,
and a greedy call leaves the global random state as plain `generate()` does. A sampling call's K never reads the
clock (a sampled text depends on K), and the timed choices (kernel routing, AUTO's form) are made once per model and
kept: two seeded calls sample alike whatever the clock reads.
"""

import random
import time

import pytest
import torch
from test_cross_tokenizer import DRAFT_TOKENS, TARGET_TOKENS, bpe_tokenizer
from tiny import PAD, FakeClock, perturbed_copy, tiny_lm

from hf_specsample import SpeculativeConfig, prepare_draft

PROMPT = torch.tensor([[1, 5, 9, 3, 7, 2, 8, 4, 6, 5, 9, 3, 7, 2, 8, 4, 6, 5, 9, 3]])  # 20 tokens: AUTO calibrates
SAMPLING = dict(do_sample=True, top_k=10, top_p=0.7, temperature=0.7)
FORMS = ("as_given", "dynamic_int8", "int8_weights", "int4_weights")
KERNEL_FORMS = ("int8_weights", "int4_weights")  # made only where the small-rows kernel builds


@pytest.fixture(scope="module")
def target():
    """hidden=128: the int4-weights form holds its linears as int4 (inputs in whole groups of 128)."""
    return tiny_lm(seed=0, vocab_size=16, layers=2, hidden=128, init_range=0.5)


@pytest.fixture(scope="module")
def tokenizers():
    return bpe_tokenizer(TARGET_TOKENS, [("a", "b"), ("c", "a")]), bpe_tokenizer(DRAFT_TOKENS, [("b", "c"), ("x", "a")])


@pytest.fixture(scope="module")
def cross_target():
    return tiny_lm(seed=0, vocab_size=len(TARGET_TOKENS), layers=2, hidden=32, init_range=0.5)


WAYS = ("model", "tree", "auto", "prompt_lookup", "other_tokenizer", "prepared", *(f"form={form}" for form in FORMS))


def new_call(way: str, request, target, tokenizers, cross_target):
    """(the target, a function that runs one `generate()` call with a draft made new for this test, given the way
    it is passed): each test's first call is the draft's first."""
    form = way.removeprefix("form=") if way.startswith("form=") else None
    if form in KERNEL_FORMS:
        request.getfixturevalue("built")
    draft = perturbed_copy(target, seed=1, scale=0.3)
    if way == "other_tokenizer":
        other = tiny_lm(seed=2, vocab_size=len(DRAFT_TOKENS), layers=1, hidden=16, init_range=0.5)
        prompt = torch.tensor([[1, 5, 3, 6, 3, 4, 5, 3, 6, 7, 4, 3, 5, 6, 3, 4]])
        arguments = dict(draft_model=other, tokenizer=tokenizers[0], draft_tokenizer=tokenizers[1])
        return cross_target, lambda **kwargs: cross_target.generate(prompt, **arguments, **kwargs)
    arguments = {
        "model": dict(draft_model=draft),
        "auto": dict(draft_model="auto"),
        "prompt_lookup": dict(draft_model="prompt_lookup"),
        "tree": dict(draft_model=draft, speculative_config=SpeculativeConfig(draft_shape="tree")),  # keyed draws
    }.get(way, dict(draft_model=draft, speculative_config=SpeculativeConfig(draft_form=form or "auto")))
    if way == "prepared":  # prepared inside the call: preparing draws nothing either
        return target, lambda **kwargs: target.generate(
            PROMPT, draft_model=prepare_draft(draft, target, calibration=PROMPT[0]), **kwargs
        )
    if way == "auto":  # "auto" is kept per target: a new target makes the call the first
        target = tiny_lm(seed=0, vocab_size=16, layers=2, hidden=128, init_range=0.5)
    return target, lambda **kwargs: target.generate(PROMPT, **arguments, **kwargs)


def call(run, **kwargs):
    return run(max_new_tokens=24, pad_token_id=PAD, **kwargs)


@pytest.mark.parametrize("way", WAYS)
def test_seeded_calls_repeat_from_a_new_drafts_first_call(way, request, target, tokenizers, cross_target):
    _, run = new_call(way, request, target, tokenizers, cross_target)
    torch.manual_seed(0)
    first = call(run, **SAMPLING)
    torch.manual_seed(0)
    again = call(run, **SAMPLING)
    assert torch.equal(first, again)


@pytest.mark.parametrize("way", WAYS)
def test_generator_calls_repeat_and_leave_the_global_state_alone(way, request, target, tokenizers, cross_target):
    _, run = new_call(way, request, target, tokenizers, cross_target)
    state = torch.get_rng_state()
    first = call(run, generator=torch.Generator().manual_seed(0), **SAMPLING)
    again = call(run, generator=torch.Generator().manual_seed(0), **SAMPLING)
    assert torch.equal(first, again)
    assert torch.equal(torch.get_rng_state(), state)  # every draw came from the caller's generator


@pytest.mark.parametrize("way", WAYS)
def test_greedy_calls_leave_the_global_state_alone(way, request, target, tokenizers, cross_target):
    model, run = new_call(way, request, target, tokenizers, cross_target)
    state = torch.get_rng_state()
    call(run, do_sample=False)
    assert torch.equal(torch.get_rng_state(), state)


def erratic(seed: int):
    """Readings 1 us to 100 ms apart, at random."""
    pick = random.Random(seed)
    while True:
        yield 10 ** pick.uniform(-6, -1)


def test_seeded_calls_sample_alike_whatever_the_clock_reads(target, monkeypatch):
    """The adaptive K (the default), the draft's form and the kernel routings decided under two clocks that read
    nothing alike: the draft's first call on an even clock, the second on an erratic one."""
    draft = perturbed_copy(target, seed=1, scale=0.3)
    runs = []
    for clock in (FakeClock(1e-3), FakeClock(erratic(1))):
        with monkeypatch.context() as patch:
            patch.setattr(time, "perf_counter", clock)
            torch.manual_seed(0)
            runs.append(target.generate(PROMPT, draft_model=draft, max_new_tokens=40, pad_token_id=PAD, **SAMPLING))
    assert torch.equal(runs[0], runs[1])
