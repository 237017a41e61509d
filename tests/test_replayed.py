"""Processors declared stateful (`SpeculativeConfig(stateful_processors=...)`, `sampling.stateful.ReplayedProcessor`):
replayed as plain decoding calls them, so a processor that counts its calls gives plain's greedy tokens and samples
distributed as plain's, where undeclared it silently gives other text; a batch is refused before any forward."""

from __future__ import annotations

import pytest
import torch
from exact import chisquare_pvalue, continuations, exact_distribution
from tiny import PAD, ForwardCounter, perturbed_copy, prepared_processors, tiny_lm
from transformers import LogitsProcessor, LogitsProcessorList

from hf_specsample import SpeculativeConfig

V = 10
ALPHA = 1e-3
PROMPT = torch.tensor([[1, 5, 6, 7]])


class CountingBan(LogitsProcessor):
    """Bans every row's argmax at every third call (calls 2, 5, 8, ...): a state that only the order of calls keeps."""

    def __init__(self):
        self.calls = 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        banned = self.calls % 3 == 2
        self.calls += 1
        if not banned:
            return scores
        return scores.scatter(1, scores.argmax(dim=1, keepdim=True), float("-inf"))


class LengthBan(LogitsProcessor):
    """What `CountingBan` does in plain decoding, as a function of the prefix: the ban at 2, 5, 8, ... new tokens."""

    def __init__(self, prompt_length: int):
        self.prompt_length = prompt_length

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if (input_ids.shape[1] - self.prompt_length) % 3 != 2:
            return scores
        return scores.scatter(1, scores.argmax(dim=1, keepdim=True), float("-inf"))


DECLARED = SpeculativeConfig(stateful_processors=(CountingBan,))
SHAPES = {
    "chain": DECLARED,
    "tree": SpeculativeConfig(stateful_processors=(CountingBan,), draft_shape="tree"),
}


@pytest.fixture(scope="module")
def models():
    target = tiny_lm(0, vocab_size=V, layers=2, hidden=32, init_range=1.0)
    return target, perturbed_copy(target, seed=3, scale=0.1)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_declared_counting_processor_gives_plain_greedy_tokens(models, shape):
    target, draft = models
    plain = target.generate(PROMPT, max_new_tokens=16, pad_token_id=PAD, logits_processor=[CountingBan()])
    kwargs = dict(max_new_tokens=16, pad_token_id=PAD, draft_model=draft, num_lookahead=4)
    ours = target.generate(PROMPT, logits_processor=[CountingBan()], speculative_config=SHAPES[shape], **kwargs)
    assert torch.equal(ours, plain)
    # the power check: undeclared, the same processor is called at draft positions and gives other text
    undeclared = target.generate(PROMPT, logits_processor=[CountingBan()], **kwargs)
    assert not torch.equal(undeclared, plain)


def samples(target, draft, rows: int, config: SpeculativeConfig | None) -> list[tuple[int, ...]]:
    generator = torch.Generator().manual_seed(11)
    out = []
    for _ in range(rows):  # one row per call: a declared processor is replayed for one row
        sequences = target.generate(
            PROMPT,
            do_sample=True,
            max_new_tokens=3,
            pad_token_id=PAD,
            logits_processor=[CountingBan()],
            draft_model=draft,
            num_lookahead=3,
            generator=generator,
            speculative_config=config,
        )
        out += continuations(sequences, PROMPT.shape[1])
    return out


def exact(target) -> dict[tuple[int, ...], float]:
    reference = LengthBan(PROMPT.shape[1])
    processors, _ = prepared_processors(target, PROMPT, do_sample=True, max_new_tokens=3, logits_processor=[reference])
    return exact_distribution(target, PROMPT, LogitsProcessorList(processors), 3)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_declared_samples_follow_plain_sampling(models, shape):
    """Chi-square of 600 samples of 3 tokens against plain sampling's distribution with the processor (its ban as a
    function of the prefix: `LengthBan`)."""
    target, draft = models
    assert chisquare_pvalue(exact(target), samples(target, draft, 600, SHAPES[shape])) > ALPHA


def test_undeclared_samples_fail_the_same_test(models):
    """The power check: called at draft positions, the counting processor bans at the wrong positions."""
    target, draft = models
    assert chisquare_pvalue(exact(target), samples(target, draft, 600, None)) < ALPHA


def test_a_batch_with_a_declared_processor_is_refused_before_any_forward(models):
    target, draft = models
    for prompt, extra in [(PROMPT.repeat(2, 1), {}), (PROMPT, dict(num_return_sequences=2, do_sample=True))]:
        with ForwardCounter(target, draft) as counter, pytest.raises(ValueError, match="once per row"):
            target.generate(
                prompt,
                max_new_tokens=4,
                pad_token_id=PAD,
                logits_processor=[CountingBan()],
                draft_model=draft,
                speculative_config=DECLARED,
                **extra,
            )
        assert counter.calls == 0


def test_a_declared_grammar_library_processor_is_replayed_not_refused(models):
    """A processor of a library no adapter drives is refused undeclared (`test_grammars.py`), replayed declared."""
    target, draft = models
    kind = type("StatefulGuide", (CountingBan,), {"__module__": "outlines.processors.structured"})
    kwargs = dict(max_new_tokens=12, pad_token_id=PAD, draft_model=draft)
    with pytest.raises(ValueError, match="outlines"):
        target.generate(PROMPT, logits_processor=[kind()], **kwargs)
    ours = target.generate(
        PROMPT, logits_processor=[kind()], speculative_config=SpeculativeConfig(stateful_processors=(kind,)), **kwargs
    )
    plain = target.generate(PROMPT, max_new_tokens=12, pad_token_id=PAD, logits_processor=[kind()])
    assert torch.equal(ours, plain)


def declared_call(target, draft, processor: LogitsProcessor, config: SpeculativeConfig) -> torch.Tensor:
    """A greedy `draft_model=` call of 8 tokens with `processor` under `config`."""
    return target.generate(
        PROMPT,
        max_new_tokens=8,
        pad_token_id=PAD,
        logits_processor=[processor],
        draft_model=draft,
        speculative_config=config,
    )


def test_a_declared_processor_that_cannot_be_copied_is_refused_before_any_forward(models):
    import threading

    target, draft = models
    locked = type("LockedCounter", (CountingBan,), {})
    processor = locked()
    processor.lock = threading.Lock()  # copy.deepcopy cannot copy a lock
    config = SpeculativeConfig(stateful_processors=(locked,))
    with ForwardCounter(target, draft) as counter, pytest.raises(ValueError, match="cannot copy"):
        declared_call(target, draft, processor, config)
    assert counter.calls == 0


def test_the_callers_processor_is_not_called(models):
    target, draft = models
    processor = CountingBan()
    declared_call(target, draft, processor, DECLARED)
    assert processor.calls == 0


@pytest.mark.parametrize("value", [CountingBan, (CountingBan(),), ("CountingBan",)])
def test_stateful_processors_takes_classes(value):
    with pytest.raises(TypeError, match="stateful_processors"):
        SpeculativeConfig(stateful_processors=value)
