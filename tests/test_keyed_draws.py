"""Keyed draws (`sampling.draws`): a seeded tree call's text depends on the seed and the target alone.

- the uniforms: bit for bit a plain-Python splitmix64 (64-bit wrap-around, logical shifts), in [0, 1), uniform
  (chi-square of binned values over a million (row, position) pairs) and independent (chi-square of the joint bins of
  pairs at adjacent positions, at adjacent rows, and under adjacent keys); the same tests reject a linear counter
  stream (power);
- end to end: one seed (`generator=` and `torch.manual_seed`), several drafts (a close perturbed copy, a far random
  model, the target itself) and shapes (the default tree, a chain, a star, a tree cut by `num_lookahead=2`) give the
  same tokens, one row and ragged batches (left-padded, and a prompt ending in padding: a first round of K = 0),
  with temperature, top-p and repetition penalty;
- the key: exactly one draw from the call's generator, none for greedy (`tests/test_seeded.py`: the global state);
- a tree call's rounds that draft nothing (K = 0) draw their token with its keyed uniform (`Verifier`).

Exactness stays: `tests/test_trees.py`'s chi-square tests (10,000 rows, each its own caller index) run on these
draws, and its wrong rule still fails.
"""

import random

import numpy as np
import pytest
import torch
from scipy import stats
from test_architectures import batch
from tiny import PAD, perturbed_copy, tiny_lm
from transformers import LogitsProcessorList

from hf_specsample import DynamicTree, SpeculativeConfig, TreeShape
from hf_specsample.core.draft_tree import DraftTree
from hf_specsample.sampling.draws import call_key, keyed_uniforms, mix64, positions_from, sample_from_weights
from hf_specsample.sampling.processing import PositionwiseProcessor, probabilities
from hf_specsample.verify.rules import block_accept, speculative_accept
from hf_specsample.verify.verifier import Verifier

RULES = {"token": speculative_accept, "block": block_accept}
ALPHA = 1e-3
MASK = (1 << 64) - 1


def reference_mix(value: int) -> int:
    """splitmix64's finalizer on unsigned 64-bit Python ints."""
    value &= MASK
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & MASK
    return value ^ (value >> 31)


def reference_uniform(key: int, row: int, position: int) -> float:
    counter = (row << 32) | position
    mixed = reference_mix(reference_mix(counter ^ key) ^ (key ^ 0x9E3779B97F4A7C15))
    return (mixed >> 11) * 2.0**-53


def test_uniforms_match_a_plain_python_reference():
    pick = random.Random(0)
    values = [pick.getrandbits(64) for _ in range(2000)] + [0, 1, (1 << 63) - 1, 1 << 63, MASK]
    signed = torch.tensor([value - (1 << 64) if value >> 63 else value for value in values])
    assert [value & MASK for value in mix64(signed).tolist()] == [reference_mix(value) for value in values]
    key = call_key(torch.Generator().manual_seed(3))
    rows = torch.tensor([0, 1, 5, 2**31 - 1])
    positions = torch.tensor([[0, 1, 2], [7, 8, 9], [100, 2**32 - 1, 3], [5, 6, 7]])
    got = keyed_uniforms(key, rows, positions)
    assert got.shape == (4, 3, 1) and got.dtype == torch.float64
    want = [[reference_uniform(key, row, p) for p in row_positions] for row, row_positions in
            zip(rows.tolist(), positions.tolist())]  # fmt: skip
    assert got[..., 0].tolist() == want
    assert torch.equal(positions_from([4, 9], 3, torch.device("cpu")), torch.tensor([[4, 5, 6], [9, 10, 11]]))


def grid(key: int, rows: int = 1000, positions: int = 1000) -> np.ndarray:
    """`(rows, positions)` the uniforms of caller rows 0.. at buffer positions 0..."""
    return keyed_uniforms(key, torch.arange(rows), torch.arange(positions).expand(rows, -1))[..., 0].numpy()


def uniform_pvalue(values: np.ndarray, bins: int = 100) -> float:
    return float(stats.chisquare(np.bincount((values * bins).astype(int).ravel(), minlength=bins)).pvalue)


def pairs_pvalue(first: np.ndarray, second: np.ndarray, bins: int = 20) -> float:
    """Chi-square of the joint bins of (first, second) against independent uniforms (bins x bins equal cells)."""
    cells = (first * bins).astype(int) * bins + (second * bins).astype(int)
    return float(stats.chisquare(np.bincount(cells.ravel(), minlength=bins * bins)).pvalue)


def weyl(key: int, rows: int = 1000, positions: int = 1000) -> np.ndarray:
    """A linear counter stream, frac(key + counter x golden ratio): uniform values, dependent neighbours."""
    counters = np.arange(rows)[:, None] * positions + np.arange(positions)[None, :]
    return np.modf(key * 1e-9 + counters * 0.6180339887498949)[0]


@pytest.mark.parametrize("stream", ["keyed", "weyl"])
def test_uniform_and_independent_at_adjacent_positions_rows_and_keys(stream):
    """A million (row, position) pairs: uniform in 100 bins; pairs at adjacent positions, adjacent rows and adjacent
    keys independent in 20 x 20 bins. A linear counter stream passes the first and fails the others (power)."""
    key = call_key(torch.Generator().manual_seed(0))
    values, other_key = (grid(key), grid(key + 1)) if stream == "keyed" else (weyl(key), weyl(key + 1))
    assert values.min() >= 0.0 and values.max() < 1.0
    assert uniform_pvalue(values) > ALPHA
    neighbours = [
        pairs_pvalue(values[:, :-1], values[:, 1:]),  # the same row, the next position
        pairs_pvalue(values[:-1], values[1:]),  # the next row, the same position
        pairs_pvalue(values, other_key),  # the next key
    ]
    if stream == "keyed":
        assert min(neighbours) > ALPHA, neighbours
    else:
        assert max(neighbours) < ALPHA, neighbours


def test_a_call_draws_one_key_and_greedy_none():
    target = tiny_lm(seed=0, vocab_size=16)
    draft = perturbed_copy(target, seed=1, scale=0.3)
    prompt = torch.tensor([[1, 5, 2, 5]])
    config = SpeculativeConfig(draft_shape="tree", draft_form="as_given")
    for do_sample, draws in ((True, 1), (False, 0)):
        generator, expected = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
        target.generate(prompt, do_sample=do_sample, max_new_tokens=12, pad_token_id=PAD, draft_model=draft,
                        speculative_config=config, generator=generator)  # fmt: skip
        for _ in range(draws):
            call_key(expected)
        assert torch.equal(generator.get_state(), expected.get_state()), do_sample


@pytest.mark.parametrize("rule", ["token", "block"])
def test_a_round_of_nothing_draws_its_token_with_the_given_uniforms(rule):
    """A keyed `Verifier`'s chain of nothing (a tree call's K = 0 round): the token is the inverse-CDF draw of the
    row's keyed uniform at its position, in one chunk or a row a chunk, and the generator is not touched."""
    batch, vocab = 6, 9
    generator = torch.Generator().manual_seed(1)
    logits = 2 * torch.randn(batch, 1, vocab, generator=generator)
    key = call_key(generator)
    draws = keyed_uniforms(key, torch.arange(batch), positions_from([5] * batch, 1, logits.device))
    draws = draws[:, 0]  # (batch, 1)
    expected = sample_from_weights(probabilities(logits[:, 0]), uniform=draws)
    processor = PositionwiseProcessor(LogitsProcessorList([]), batch)
    for chunk_elements in (10**9, 1):
        used = torch.Generator().manual_seed(2)
        verify = Verifier(processor, True, RULES[rule], used, key, False, chunk_elements)
        empty = torch.zeros((batch, 0), dtype=torch.long)
        verdict, _ = verify(empty, [5] * batch, logits, list(range(batch)), DraftTree.chain(empty))
        assert torch.equal(verdict.next_tokens, expected) and not verdict.num_accepted.any()
        assert torch.equal(used.get_state(), torch.Generator().manual_seed(2).get_state())


# --- end to end: the draft does not matter ---------------------------------------------------------------------------

SETTINGS = dict(do_sample=True, temperature=0.8, top_p=0.9, repetition_penalty=1.3, max_new_tokens=16)
STAR = TreeShape.from_paths([(0,), (1,), (2,), (3,)])
SHAPES = {
    "default": ("tree", None),
    "chain": (TreeShape.chain(3), None),
    "star": (STAR, None),
    "cut": ("tree", 2),
    "dynamic": ("dynamic", None),
    "narrow dynamic": (DynamicTree(nodes=4, expand=3), 3),
}
ROWS = [[1, 5, 9, 13, 17, 21, 25], [1, 7, 3], [1, 30, 31, 32, 33]]
INPUTS = {
    "one row": batch(ROWS[:1]),
    "left-padded": batch(ROWS),
    "ends in padding": batch(ROWS, side="right"),  # the first round drafts nothing (K = 0)
}


@pytest.fixture(scope="module")
def models():
    target = tiny_lm(seed=0, vocab_size=48)
    drafts = {"close": perturbed_copy(target, seed=1, scale=0.3), "far": tiny_lm(seed=2, vocab_size=48), "self": target}
    return target, drafts


@pytest.mark.parametrize("seeding", ["generator", "manual_seed"])
@pytest.mark.parametrize("inputs", sorted(INPUTS))
def test_one_seed_gives_one_text_whatever_the_draft_and_the_shape(models, inputs, seeding):
    target, drafts = models
    ids, mask = INPUTS[inputs]
    texts, rounds_of_nothing = {}, 0
    for draft_name, draft in drafts.items():
        for shape_name, (shape, num_lookahead) in SHAPES.items():
            config = SpeculativeConfig(draft_shape=shape, draft_form="as_given")
            seed = {"generator": torch.Generator().manual_seed(7)} if seeding == "generator" else {}
            if seeding == "manual_seed":
                torch.manual_seed(7)
            out = target.generate(
                ids, attention_mask=mask, pad_token_id=PAD, draft_model=draft, speculative_config=config,
                num_lookahead=num_lookahead, return_dict_in_generate=True, **seed, **SETTINGS,
            )  # fmt: skip
            texts[draft_name, shape_name] = out.sequences
            rounds_of_nothing += out.speculative_stats.lookahead_per_round.count(0)
    first = next(iter(texts.values()))
    assert all(torch.equal(text, first) for text in texts.values()), [k for k, t in texts.items() if not t.equal(first)]
    if inputs == "ends in padding":  # the keyed draw of a round that drafts nothing was taken
        assert rounds_of_nothing >= len(texts)
    # a different seed gives a different text (the key is the seed's)
    other = target.generate(ids, attention_mask=mask, pad_token_id=PAD, draft_model=drafts["close"],
                            speculative_config=SpeculativeConfig(draft_shape="tree", draft_form="as_given"),
                            generator=torch.Generator().manual_seed(8), **SETTINGS)  # fmt: skip
    assert not torch.equal(other, first)
