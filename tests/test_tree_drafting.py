"""Tree drafting by a draft model (issue 45): one draft forward per level with the tree mask, children = the top
distinct choices of the draft's processed scores at each parent, equal to a slow reference (a plain forward per
path, processors with the path's prefix, top-k by hand); the draft's cache after compaction serves the next round."""

import pytest
import torch
from test_tree_forward import MIXED, accept, committed_tokens, new_cache, padded_batch, path_nodes, tiny_model
from tiny import PAD, prepared_processors

from hf_specsample.cache.forwards import Forwards
from hf_specsample.core.model_facts import ModelFacts
from hf_specsample.options import TreeShape
from hf_specsample.proposers.base import DraftBudget
from hf_specsample.proposers.draft_model import DraftModelProposer, DraftVocabulary
from hf_specsample.sampling.processing import PositionwiseProcessor

VOCAB = 32
PROCESSORS = {
    "none": {},
    "sampling": dict(do_sample=True, temperature=0.7, top_k=12, top_p=0.95),
    "prefix": dict(do_sample=True, repetition_penalty=1.5, no_repeat_ngram_size=2, temperature=1.3),
    # half the vocabulary is EOS, forbidden below 10 tokens: at the root and depths 1-2 of the first round only
    "length": dict(min_new_tokens=3, eos_token_id=list(range(3, 19))),
}


SUBSET = torch.arange(8, VOCAB)  # a draft vocabulary of the ids 8.. (an FR-Spec subset), logit column i for id i


def proposer_for(model, sequences, processors, subset=None, cache=None) -> DraftModelProposer:
    return DraftModelProposer(
        ModelFacts.of(model), Forwards(), DraftVocabulary(subset, subset, VOCAB), sequences,
        PositionwiseProcessor(processors, sequences.num_active), do_sample=False, cache=cache,
    )  # fmt: skip


def drafting_setup(attention: str, settings: dict, processing: str, padding: list[int], subset, cache: str):
    """The slow-reference tests' start: the draft (`tiny_model(attention, seed=3)`), 7-token prompts left-padded by
    `padding` (from a generator seeded 7, returned for the test's own draws), the processors `generate()` builds for
    `settings[processing]`, and the proposer on a `cache` ("dynamic" or "static"), which runs vocabulary-free
    processing on a `subset` (`compact`). Returns (model, generator, sequences, processors, proposer)."""
    model = tiny_model(attention, seed=3)
    generator = torch.Generator().manual_seed(7)
    sequences = padded_batch(generator, len(padding), 7, padding)
    processors, _ = prepared_processors(
        model, sequences.tokens[:, :7], pad_token_id=PAD, max_new_tokens=5, **settings[processing]
    )
    proposer = proposer_for(model, sequences, processors, subset, new_cache(model, cache))
    assert proposer.compact == (subset is not None and processing in ("none", "sampling"))
    return model, generator, sequences, processors, proposer


@torch.no_grad()
def reference_scores(model, processors, sequences, row, path, subset=None) -> torch.Tensor:
    """`(vocab,)` the draft's processed scores after row `row`'s committed tokens and `path`: a plain forward of the
    real tokens, the processors called as plain `generate()` calls them (the prompt's padding included, the row at
    its index in the batch); with a `subset`, the draft's logits stand for those ids only."""
    length = sequences.lengths[row]
    logits = model(input_ids=torch.tensor([committed_tokens(sequences, row) + path])).logits[:, -1].float()
    if subset is not None:  # the draft proposes only the subset's ids
        logits = torch.full_like(logits, float("-inf")).index_copy_(1, subset, logits[:, subset])
    ids = torch.cat([sequences.tokens[row, :length], torch.tensor(path, dtype=torch.long)])
    # the whole batch, this row at its index (a padded batch's repetition penalty holds one prompt length per row)
    batch_ids, batch_scores = (
        ids.new_zeros((sequences.num_active, ids.numel())),
        logits.new_zeros((sequences.num_active, VOCAB)),
    )
    batch_ids[row], batch_scores[row] = ids, logits[0]
    return processors(batch_ids, batch_scores)[row]


def assert_tree_is_the_reference(model, processors, sequences, shape: TreeShape, tokens, subset=None) -> None:
    """Every parent's children are its reference choices at their ranks (a stable sort of the reference scores; a
    child the processors ruled out, of score -inf, may be any such token), and siblings are distinct."""
    for row in range(sequences.num_active):
        for parent in [-1, *range(shape.num_nodes)]:
            kids = [(node, rank) for node, (p, rank) in enumerate(zip(shape.parents, shape.ranks)) if p == parent]
            if not kids:
                continue
            path = tokens[row, path_nodes(shape, parent)].tolist() if parent >= 0 else []
            scores = reference_scores(model, processors, sequences, row, path, subset)
            best = torch.sort(scores, descending=True, stable=True)
            for node, rank in kids:
                token = int(tokens[row, node])
                if best.values[rank] > float("-inf"):
                    assert token == int(best.indices[rank]), (row, parent, rank)
                else:
                    assert scores[token] == float("-inf"), (row, parent, rank)
            got = [int(tokens[row, node]) for node, _ in kids]
            assert len(set(got)) == len(got)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("processing", list(PROCESSORS))
@pytest.mark.parametrize("padding", [[0], [3, 0]], ids=["one_row", "two_rows"])
@pytest.mark.parametrize("subset", [None, SUBSET], ids=["full_vocabulary", "subset"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@torch.no_grad()
def test_tree_drafts_equal_the_slow_reference_round_after_round(attention, processing, padding, subset, cache):
    """Three rounds of drafting the default shape, each followed by a ragged accepted path (a leaf the draft never
    fed, an inner node, nothing), compaction and the loop's rollback: every round's tree is the reference's. With a
    vocabulary subset, vocabulary-free processing runs on the subset (`compact`), the rest over the spread logits."""
    model, generator, sequences, processors, proposer = drafting_setup(
        attention, PROCESSORS, processing, padding, subset, cache
    )
    shape = MIXED
    endings = [[15, 1], [2, -1], [8, 13]]
    for ends in endings:
        before = proposer.forward_passes
        proposal = proposer.get_candidates(sequences, DraftBudget(0, 0, shape))
        assert proposal.model_steps == shape.max_depth == proposer.forward_passes - before
        assert_tree_is_the_reference(model, processors, sequences, shape, proposal.tree.tokens, subset)
        held = proposer.runner.fed
        inner = sum(1 for node in range(shape.num_nodes) if node in shape.parents)
        assert held == [length + inner for length in sequences.lengths]  # committed, then every inner node
        bonus = torch.randint(3, VOCAB, (len(padding),), generator=generator).tolist()
        path, counts = accept(sequences, proposal.tree, shape, ends[: len(padding)], bonus)
        proposer.model.keep_path(path, counts)
        proposer.rollback_to_committed(sequences.lengths)


@torch.no_grad()
def test_a_chain_shaped_tree_is_the_greedy_chain_draft():
    """`TreeShape.chain(K)` drafts what the chain's greedy `draft` drafts, in as many forwards."""
    model = tiny_model("sdpa", seed=4)
    generator = torch.Generator().manual_seed(2)
    sequences = padded_batch(generator, 2, 6, [0, 2])
    processors, _ = prepared_processors(
        model, sequences.tokens[:, :6], pad_token_id=PAD, max_new_tokens=5, repetition_penalty=1.4
    )
    tree_drafter, chain_drafter = (proposer_for(model, sequences, processors) for _ in range(2))
    tree = tree_drafter.get_candidates(sequences, DraftBudget(0, 0, TreeShape.chain(5)))
    chain = chain_drafter.get_candidates(sequences, DraftBudget(5, 0))
    assert torch.equal(tree.tree.tokens, chain.tokens)
    assert tree.model_steps == chain.model_steps == 5


def test_a_draft_with_another_tokenizer_drafts_chains_only():
    model = tiny_model("sdpa")
    sequences = padded_batch(torch.Generator().manual_seed(0), 1, 4, [0])
    proposer = proposer_for(model, sequences, [])
    proposer.inputs = object()  # stands for a `DraftIdBuffer`
    with pytest.raises(ValueError, match="chains only"):
        proposer.get_candidates(sequences, DraftBudget(0, 0, TreeShape.default()))


@torch.no_grad()
def test_a_tree_left_in_the_cache_is_never_taken_for_committed_positions():
    """Rolling back, dropping rows or drafting again before `CachedModel.keep_path` is an error, not a wrong cache."""
    model = tiny_model("sdpa")
    sequences = padded_batch(torch.Generator().manual_seed(0), 2, 5, [0, 1])
    proposer = proposer_for(model, sequences, [])
    proposer.get_candidates(sequences, DraftBudget(0, 0, TreeShape.default()))
    for call in (
        lambda: proposer.rollback_to_committed(sequences.lengths),
        lambda: proposer.select_rows([0]),
        lambda: proposer.get_candidates(sequences, DraftBudget(0, 0, TreeShape.default())),
        lambda: proposer.get_candidates(sequences, DraftBudget(3, 0)),
    ):
        with pytest.raises(RuntimeError, match="compacted first"):
            call()


def test_choices_equal_a_stable_sort_with_ties_and_masked_scores():
    """`choices` (topk, with a slow path where the count-th score ties with the next) takes exactly what a stable
    descending sort takes: scores drawn from 4 values (ties everywhere), every other one masked to -inf (the tail of
    top-k/top-p), a wide row of distinct scores; a NaN row still gets distinct tokens."""
    from hf_specsample.proposers.tree_growth import choices

    generator = torch.Generator().manual_seed(0)
    for trial in range(200):
        vocab = int(torch.randint(3, 40, (1,), generator=generator))
        rows = int(torch.randint(1, 4, (1,), generator=generator))
        scores = torch.randint(0, 4, (rows, vocab), generator=generator).float()
        if trial % 3 == 0:
            scores[:, ::2] = float("-inf")
        for count in range(1, vocab + 1):
            reference = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :count]
            assert torch.equal(choices(scores, count), reference), (trial, count)
    wide = torch.randn(2, 5000, generator=generator)
    assert torch.equal(choices(wide, 3), torch.sort(wide, dim=-1, descending=True, stable=True).indices[:, :3])
    wide[1, 7] = float("nan")
    assert len(set(choices(wide, 4)[1].tolist())) == 4
