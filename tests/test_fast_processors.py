"""Sort-free processors keep exactly the tokens transformers' own processors keep (random, tied, boundary logits)."""

import pytest
import torch
from transformers.generation import logits_process as lp

from hf_specsample.sampling import fast_processors
from hf_specsample.sampling.fast_processors import fast_top_p, fast_typical

NO_IDS = torch.empty((0, 0), dtype=torch.long)


def random_logits(rows: int, vocab: int, scale: float, seed: int) -> torch.Tensor:
    return torch.randn((rows, vocab), generator=torch.Generator().manual_seed(seed)) * scale


def tied_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Few distinct values: ties everywhere, the nucleus boundary often between equal scores."""
    return torch.randint(0, 6, (rows, vocab), generator=torch.Generator().manual_seed(seed)).float()


def boundary_logits(vocab: int) -> torch.Tensor:
    """Rows whose cumulative mass hits 1 - top_p exactly in exact arithmetic (quarters, eighths, halves)."""
    rows = []
    for top in (2, 4, 8):
        row = torch.full((vocab,), -float("inf"))
        row[:top] = 0.0
        rows.append(row)
    return torch.stack(rows)


def fast_version(warper):
    """The sort-free function that stands for `warper` (transformers' top-p or typical warper)."""
    return fast_typical if isinstance(warper, lp.TypicalLogitsWarper) else fast_top_p


def assert_same(warper, scores):
    expected = warper(torch.empty((scores.shape[0], 0), dtype=torch.long), scores)
    got = fast_version(warper)(warper, scores)
    assert bool(((got == expected) | (got.isnan() & expected.isnan())).all())  # bit for bit, NaN where NaN


def assert_settled_without_sorting(monkeypatch, warper, scores):
    """Every row of `scores` settled by the candidates: the fallback (transformers' own warper) is never called."""
    calls = []
    original = type(warper).__call__
    with monkeypatch.context() as patch:
        patch.setattr(type(warper), "__call__", lambda self, *a: calls.append(1) or original(self, *a))
        fast_version(warper)(warper, scores)
    assert calls == []


def assert_same_on_random_tied_and_boundary_rows(warper):
    for seed, scale in enumerate([0.5, 2.0, 4.0, 8.0]):
        assert_same(warper, random_logits(16, 2048, scale, seed))
    assert_same(warper, tied_logits(16, 512, seed=7))
    assert_same(warper, boundary_logits(256))


def after_temperature_and_top_k() -> torch.Tensor:
    """The usual chain before a sorting warper: temperature 0.7, then top-k 20 (-inf outside)."""
    scores = random_logits(32, 4096, 3.0, seed=1)
    return lp.TopKLogitsWarper(20)(NO_IDS, lp.TemperatureLogitsWarper(0.7)(NO_IDS, scores))


@pytest.mark.parametrize("top_p", [0.0, 0.1, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0])
@pytest.mark.parametrize("min_keep", [1, 3])
def test_top_p_random_and_tied(top_p, min_keep):
    assert_same_on_random_tied_and_boundary_rows(lp.TopPLogitsWarper(top_p, min_tokens_to_keep=min_keep))


def test_top_p_after_top_k_and_temperature():
    """The usual chain: temperature, then top-k (-inf outside), then top-p."""
    scores = after_temperature_and_top_k()
    for top_p in (0.8, 0.95):
        assert_same(lp.TopPLogitsWarper(top_p), scores)


def qwen_sized_and_nonfinite_rows() -> torch.Tensor:
    """A Qwen-sized row (151,936), a flat row (the kept set beyond every candidate size), NaN and all -inf rows."""
    scores = random_logits(4, 151_936, 3.0, seed=2)
    scores[1] = 0.0
    scores[2, 5] = float("nan")
    scores[3] = -float("inf")
    scores[3, 9] = 1.0
    return scores


def test_top_p_large_vocabulary_and_nonfinite_rows():
    assert_same(lp.TopPLogitsWarper(0.95), qwen_sized_and_nonfinite_rows())


def test_the_fast_path_is_taken_and_the_test_can_fail(monkeypatch):
    """Peaked rows are settled by the candidates (no fallback), and a wrong keep count is caught by the comparison."""
    warper = lp.TopPLogitsWarper(0.9)
    scores = random_logits(8, 4096, 4.0, seed=3)
    assert_settled_without_sorting(monkeypatch, warper, scores)
    counts = fast_processors.top_p_keep_counts
    monkeypatch.setattr(fast_processors, "top_p_keep_counts", lambda *a: torch.clamp(counts(*a) + 1, min=-1))
    with pytest.raises(AssertionError):
        assert_same(warper, scores)


# --- typical sampling (sorts by |-log p - H|) ---


@pytest.mark.parametrize("mass", [0.01, 0.2, 0.5, 0.9, 0.95, 0.99])
@pytest.mark.parametrize("min_keep", [1, 3])
def test_typical_random_and_tied(mass, min_keep):
    assert_same_on_random_tied_and_boundary_rows(lp.TypicalLogitsWarper(mass, min_tokens_to_keep=min_keep))


def test_typical_after_top_k_and_temperature_and_nonfinite_rows():
    scores = after_temperature_and_top_k()
    for mass in (0.5, 0.9):
        assert_same(lp.TypicalLogitsWarper(mass), scores)
    assert_same(lp.TypicalLogitsWarper(0.9), qwen_sized_and_nonfinite_rows())


def test_typical_fast_path_is_taken_and_the_test_can_fail(monkeypatch):
    """Peaked rows are settled by the candidates, and a threshold one position off is caught by the comparison."""
    warper = lp.TypicalLogitsWarper(0.9)
    scores = random_logits(8, 4096, 8.0, seed=3)
    assert_settled_without_sorting(monkeypatch, warper, scores)
    thresholds = fast_processors.typical_thresholds

    def one_further(shifts, *rest):
        found, settled = thresholds(shifts, *rest)
        return shifts[:, 1:].gather(1, (shifts[:, :-1] >= found[:, None]).long().argmax(1, keepdim=True))[:, 0], settled

    monkeypatch.setattr(fast_processors, "typical_thresholds", one_further)
    with pytest.raises(AssertionError):
        assert_same(warper, scores)


# --- through generate(): a vocabulary wider than the first candidate count, so the sort-free path really runs ---

WIDE_VOCAB = 160  # > CANDIDATES[0]
TOP_P_SETTINGS = dict(temperature=0.8, top_p=0.9)


@pytest.fixture(scope="module")
def wide_pair():
    from tiny import perturbed_copy, tiny_lm

    target = tiny_lm(seed=0, vocab_size=WIDE_VOCAB, hidden=32, init_range=0.6)
    return target, perturbed_copy(target, seed=1, scale=0.3)


SORT_FREE = {  # settings -> (the pure function that settles rows, the warper transformers builds last)
    "top_p": (TOP_P_SETTINGS, "top_p_keep_counts", lp.TopPLogitsWarper),
    "typical_p": (dict(temperature=0.8, typical_p=0.9), "typical_thresholds", lp.TypicalLogitsWarper),
}


@pytest.mark.parametrize("kind", sorted(SORT_FREE))
def test_sampling_with_sort_free_warpers_is_exact(wide_pair, monkeypatch, kind):
    from exact import sampled_pvalue

    target, draft = wide_pair
    settings, name, _ = SORT_FREE[kind]
    settled = []
    original = getattr(fast_processors, name)

    def recording(*args):
        result = original(*args)
        settled.append(result if isinstance(result, torch.Tensor) and result.dtype == torch.long else result[1])
        return result

    monkeypatch.setattr(fast_processors, name, recording)
    p = sampled_pvalue(
        target, torch.tensor([[1, 17, 42, 5]]), num_tokens=2, rows=4000, seed=3, settings=settings,
        draft_model=draft, num_lookahead=2,
    )  # fmt: skip
    assert p > 1e-3
    settled = torch.cat(settled)
    settled = settled >= 0 if settled.dtype == torch.long else settled
    assert settled.float().mean() > 0.5, "the sort-free path was hardly used: the test would not test it"


@pytest.mark.parametrize("kind", sorted(SORT_FREE))
def test_scores_equal_plain_generate_bit_for_bit(wide_pair, kind):
    """The processed scores returned with the output are transformers' own, position by position."""
    from tiny import PAD, prepared_processors

    target, draft = wide_pair
    settings, _, last_warper = SORT_FREE[kind]
    prompt = torch.tensor([[1, 17, 42, 5], [1, 3, 9, 11]])
    kwargs = dict(
        do_sample=True, max_new_tokens=12, pad_token_id=PAD, return_dict_in_generate=True, output_scores=True,
        output_logits=True, **settings,
    )  # fmt: skip
    out = target.generate(
        prompt, draft_model=draft, num_lookahead=3, generator=torch.Generator().manual_seed(0), **kwargs
    )
    warpers, _ = prepared_processors(target, prompt, do_sample=True, max_new_tokens=12, **settings)
    assert [type(w) for w in warpers][-1] is last_warper  # (after transformers' default top_k=50)
    no_ids = torch.empty((prompt.shape[0], 0), dtype=torch.long)
    for logits, scores in zip(out.logits, out.scores):
        expected = warpers(no_ids, logits.clone())
        assert torch.equal(scores, expected)
