"""Tree drafting by a draft model (issue 45): one draft forward per level with the tree mask, children = the top
distinct choices of the draft's processed scores at each parent, equal to a slow reference (a plain forward per
path, processors with the path's prefix, top-k by hand); the draft's cache after compaction serves the next round."""

import pytest
import torch
from test_tree_forward import accept, committed_tokens, padded_batch, path_nodes, tiny_model
from tiny import PAD, prepared_processors

from hf_specsample.cache.forwards import Forwards
from hf_specsample.draft_tree import TreeShape
from hf_specsample.model_facts import ModelFacts
from hf_specsample.proposers.draft_model import DraftModelProposer, DraftVocabulary
from hf_specsample.verify.processing import PositionwiseProcessor

VOCAB = 32
PROCESSORS = {
    "none": {},
    "sampling": dict(do_sample=True, temperature=0.7, top_k=12, top_p=0.95),
    "prefix": dict(do_sample=True, repetition_penalty=1.5, no_repeat_ngram_size=2, temperature=1.3),
}


def proposer_for(model, sequences, processors) -> DraftModelProposer:
    return DraftModelProposer(
        ModelFacts.of(model), Forwards(), DraftVocabulary(None, None, VOCAB), sequences,
        PositionwiseProcessor(processors, sequences.num_active), do_sample=False,
    )  # fmt: skip


@torch.no_grad()
def reference_choices(model, processors, sequences, row: int, path: list[int], count: int) -> list[int]:
    """The `count` best draft tokens after row `row`'s committed tokens and `path`: a plain forward of the real
    tokens, the processors called as plain `generate()` calls them (the prompt's padding included, the row at its
    index in the batch), a stable sort."""
    length = sequences.lengths[row]
    logits = model(input_ids=torch.tensor([committed_tokens(sequences, row) + path])).logits[:, -1].float()
    ids = torch.cat([sequences.tokens[row, :length], torch.tensor(path, dtype=torch.long)])
    # the whole batch, this row at its index (a padded batch's repetition penalty holds one prompt length per row)
    batch_ids, batch_scores = (
        ids.new_zeros((sequences.num_active, ids.numel())),
        logits.new_zeros((sequences.num_active, VOCAB)),
    )
    batch_ids[row], batch_scores[row] = ids, logits[0]
    scores = processors(batch_ids, batch_scores)[row]
    return torch.sort(scores, descending=True, stable=True).indices[:count].tolist()


def assert_tree_is_the_reference(model, processors, sequences, shape: TreeShape, tokens: torch.Tensor) -> None:
    """Every parent's children are its reference choices at their ranks; siblings are distinct."""
    for row in range(sequences.num_active):
        for parent in [-1, *range(shape.num_nodes)]:
            kids = [(node, rank) for node, (p, rank) in enumerate(zip(shape.parents, shape.ranks)) if p == parent]
            if not kids:
                continue
            path = tokens[row, path_nodes(shape, parent)].tolist() if parent >= 0 else []
            expected = reference_choices(model, processors, sequences, row, path, max(r for _, r in kids) + 1)
            got = [int(tokens[row, node]) for node, _ in kids]
            assert got == [expected[rank] for _, rank in kids], (row, parent)
            assert len(set(got)) == len(got)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("processing", list(PROCESSORS))
@pytest.mark.parametrize("padding", [[0], [3, 0]], ids=["one_row", "two_rows"])
@torch.no_grad()
def test_tree_drafts_equal_the_slow_reference_round_after_round(attention, processing, padding):
    """Three rounds of drafting the default shape, each followed by a ragged accepted path (a leaf the draft never
    fed, an inner node, nothing), compaction and the loop's rollback: every round's tree is the reference's."""
    model = tiny_model(attention, seed=3)
    generator = torch.Generator().manual_seed(7)
    sequences = padded_batch(generator, len(padding), 7, padding)
    processors, _ = prepared_processors(
        model, sequences.tokens[:, :7], pad_token_id=PAD, max_new_tokens=5, **PROCESSORS[processing]
    )
    proposer = proposer_for(model, sequences, processors)
    shape = TreeShape.default()
    endings = [[15, 1], [2, -1], [8, 13]]
    for ends in endings:
        before = proposer.forward_passes
        proposal = proposer.draft_tree(sequences, shape)
        assert proposal.model_steps == shape.max_depth == proposer.forward_passes - before
        assert_tree_is_the_reference(model, processors, sequences, shape, proposal.tree.tokens)
        held = proposer.runner.fed
        inner = sum(1 for node in range(shape.num_nodes) if node in shape.parents)
        assert held == [length + inner for length in sequences.lengths]  # committed, then every inner node
        bonus = torch.randint(3, VOCAB, (len(padding),), generator=generator).tolist()
        path, counts = accept(sequences, proposal.tree, shape, ends[: len(padding)], bonus)
        proposer.compact_tree(path, counts)
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
    tree = tree_drafter.draft_tree(sequences, TreeShape.chain(5))
    chain = chain_drafter.draft(sequences, 5)
    assert torch.equal(tree.tree.tokens, chain.tokens)
    assert tree.model_steps == chain.model_steps == 5


def test_a_draft_with_another_tokenizer_drafts_chains_only():
    model = tiny_model("sdpa")
    sequences = padded_batch(torch.Generator().manual_seed(0), 1, 4, [0])
    proposer = proposer_for(model, sequences, [])
    proposer.inputs = object()  # stands for a `DraftIdBuffer`
    with pytest.raises(ValueError, match="chains only"):
        proposer.draft_tree(sequences, TreeShape.default())
