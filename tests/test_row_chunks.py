"""A round verified in row chunks (`verify.verifier`, `draws.ROW_CHUNK_ELEMENTS`) gives what an unchunked
round gives: the same draws from the same generator, the same verdicts and tokens, and samples that follow the target
(chi-square, with power), greedy identical to plain `generate()`. A tiny threshold forces the chunks."""

import pytest
import torch
from exact import chisquare_pvalue, continuations, exact_distribution
from tiny import PAD, perturbed_copy, prepared_processors, tiny_lm
from transformers import LogitsProcessorList
from transformers.generation import logits_process as lp

from hf_specsample import SpeculativeConfig
from hf_specsample.cache.output_head import HeadLogits
from hf_specsample.core.draft_tree import DraftTree
from hf_specsample.sampling import draws
from hf_specsample.sampling.draws import round_chunks, row_chunks, sample_from_weights
from hf_specsample.sampling.processing import PositionwiseProcessor
from hf_specsample.verify import rules, verifier
from hf_specsample.verify.rules import Verdict, block_accept, speculative_accept
from hf_specsample.verify.verifier import Verifier

RULES = {"token": speculative_accept, "block": block_accept}
PROMPT = torch.tensor([[1, 5, 2, 5]])
NUM_TOKENS = 3
LOOKAHEAD = 2
SAMPLES = 10_000
ALPHA = 1e-3  # seeded: each verdict is deterministic; a correct sampler fails with probability ALPHA


def test_row_chunks_cover_the_rows_within_the_limit():
    assert row_chunks(10, 7, 21) == [slice(0, 3), slice(3, 6), slice(6, 9), slice(9, 10)]
    assert row_chunks(3, 100, 10) == [slice(0, 1), slice(1, 2), slice(2, 3)]  # a row wider than the limit: alone
    assert row_chunks(4, 5, 1000) == [slice(0, 4)]
    assert row_chunks(0, 5, 10) == []


def test_sample_from_weights_in_chunks_draws_what_one_call_draws():
    weights = torch.rand(37, 50, generator=torch.Generator().manual_seed(1))
    weights[weights < 0.3] = 0  # zero weights: never drawn
    weights[5] = 0  # a row of zeros: index 0
    unchunked, chunked = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    expected = sample_from_weights(weights, unchunked, chunk_elements=10**9)
    got = sample_from_weights(weights, chunked, chunk_elements=4 * 50 + 3)  # 4 rows a chunk, the last 1
    assert torch.equal(got, expected)
    assert torch.equal(torch.rand(3, generator=chunked), torch.rand(3, generator=unchunked))  # same draws used
    assert got.shape == (37,) and sample_from_weights(weights.view(37, 1, 50), chunk_elements=50).shape == (37, 1)


def _round(batch: int, lookahead: int, vocab: int, seed: int, mixed: bool, dense: bool):
    """Random target logits, draft tokens and the draft's distributions (some point masses where `mixed`)."""
    generator = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(batch, lookahead + 1, vocab, generator=generator)
    draft_probs = torch.softmax(3 * torch.randn(batch, lookahead, vocab, generator=generator), dim=-1)
    draft_tokens = torch.multinomial(draft_probs.view(-1, vocab), 1, generator=generator).view(batch, lookahead)
    point_mass = torch.rand(batch, lookahead, generator=generator) < 0.3 if mixed else None
    tokens = torch.randint(0, vocab, (batch, 20), generator=generator)
    return tokens, logits, draft_tokens, draft_probs if dense else None, point_mass


PROCESSORS = {
    "none": [],
    "top_p": [lp.TemperatureLogitsWarper(0.8), lp.TopPLogitsWarper(0.9)],
    "repetition_top_k": [lp.RepetitionPenaltyLogitsProcessor(1.5), lp.TopKLogitsWarper(7)],
}


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("draft", ["dense", "point_masses", "mixed"])
@pytest.mark.parametrize("processors", list(PROCESSORS))
@pytest.mark.parametrize("do_sample", [True, False])
def test_chunked_verification_matches_unchunked(rule, draft, processors, do_sample):
    """Verdicts, kept scores and the generator's state after the round: identical, chunk size for chunk size."""
    batch, lookahead, vocab = 13, 3, 50
    tokens, logits, draft_tokens, draft_probs, point_mass = _round(
        batch, lookahead, vocab, seed=3, mixed=draft == "mixed", dense=draft != "point_masses"
    )
    processor = PositionwiseProcessor(LogitsProcessorList(PROCESSORS[processors]), batch)
    lengths, callers = [10 + row % 3 for row in range(batch)], list(range(batch))
    results = []
    for chunk_elements in (10**9, (lookahead + 1) * vocab * 4, 1):  # one chunk; 4 rows a chunk; a row a chunk
        generator = torch.Generator().manual_seed(5)
        verify = Verifier(processor, do_sample, RULES[rule], generator, None, True, chunk_elements)
        before = logits.clone()
        chain = DraftTree.chain(draft_tokens)
        verdict, scores = verify(tokens, lengths, logits, callers, chain, draft_probs, point_mass)
        assert torch.equal(logits, before)  # the logits are not modified
        results.append((verdict, scores, torch.rand(4, generator=generator)))
    (verdict, scores, after), rest = results[0], results[1:]
    assert scores.shape == logits.shape
    for other_verdict, other_scores, other_after in rest:
        assert torch.equal(other_verdict.num_accepted, verdict.num_accepted)
        assert torch.equal(other_verdict.next_tokens, verdict.next_tokens)
        assert torch.equal(other_scores, scores)
        assert torch.equal(other_after, after)
    if not do_sample:
        assert torch.equal(after, torch.rand(4, generator=torch.Generator().manual_seed(5)))  # greedy draws nothing


def test_chunked_verification_flags_nonfinite_rows_in_their_chunk():
    batch, lookahead, vocab = 6, 2, 20
    tokens, logits, draft_tokens, draft_probs, _ = _round(batch, lookahead, vocab, seed=4, mixed=False, dense=True)
    logits[4, 0, 3] = float("nan")  # row 4's first position: used whatever is accepted
    processor = PositionwiseProcessor(LogitsProcessorList([]), batch)
    verify = Verifier(processor, True, speculative_accept, torch.Generator().manual_seed(0), None, False, 2 * 60)
    chain = DraftTree.chain(draft_tokens)
    verdict, scores = verify(tokens, [5] * batch, logits, list(range(batch)), chain, draft_probs, None)
    assert scores is None  # not kept unless recorded
    assert verdict.num_accepted[4] == int(rules.NonFinite.TARGET)
    assert (verdict.num_accepted[[0, 1, 2, 3, 5]] >= 0).all()


@pytest.fixture(scope="module")
def target():
    return tiny_lm(seed=0)


@pytest.fixture(scope="module")
def draft(target):
    return perturbed_copy(target, seed=1, scale=0.3)


@pytest.fixture
def tiny_chunks(monkeypatch):
    """Rows verified `rows` at a time (ragged last chunks; the draft samples `rows` x K + 1 rows a chunk), their
    logits made chunk by chunk from the target's hidden states (`cache.output_head.HeadLogits`)."""

    chunk_counts = []  # per verified round, its chunks
    made = []  # per chunk whose logits the target's head made when read
    read = HeadLogits.__getitem__

    def counted_read(self, rows):
        made.append(rows)
        return read(self, rows)

    def counted(*args):
        chunks = round_chunks(*args)
        chunk_counts.append(len(chunks))
        return chunks

    def force(vocab: int, rows: int = 7):
        monkeypatch.setattr(draws, "ROW_CHUNK_ELEMENTS", rows * (LOOKAHEAD + 1) * vocab + 1)
        monkeypatch.setattr(draws, "round_chunks", counted)
        monkeypatch.setattr(HeadLogits, "__getitem__", counted_read)

    force.chunk_counts = chunk_counts
    yield force
    assert chunk_counts and max(chunk_counts) > 1  # the rounds did come in chunks
    assert made  # and the chunks' logits were made when read


@pytest.mark.parametrize("verification", ["token", "block"])
def test_seeded_call_in_chunks_gives_the_tokens_of_one_chunk(target, draft, tiny_chunks, verification):
    ids = torch.tensor([[1, 5, 2, 5, 3], [PAD, PAD, 1, 3, 3], [PAD, 2, 2, 4, 1]] * 7)  # 21 ragged rows
    kwargs = dict(
        attention_mask=(ids != PAD).long(), do_sample=True, temperature=0.9, top_p=0.9, repetition_penalty=1.3,
        max_new_tokens=12, pad_token_id=PAD, draft_model=draft, num_lookahead=LOOKAHEAD,
        speculative_config=SpeculativeConfig(verification=verification),
    )  # fmt: skip
    whole = target.generate(ids, generator=torch.Generator().manual_seed(3), **kwargs)
    tiny_chunks(target.config.vocab_size)
    chunked = target.generate(ids, generator=torch.Generator().manual_seed(3), **kwargs)
    assert torch.equal(chunked, whole)


def test_greedy_in_chunks_is_plain_greedy(target, draft, tiny_chunks):
    ids = torch.tensor([[1, 5, 2, 5, 3], [PAD, PAD, 1, 3, 3], [PAD, 2, 2, 4, 1]] * 5)
    mask = (ids != PAD).long()
    plain = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12, pad_token_id=PAD)
    tiny_chunks(target.config.vocab_size)
    ours = target.generate(
        ids, attention_mask=mask, do_sample=False, max_new_tokens=12, pad_token_id=PAD, draft_model=draft,
        num_lookahead=LOOKAHEAD,
    )  # fmt: skip
    assert torch.equal(ours, plain)


def _samples(target, seed: int, **generate_kwargs) -> list:
    sequences = target.generate(
        PROMPT, do_sample=True, max_new_tokens=NUM_TOKENS, pad_token_id=PAD, num_return_sequences=SAMPLES,
        generator=torch.Generator().manual_seed(seed), num_lookahead=LOOKAHEAD, **generate_kwargs,
    )  # fmt: skip
    return continuations(sequences, PROMPT.shape[1], ())


def _exact(target, **settings):
    processors, _ = prepared_processors(target, PROMPT, do_sample=True, max_new_tokens=NUM_TOKENS, **settings)
    return exact_distribution(target, PROMPT, processors, NUM_TOKENS, ())


def _always_accept(draft_tokens, draft_probs, target_probs, generator=None, **draws):
    """A wrong rule: keeps every draft token, then a bonus token from the target (with the round's draws)."""
    batch, lookahead = draft_tokens.shape
    bonus = sample_from_weights(target_probs[:, -1], generator, draws.get("sample_draws"))
    return Verdict(torch.full((batch,), lookahead, dtype=torch.long), bonus)


@pytest.mark.parametrize("verification", ["token", "block"])
@pytest.mark.parametrize("setting", ["top_p", "repetition_penalty"])
def test_samples_in_chunks_follow_target(target, draft, tiny_chunks, verification, setting):
    """10,000 rows in one call, verified 333 rows at a time: the chi-square test of `test_distribution.py`."""
    settings = {"top_p": dict(top_p=0.8, temperature=0.9), "repetition_penalty": dict(repetition_penalty=1.8)}[setting]
    tiny_chunks(target.config.vocab_size, rows=333)
    config = SpeculativeConfig(verification=verification)
    samples = _samples(target, 21, draft_model=draft, speculative_config=config, **settings)
    assert chisquare_pvalue(_exact(target, **settings), samples) > ALPHA


@pytest.mark.parametrize("verification", ["token", "block"])
def test_the_chunked_test_rejects_a_wrong_rule(target, draft, tiny_chunks, monkeypatch, verification):
    name = "block_accept" if verification == "block" else "speculative_accept"
    monkeypatch.setattr(verifier, name, _always_accept)
    tiny_chunks(target.config.vocab_size, rows=333)
    config = SpeculativeConfig(verification=verification)
    samples = _samples(target, 22, draft_model=draft, speculative_config=config, top_p=0.8)
    assert chisquare_pvalue(_exact(target, top_p=0.8), samples) < 1e-6
