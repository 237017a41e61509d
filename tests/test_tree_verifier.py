"""`verify.verifier.Verifier` on trees: every processor at every node with that node's own prefix (the committed
tokens, then the path to the node), as a slow reference applying the processors one position at a time gives; row
chunks forced tiny give what one chunk gives, draw for draw; greedy by argmax, drawing nothing."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation import logits_process as lp

from hf_specsample.core.draft_tree import DraftTree
from hf_specsample.options import TreeShape
from hf_specsample.sampling.draws import call_key, first_argmax, keyed_uniforms, positions_from
from hf_specsample.sampling.processing import PositionwiseProcessor, probabilities
from hf_specsample.verify.rules import NonFinite, greedy_accept, speculative_accept, tree_accept
from hf_specsample.verify.verifier import Verifier

VOCAB = 12
EOS = 0
CALLER_BATCH = 7
CALLERS = [3, 0, 6, 1, 2]  # the rows' caller rows (a caller batch larger than the round's)
LENGTHS = [8, 10, 9, 12, 8]
# 16 nodes, depth 8, second and third choices near the root (the rounds below are built on its node indices)
SHAPE = TreeShape.from_paths([(0,) * 8, (1, 0), (2,), (0, 1, 0), (0, 2), (0, 0, 1), (0, 0, 0, 1)])


class RowBias(LogitsProcessor):
    """A processor that reads the batch index and the last token: not row-local, so called with the caller's whole
    batch (a caller row's siblings, one call each)."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        rows = torch.arange(input_ids.shape[0], device=scores.device)[:, None]
        return scores + 0.3 * rows * (input_ids[:, -1:] % 3) - 0.2 * (input_ids[:, -1:] == 5) * rows


def verifier_for(processor_list: LogitsProcessorList, do_sample: bool, generator, keep_scores: bool, tp: bool = False):
    """The verifier of a tree call over `processor_list` (with the fast processors), as a call of `CALLER_BATCH` rows
    builds it: sampling, its key drawn from `generator`."""
    processor = PositionwiseProcessor(processor_list, CALLER_BATCH, True)
    key = call_key(generator) if do_sample else None
    return Verifier(processor, do_sample, speculative_accept, generator, key, keep_scores, tensor_parallel=tp)


def node_scores(verifier: Verifier, tokens, lengths, logits, callers, tree: DraftTree) -> torch.Tensor:
    """`(batch, N + 1, vocab)` the processed scores at every position of a round of `SHAPE`, in one chunk."""
    return verifier._processed(tokens, lengths, logits, callers, tree, [list(SHAPE.depths)] * len(lengths), slice(None))


def processors(min_length: int) -> LogitsProcessorList:
    return LogitsProcessorList(
        [
            lp.RepetitionPenaltyLogitsProcessor(1.8),
            lp.NoRepeatNGramLogitsProcessor(2),
            lp.MinLengthLogitsProcessor(min_length, EOS),
            lp.NoBadWordsLogitsProcessor([[3, 4], [7]], eos_token_id=EOS),
            RowBias(),
            lp.TemperatureLogitsWarper(0.8),
            lp.TopKLogitsWarper(6),
        ]
    )


def _round(seed: int, shape: TreeShape = SHAPE):
    """A buffer of committed tokens (few ids: repeats for the penalties to find), a tree with distinct siblings and
    the target's raw logits at its N + 1 positions."""
    generator = torch.Generator().manual_seed(seed)
    batch = len(LENGTHS)
    tokens = torch.randint(0, 6, (batch, 24), generator=generator)
    choices = torch.rand(batch, shape.num_nodes + 1, 6, generator=generator).argsort(-1)  # per parent: its ranks
    node_tokens = choices[:, torch.tensor(shape.parents) + 1, torch.tensor(shape.ranks)]  # (batch, N) in 0..5
    tree = DraftTree.of_shape(shape, node_tokens)
    logits = 2 * torch.randn(batch, shape.num_nodes + 1, VOCAB, generator=generator)
    # each position's first child favoured: rounds accept deep paths, whose kept scores read the path
    for position in range(shape.num_nodes + 1):
        children = [node for node, parent in enumerate(shape.parents) if parent == position - 1]
        if children:
            logits[torch.arange(batch), position, node_tokens[:, children[0]]] += 6.0
    return tokens, tree, logits


def reference_scores(
    processor_list: LogitsProcessorList, tokens: torch.Tensor, tree: DraftTree, logits: torch.Tensor
) -> torch.Tensor:
    """`(batch, N + 1, vocab)`: the processors at each position alone, with its explicit prefix, its row at its
    caller index of a whole batch of zeros (as plain `generate()` calls them for that row)."""
    out = torch.empty_like(logits)
    for row, (length, caller) in enumerate(zip(LENGTHS, CALLERS)):
        for position in range(tree.num_nodes + 1):
            path, node = [], position - 1
            while node >= 0:
                path.insert(0, int(tree.tokens[row, node]))
                node = int(tree.parents[row, node])
            prefix = torch.cat([tokens[row, :length], torch.tensor(path, dtype=torch.long)])
            ids = torch.zeros((CALLER_BATCH, prefix.shape[0]), dtype=torch.long)
            scores = torch.zeros((CALLER_BATCH, logits.shape[-1]))
            ids[caller], scores[caller] = prefix, logits[row, position]
            for processor in processor_list:
                scores = processor(ids, scores)
            out[row, position] = scores[caller]
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_processors_at_every_node_read_its_path(seed):
    tokens, tree, logits = _round(seed)
    processor_list = processors(min_length=12)  # EOS banned at some positions only (prefix lengths 8..20)
    expected = reference_scores(processor_list, tokens, tree, logits)
    before = logits.clone()
    verifier = verifier_for(processor_list, True, torch.Generator().manual_seed(5), True, False)
    assert torch.equal(node_scores(verifier, tokens, LENGTHS, logits, CALLERS, tree), expected)
    verdict, kept = verifier(tokens, LENGTHS, logits, CALLERS, tree, shape=SHAPE)
    assert torch.equal(logits, before)  # not modified
    assert verdict.num_accepted.max() >= 2  # kept scores along a path that the processors read
    key = call_key(torch.Generator().manual_seed(5))  # the call's one draw; level d's uniform: (caller, length + d)
    draws = keyed_uniforms(key, torch.tensor(CALLERS), positions_from(LENGTHS, SHAPE.max_depth + 1, logits.device))
    want = tree_accept(tree, probabilities(expected), draws)
    for got_field, want_field in zip(verdict, want):
        assert torch.equal(got_field, want_field)
    at = torch.cat([torch.zeros_like(want.path[:, :1]), (want.path + 1).clamp(min=0)], 1)  # root, then the path
    assert kept.shape == (len(LENGTHS), SHAPE.max_depth + 1, VOCAB)
    assert torch.equal(kept, expected[torch.arange(len(LENGTHS))[:, None], at])
    # the path mattered: some node's scores differ from its root's under the same raw logits
    plain = reference_scores(processor_list, tokens, tree, logits[:, :1].expand_as(logits).contiguous())
    assert not torch.equal(plain[:, 1:], plain[:, :1].expand_as(plain[:, 1:]))


def test_shape_or_depths_read_from_the_tree_agree():
    tokens, tree, logits = _round(2)
    results = []
    for shape in (SHAPE, None):
        verifier = verifier_for(processors(12), True, torch.Generator().manual_seed(1), True, False)
        results.append(verifier(tokens, LENGTHS, logits, CALLERS, tree, shape=shape))
    (first, first_kept), (second, second_kept) = results
    assert all(torch.equal(a, b) for a, b in zip(first, second)) and torch.equal(first_kept, second_kept)


@pytest.mark.parametrize("do_sample", [True, False])
@pytest.mark.parametrize("processor_set", ["all", "prefix_free", "none"])
def test_row_chunks_give_what_one_chunk_gives(do_sample, processor_set):
    """Verdicts, kept scores and the generator's state after the round: identical for any chunk size."""
    tokens, tree, logits = _round(3)
    processor_list = {
        "all": processors(12),
        "prefix_free": LogitsProcessorList([lp.TemperatureLogitsWarper(0.7), lp.TopPLogitsWarper(0.9)]),
        "none": LogitsProcessorList([]),
    }[processor_set]
    positions = SHAPE.num_nodes + 1
    results = []
    for chunk_elements in (10**9, 2 * positions * VOCAB, 1):  # one chunk; two rows a chunk; a row a chunk
        generator = torch.Generator().manual_seed(9)
        verifier = verifier_for(processor_list, do_sample, generator, True, False)
        verifier.chunk_elements = chunk_elements
        verdict, kept = verifier(tokens, LENGTHS, logits, CALLERS, tree, shape=SHAPE)
        results.append((verdict, kept, torch.rand(3, generator=generator)))
    (verdict, kept, after), rest = results[0], results[1:]
    for other_verdict, other_kept, other_after in rest:
        assert all(torch.equal(a, b) for a, b in zip(verdict, other_verdict))
        assert torch.equal(kept, other_kept) and torch.equal(after, other_after)
    if not do_sample:  # greedy: the argmax walk, and no draw
        assert torch.equal(after, torch.rand(3, generator=torch.Generator().manual_seed(9)))
        scores = reference_scores(processor_list, tokens, tree, logits)
        want = greedy_accept(tree, first_argmax(scores), SHAPE.max_depth)
        assert all(torch.equal(a, b) for a, b in zip(verdict, want))


def test_greedy_accepts_along_the_targets_argmaxes():
    """Logits whose argmax at each position is the first child: every row accepts the whole spine."""
    tokens, tree, _ = _round(4)
    logits = torch.zeros(len(LENGTHS), SHAPE.num_nodes + 1, VOCAB)
    for position in range(SHAPE.num_nodes + 1):
        first_child = [node for node, parent in enumerate(SHAPE.parents) if parent == position - 1]
        for row in range(len(LENGTHS)):
            token = tree.tokens[row, first_child[0]] if first_child else 11
            logits[row, position, token] = 5.0
    verifier = verifier_for(LogitsProcessorList([]), False, None, False, False)
    verdict, kept = verifier(tokens, LENGTHS, logits, CALLERS, tree, shape=SHAPE)
    assert kept is None
    assert verdict.num_accepted.tolist() == [SHAPE.max_depth] * len(LENGTHS)
    assert verdict.next_tokens.tolist() == [11] * len(LENGTHS)


def test_nonfinite_rows_flagged_in_their_chunk():
    tokens, tree, logits = _round(5)
    logits[2, 0, 3] = float("nan")  # row 2's root: drawn at whatever is accepted
    verifier = verifier_for(LogitsProcessorList([]), True, torch.Generator().manual_seed(0), False, False)
    verifier.chunk_elements = 1
    verdict, _ = verifier(tokens, LENGTHS, logits, CALLERS, tree, shape=SHAPE)
    assert verdict.num_accepted[2] == int(NonFinite.TARGET)
    assert (verdict.num_accepted[[0, 1, 3, 4]] >= 0).all()


def test_tensor_parallel_takes_rank_zeros_verdict(tmp_path):
    """`distributed.broadcast_verdict` on a one-rank gloo group: the verdict comes back whole."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        tokens, tree, logits = _round(6)
        verdicts = []
        for tensor_parallel in (False, True):
            verifier = verifier_for(processors(12), True, torch.Generator().manual_seed(2), False, tensor_parallel)
            verdicts.append(verifier(tokens, LENGTHS, logits, CALLERS, tree, shape=SHAPE)[0])
        assert all(torch.equal(a, b) for a, b in zip(*verdicts))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("do_sample", [True, False])
def test_no_host_read_with_a_static_shape(monkeypatch, do_sample):
    """Given the shape, a round reads nothing back from its tensors (on CUDA each read waits for the device):
    prefix-free processors, the draws, the walk over levels, the NaN flags and the kept scores."""
    tokens, tree, logits = _round(7)
    prefix_free = LogitsProcessorList([lp.TemperatureLogitsWarper(0.7), lp.TopKLogitsWarper(5)])
    verifier = verifier_for(prefix_free, do_sample, torch.Generator().manual_seed(0), True, False)
    verifier.chunk_elements = 2 * (SHAPE.num_nodes + 1) * VOCAB

    def refuse(*args, **kwargs):
        raise AssertionError("a host read")

    for name in ("item", "tolist", "cpu", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    verdict, kept = verifier(tokens, LENGTHS, logits, CALLERS, tree, shape=SHAPE)
    with pytest.raises(AssertionError, match="a host read"):  # without the shape: the depths are read
        verifier(tokens, LENGTHS, logits, CALLERS, tree, shape=None)
    monkeypatch.undo()
    assert verdict.path.shape == (len(LENGTHS), SHAPE.max_depth) and kept.shape[1] == SHAPE.max_depth + 1
