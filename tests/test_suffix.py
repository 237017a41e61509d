"""The suffix drafter (`proposers.suffix`) and its store (`proposers.suffix_store`): the index, the counted tree, the
store's budget and files, and exactness through `generate()` (greedy identity, chi-square with power, seeded text
independent of the store)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from exact import chisquare_pvalue, exact_distribution, sampled_pvalue
from test_architectures import batch
from tiny import (
    ARCHITECTURES,
    PAD,
    FakeClock,
    char_tokenizer,
    perturbed_copy,
    prepared_processors,
    second_turns,
    tiny_arch,
    tiny_lm,
)
from transformers import StoppingCriteria, StoppingCriteriaList

from hf_specsample import SpeculativeConfig, SuffixDraft
from hf_specsample.proposers import suffix as suffix_module
from hf_specsample.proposers.suffix import count_tree
from hf_specsample.proposers.suffix_store import SEPARATOR, TokenIndex

# --- the index ------------------------------------------------------------------------------------------------------


def indexed(*documents: list[int]) -> TokenIndex:
    index = TokenIndex(capacity=4, buckets=1 << 10)
    for document in documents:
        index.write(index.end, np.array(document, dtype=np.int32))
        index.end += 1  # the separator
    return index


def test_matches_are_the_latest_occurrences_with_their_lengths():
    index = indexed([5, 6, 7, 8, 9], [1, 6, 7, 8, 2], [6, 7, 8, 3])
    found = index.matches(np.array([0, 6, 7, 8]))  # no 4-gram: the 2-gram "7 8", measured back to 3 tokens
    assert found.positions.tolist() == [14, 9, 3]  # the latest first: document 3, 2, then 1
    assert found.lengths.tolist() == [3, 3, 3]
    assert index.continuations(found.positions, 3).tolist() == [[3, SEPARATOR, SEPARATOR], [2, SEPARATOR, SEPARATOR],
                                                                [9, SEPARATOR, SEPARATOR]]  # fmt: skip
    longest = index.matches(np.array([4, 5, 6, 7, 8]))  # the 4-gram "5 6 7 8" occurred: its occurrence alone
    assert longest.positions.tolist() == [3] and longest.lengths.tolist() == [4]
    assert index.matches(np.array([40, 41])).positions.size == 0
    assert index.matches(np.array([0, 6, 7, 8]), exclude=14).positions.tolist() == [9, 3]


def test_a_long_ngram_finds_its_occurrence_among_many_short_ones():
    """A query whose last 16 tokens occurred once, after thousands of occurrences of its last token: the chain of
    16-grams finds it although the last token's chain is read only `CHAIN_STEPS` deep."""
    pattern = list(range(100, 120))
    noise = [7] * 5000
    index = indexed(pattern + [1, 2, 3], noise)
    found = index.matches(np.array(pattern))
    assert found.positions.tolist() == [19] and found.lengths.tolist() == [20]


def test_collisions_are_verified():
    index = TokenIndex(capacity=4, buckets=1 << 10)
    index.bits = 1  # two buckets: nearly everything collides
    index.head = {n: np.full(2, -1, dtype=np.int64) for n in index.head}
    index.write(0, np.arange(50, dtype=np.int32))
    found = index.matches(np.array([10, 11, 12]))
    assert found.positions.tolist() == [12] and found.lengths.tolist() == [3]


# --- the counted tree -----------------------------------------------------------------------------------------------


def test_count_tree_keeps_the_most_frequent_nodes_as_a_tree():
    conts = np.array([[1, 2, 3], [1, 2, 4], [1, 5, SEPARATOR], [6, 7, 8], [1, 2, 3]])
    tree = count_tree(conts, max_nodes=5, min_probability=0.0)
    assert tree.tokens == [1, 6, 2, 5, 3]  # level order; counts 4, 1 / 3, 1 / 2
    assert tree.parents == [-1, -1, 0, 0, 2] and tree.depths == [1, 1, 2, 2, 3]
    assert tree.counts == [4, 1, 3, 1, 2]
    floored = count_tree(conts, max_nodes=20, min_probability=0.3)  # at least 1.5 of 5 occurrences
    assert floored.tokens == [1, 2, 3] and floored.parents == [-1, 0, 1]
    assert count_tree(conts[:0], max_nodes=5).tokens == []


def test_count_tree_ties_go_to_the_latest_occurrence_and_siblings_are_distinct():
    conts = np.array([[9, 1], [8, 2], [9, 3]])
    tree = count_tree(conts, max_nodes=3, min_probability=0.0)
    assert tree.tokens == [9, 8, 1]  # 9 seen twice; then 8 (count 1, depth 1); then 1 (the first occurrence's)
    for parent in set(tree.parents):
        children = [token for token, above in zip(tree.tokens, tree.parents) if above == parent]
        assert len(children) == len(set(children))


# --- the store ------------------------------------------------------------------------------------------------------


def test_the_store_evicts_the_oldest_outputs_whole():
    store = SuffixDraft(max_tokens=10)
    store.add([[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11]])
    assert [doc.tolist() for doc in store.documents()] == [[5, 6, 7], [8, 9, 10, 11]]
    assert store.stats.tokens == 7 and store.stats.evicted_tokens == 4 and store.stats.added_tokens == 11
    assert store.index.matches(np.array([2, 3])).positions.size == 0  # evicted text is never matched
    store.add([list(range(20, 40))])  # longer than the budget: its last 10 tokens
    assert [doc.tolist() for doc in store.documents()] == [list(range(30, 40))]
    store.add([[1, 2, 3]] * 20)
    assert store.index.offset > 0 and store.index.tokens.shape[0] < 64  # the evicted storage was freed
    assert store.index.matches(np.array([1, 2])).positions.size > 0
    with pytest.raises(ValueError, match="positive int"):
        SuffixDraft(max_tokens=0)
    with pytest.raises(ValueError, match="positive int"):
        SuffixDraft(max_tokens=True)
    assert SuffixDraft(max_tokens=np.int64(5)).max_tokens == 5


@pytest.mark.parametrize(
    "bad", [[[[1, 2], [3, 4]]], [1, 2, 3], [[1.7, 2.2]], [[2**31 + 3]], [[1, 2], [3, -1]]],
    ids=["2-D", "not nested", "floats", "past 2**31", "negative"],
)  # fmt: skip
def test_a_bad_document_is_refused_and_the_store_unchanged(bad):
    store = SuffixDraft(max_tokens=100)
    store.add([[5, 6]])
    with pytest.raises(ValueError, match="SuffixDraft.add"):
        store.add(bad)
    assert [doc.tolist() for doc in store.documents()] == [[5, 6]] and store.held_tokens == 2 and store.largest_id == 6


def test_eviction_lowers_the_largest_id_held():
    store = SuffixDraft(max_tokens=3)
    store.add([[1, 900], [2, 3, 4]])
    assert [doc.tolist() for doc in store.documents()] == [[2, 3, 4]] and store.largest_id == 4
    assert SuffixDraft() != SuffixDraft() and len({SuffixDraft(), SuffixDraft()}) == 2  # identity, hashable


def test_the_store_holds_a_million_tokens_in_compact_arrays():
    store = SuffixDraft(max_tokens=1_000_000)
    rng = np.random.default_rng(0)
    store.add([rng.integers(0, 150_000, size=1000) for _ in range(1100)])
    assert store.held_tokens == 1_000_000 and store.index.nbytes < 1 << 30


def test_save_and_load_round_trip_and_refuse_another_tokenizer(tmp_path):
    tokenizer = char_tokenizer()
    store = SuffixDraft(max_tokens=100, tokenizer=tokenizer)
    store.add([[1, 2, 3], [4, 5]])
    path = tmp_path / "store.npz"
    store.save(path)
    loaded = SuffixDraft.load(path, tokenizer=tokenizer)
    assert [doc.tolist() for doc in loaded.documents()] == [[1, 2, 3], [4, 5]]
    assert loaded.max_tokens == 100 and loaded.fingerprint == store.fingerprint
    other = char_tokenizer()
    other.add_tokens(["<new>"])
    with pytest.raises(ValueError, match="another tokenizer"):
        SuffixDraft.load(path, tokenizer=other)


@pytest.fixture(autouse=True)
def steady_clock(monkeypatch):
    """Greedy calls adapt K to measured costs: on a fake clock here, so that no assertion rests on the load."""
    monkeypatch.setattr(time, "perf_counter", FakeClock(1e-3))


@pytest.fixture(scope="module")
def target():
    return tiny_lm(seed=0, vocab_size=8, init_range=1.0)


PROMPT = torch.tensor([[1, 5, 2, 5, 3, 5, 2]])


def test_a_call_learns_from_the_store_and_adds_its_output(target):
    store = SuffixDraft()
    kwargs = dict(do_sample=False, max_new_tokens=30, pad_token_id=PAD, return_dict_in_generate=True)
    plain = target.generate(PROMPT, do_sample=False, max_new_tokens=30, pad_token_id=PAD)
    first = target.generate(PROMPT, draft_model=store, **kwargs)
    second = target.generate(PROMPT, draft_model=store, **kwargs)
    assert torch.equal(first.sequences, plain) and torch.equal(second.sequences, plain)
    assert [doc.tolist() for doc in store.documents()] == [plain[0, 7:].tolist()] * 2
    assert second.speculative_stats.suffix_accepted_tokens["store"] > 0
    assert second.speculative_stats.target_forward_passes < first.speculative_stats.target_forward_passes
    assert second.speculative_stats.draft_forward_passes == 0 and second.speculative_stats.draft_form == "suffix"


def test_a_failed_call_leaves_the_store_unchanged(target):
    class Fails(StoppingCriteria):
        def __init__(self):
            self.calls = 0

        def __call__(self, input_ids, scores, **kwargs):
            self.calls += 1
            if self.calls > 3:
                raise RuntimeError("stop here")
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    store = SuffixDraft()
    store.add([[1, 2, 3]])
    with pytest.raises(RuntimeError, match="stop here"):
        target.generate(PROMPT, draft_model=store, max_new_tokens=20, pad_token_id=PAD,
                        stopping_criteria=StoppingCriteriaList([Fails()]))  # fmt: skip
    assert [doc.tolist() for doc in store.documents()] == [[1, 2, 3]]


def test_refusals(target):
    with pytest.raises(ValueError, match="runs no draft model"):
        target.generate(PROMPT, max_new_tokens=3, pad_token_id=PAD, draft_model="suffix",
                        speculative_config=SpeculativeConfig(draft_form="int8_weights"))  # fmt: skip
    with pytest.raises(ValueError, match="Drop prompt_lookup_num_tokens"):
        target.generate(PROMPT, max_new_tokens=3, pad_token_id=PAD, draft_model="suffix", prompt_lookup_num_tokens=3)
    with pytest.raises(ValueError, match="draft_shape="):
        target.generate(PROMPT, max_new_tokens=3, pad_token_id=PAD, draft_model="suffix",
                        speculative_config=SpeculativeConfig(draft_shape="tree"))  # fmt: skip
    wide = SuffixDraft()
    wide.add([[1, 2, 300]])
    with pytest.raises(ValueError, match="past the target's 8 logits"):
        target.generate(PROMPT, max_new_tokens=3, pad_token_id=PAD, draft_model=wide)


# --- exactness ------------------------------------------------------------------------------------------------------


def adversarial_store(eos: int | None = None) -> SuffixDraft:
    """Continuations of the prompt's end that a random target rarely makes, duplicated, and with EOS inside."""
    store = SuffixDraft()
    tail = PROMPT[0, -3:].tolist()
    store.add([tail + [7, 7, 7, 7]] * 3 + [tail + [0, 1, 0, 1]] + [tail + [6] + ([eos] if eos is not None else [4])])
    return store


@pytest.mark.parametrize("shape", ["auto", "chain"])
def test_greedy_equals_plain_with_padding_eos_and_return_sequences(target, shape):
    eos = 4
    rows = [[1, 5, 2, 5, 3, 5, 2], [1, 3, 3, 4], [6, 6, 6]]
    for side in ("left", "right"):
        ids, mask = batch(rows, side=side)
        kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=24, pad_token_id=PAD, eos_token_id=eos)
        expected = target.generate(ids, **kwargs)
        got = target.generate(ids, **kwargs, draft_model=adversarial_store(eos), return_dict_in_generate=True,
                              speculative_config=SpeculativeConfig(draft_shape=shape))  # fmt: skip
        assert torch.equal(got.sequences, expected), side
        expected_shape = "suffix trees" if shape == "auto" else "suffix chains (draft_shape='chain')"
        assert got.speculative_stats.shape == expected_shape


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_greedy_equals_plain_on_every_architecture(name):
    model = tiny_arch(name, seed=0, vocab_size=48)
    ids, mask = batch([[1, 5, 9, 13, 5, 9, 13], [1, 7, 3]])
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=20, pad_token_id=PAD)
    expected = model.generate(ids, **kwargs)
    store = SuffixDraft()
    store.add([expected[0, 7:].tolist(), [9, 13, 5, 9, 13, 2, 2]])
    got = model.generate(ids, **kwargs, draft_model=store, return_dict_in_generate=True)
    assert torch.equal(got.sequences, expected)
    assert got.speculative_stats.accepted_tokens > 0


SETTINGS = dict(temperature=0.9, top_p=0.9, repetition_penalty=1.3)


@pytest.mark.parametrize("shape", ["auto", "chain"])
def test_sampling_is_exact_with_an_adversarial_store(target, shape):
    """8000 rows of one call: the store's continuations are rarely the target's, duplicated, EOS inside; the rows
    also draft from each other as they run."""
    p = sampled_pvalue(
        target, PROMPT, num_tokens=3, rows=8000, seed=3, settings=SETTINGS, eos_token_ids=[4], eos_token_id=4,
        draft_model=adversarial_store(eos=4), speculative_config=SpeculativeConfig(draft_shape=shape), num_lookahead=3,
    )  # fmt: skip
    assert p > 1e-3


def test_the_chi_square_has_power(target, monkeypatch):
    """The same test fails a walk that takes the target's argmax instead of its draw."""
    from hf_specsample.verify import rules, verifier

    def credulous(tree, target_probs, draws):  # walks by the target's argmax: a sampler that never samples
        return rules.greedy_accept(tree, target_probs.argmax(dim=-1), draws.shape[1] - 1)

    monkeypatch.setattr(verifier, "tree_accept", credulous)
    p = sampled_pvalue(
        target, PROMPT, num_tokens=3, rows=8000, seed=3, settings=SETTINGS, eos_token_ids=[4], eos_token_id=4,
        draft_model=adversarial_store(eos=4), num_lookahead=3,
    )  # fmt: skip
    assert p < 1e-6


def test_one_seed_gives_one_text_with_an_empty_store_a_full_one_and_a_model_draft():
    model = tiny_lm(seed=0, vocab_size=48)
    draft = perturbed_copy(model, seed=1, scale=0.3)
    ids, mask = batch([[1, 5, 9, 13, 5, 9, 13], [1, 7, 3], [1, 30, 31, 32, 33]])
    full = SuffixDraft()
    full.add([[5, 9, 13, 5, 9, 13] * 3, [7, 3, 7, 3, 7, 3], list(range(20, 40))])
    texts = []
    for draft_model, shape in (("suffix", "auto"), (full, "auto"), (draft, "tree"), (draft, "dynamic")):
        out = model.generate(
            ids, attention_mask=mask, pad_token_id=PAD, do_sample=True, max_new_tokens=16, draft_model=draft_model,
            generator=torch.Generator().manual_seed(7), speculative_config=SpeculativeConfig(draft_shape=shape),
            **SETTINGS,
        )  # fmt: skip
        texts.append(out)
    assert all(torch.equal(text, texts[0]) for text in texts)


def test_a_store_shared_by_two_calls_in_one_process(target):
    store = SuffixDraft()
    kwargs = dict(do_sample=True, max_new_tokens=12, pad_token_id=PAD, draft_model=store)
    first = target.generate(PROMPT, generator=torch.Generator().manual_seed(1), num_return_sequences=3, **kwargs)
    second = target.generate(PROMPT[:, :4], generator=torch.Generator().manual_seed(2), **kwargs)
    documents = [doc.tolist() for doc in store.documents()]
    assert documents[:3] == [row[7:] for row in first.tolist()] and documents[3] == second[0, 4:].tolist()
    assert store.stats.documents == 4 and store.stats.lookups > 0


def test_trees_are_padded_with_siblings_the_walk_never_takes(monkeypatch):
    """Rows of one round whose trees differ in size: the narrower rows' padding copies their first node."""
    proposer_trees = []
    original = suffix_module.SuffixProposer._trees

    def spy(self, sequences, trees):
        proposal = original(self, sequences, trees)
        proposer_trees.append((trees, proposal))
        return proposal

    monkeypatch.setattr(suffix_module.SuffixProposer, "_trees", spy)
    model = tiny_lm(seed=0, vocab_size=48)
    ids, mask = batch([[1, 5, 9, 13, 5, 9, 13, 5], [1, 7, 3]])
    expected = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=10, pad_token_id=PAD)
    got = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=10, pad_token_id=PAD,
                         draft_model="suffix")  # fmt: skip
    assert torch.equal(got, expected)
    ragged = [(trees, proposal) for trees, proposal in proposer_trees if len({len(t.tokens) for t in trees}) > 1]
    assert ragged
    trees, proposal = ragged[0]
    for row, tree in enumerate(trees):
        pad = proposal.tokens.shape[1] - len(tree.tokens)
        if pad and tree.tokens:
            assert proposal.tokens[row, len(tree.tokens) :].tolist() == [tree.tokens[0]] * pad
            assert proposal.parents[row, len(tree.tokens) :].tolist() == [-1] * pad


# --- beside a draft model -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair():
    model = tiny_lm(seed=0, vocab_size=16, layers=2, hidden=32, init_range=0.3)
    return model, perturbed_copy(model, seed=1, scale=0.3)


@pytest.mark.parametrize("shape", ["auto", "chain", "tree"])
def test_beside_a_model_greedy_equals_plain_and_rounds_choose_their_source(pair, shape):
    target, draft = pair
    ids, mask = batch([[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3], [1, 7, 3], [9, 9, 8]])
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=30, pad_token_id=PAD)
    expected = target.generate(ids, **kwargs)
    store = SuffixDraft()
    config = SpeculativeConfig(draft_shape=shape)
    for call in range(2):  # the second call finds the first's text in the store
        got = target.generate(ids, **kwargs, draft_model=draft, suffix_draft=store, speculative_config=config,
                              num_lookahead=2, return_dict_in_generate=True)  # fmt: skip
        assert torch.equal(got.sequences, expected), call
    sources = got.speculative_stats.suffix_accepted_tokens
    assert sources["store"] > 0 and set(sources) == {"call", "store", "model"}
    for row in range(3):  # one row at a time: suffix rounds where the store knows the text, the model elsewhere
        alone = target.generate(ids[row : row + 1, mask[row].bool()], do_sample=False, max_new_tokens=30,
                                pad_token_id=PAD, draft_model=draft, suffix_draft=store, speculative_config=config,
                                num_lookahead=2)  # fmt: skip
        assert alone[0, -30:].tolist() == expected[row, -30:].tolist()


@pytest.mark.parametrize("verification", ["block", "token"])
def test_beside_a_model_sampling_is_exact_with_suffix_paths_forced_in(pair, monkeypatch, verification):
    """The model's sampled chains with rows' suffix paths forced in as point masses (every row trusts the store from
    its first round here: in 6000 rows the threshold of a suffix round is never met, so every round is the model's),
    under the block and the token rule."""
    from hf_specsample.proposers import suffix_then_model

    monkeypatch.setattr(suffix_then_model, "PRIOR_TRUST", 1.0)
    target, draft = pair
    prompt = torch.tensor([[1, 2, 3, 4, 5, 1, 2, 3]])
    store = SuffixDraft()
    store.add([[2, 3, 4, 5, 1], [2, 3, 9, 9, 9], [2, 3, 4, 5, 1]])
    forced = []
    original = suffix_then_model.SuffixThenModelProposer.observe

    def counted(self, num_accepted):
        forced.append(sum(offered is not None for offered in self.offered))
        original(self, num_accepted)

    monkeypatch.setattr(suffix_then_model.SuffixThenModelProposer, "observe", counted)
    p = sampled_pvalue(
        target, prompt, num_tokens=3, rows=6000, seed=5, settings=SETTINGS, draft_model=draft, suffix_draft=store,
        num_lookahead=2, speculative_config=SpeculativeConfig(verification=verification),
    )  # fmt: skip
    assert p > 1e-3
    assert sum(forced) > 1000  # rows' suffix paths went into the model's rounds


def test_beside_a_model_one_row_calls_run_suffix_rounds_and_stay_exact(pair, monkeypatch):
    """Single-row calls, where suffix rounds (the model does not run) and model rounds alternate: 1500 calls (every
    row trusts the store from its first round here, so that suffix rounds run often)."""
    from hf_specsample.proposers import suffix_then_model

    monkeypatch.setattr(suffix_then_model, "PRIOR_TRUST", 1.0)
    target, draft = pair
    prompt = torch.tensor([[1, 2, 3, 4, 5, 1, 2, 3]])
    store = SuffixDraft()  # the target's own continuations: the suffix rounds' drafts are often right
    torch.manual_seed(3)
    own = target.generate(prompt, do_sample=True, max_new_tokens=3, pad_token_id=PAD, num_return_sequences=40,
                          **SETTINGS)  # fmt: skip
    store.add([[1, 2, 3, *row[8:].tolist()] for row in own])  # matching as long as the prompt's own "1 2 3"
    generator = torch.Generator().manual_seed(11)
    samples, sources = [], {}
    for _ in range(1500):
        out = target.generate(prompt, do_sample=True, max_new_tokens=3, pad_token_id=PAD, draft_model=draft,
                              suffix_draft=store, num_lookahead=2, generator=generator, return_dict_in_generate=True,
                              **SETTINGS)  # fmt: skip
        samples.append(tuple(out.sequences[0, 8:].tolist()))
        for source, count in out.speculative_stats.suffix_accepted_tokens.items():
            sources[source] = sources.get(source, 0) + count
    processors, _ = prepared_processors(target, prompt, do_sample=True, max_new_tokens=3, **SETTINGS)
    assert chisquare_pvalue(exact_distribution(target, prompt, processors, 3), samples) > 1e-3
    assert sources["store"] + sources["call"] > 0 and sources["model"] > 0


def test_suffix_draft_refusals(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="only apply to speculative sampling"):
        target.generate(PROMPT, max_new_tokens=3, suffix_draft=SuffixDraft())
    with pytest.raises(ValueError, match="pass the store itself as draft_model"):
        target.generate(PROMPT, max_new_tokens=3, draft_model="suffix", suffix_draft=SuffixDraft())
    with pytest.raises(TypeError, match="SuffixDraft"):
        target.generate(PROMPT, max_new_tokens=3, draft_model=draft, suffix_draft="suffix")


# --- what plain generate() takes ------------------------------------------------------------------------------------


def test_stop_strings_end_where_plain_ends():
    tokenizer = char_tokenizer()
    model = tiny_lm(seed=0, vocab_size=len(tokenizer), init_range=1.0)
    prompt = torch.tensor([[1, 5, 9, 13, 5, 9, 13]])
    free_run = tokenizer.decode(model.generate(prompt, do_sample=False, max_new_tokens=30, pad_token_id=PAD)[0, 7:])
    stop = free_run[9:11]
    kwargs = dict(do_sample=False, max_new_tokens=30, pad_token_id=PAD, stop_strings=[stop], tokenizer=tokenizer)
    expected = model.generate(prompt, **kwargs)
    assert expected.shape[1] < 37
    store = SuffixDraft()
    store.add([model.generate(prompt, do_sample=False, max_new_tokens=30, pad_token_id=PAD)[0, 7:].tolist()])
    out = model.generate(prompt, **kwargs, draft_model=store, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected) and out.speculative_stats.suffix_accepted_tokens["store"] > 0


def test_a_second_chat_turn_on_the_returned_cache():
    model = tiny_lm(seed=0, vocab_size=48)
    ids, mask = batch([[1, 5, 9, 13, 5, 9, 13], [1, 7, 3]])
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=12, pad_token_id=PAD,
                  return_dict_in_generate=True)  # fmt: skip
    plain = model.generate(ids, **kwargs)
    store = SuffixDraft()
    store.add([plain.sequences[0, 7:].tolist()])
    speculative = model.generate(ids, **kwargs, draft_model=store)
    assert torch.equal(speculative.sequences, plain.sequences)
    turn_kwargs = dict(max_new_tokens=10, pad_token_id=PAD, do_sample=False)
    plain_2, speculative_2 = second_turns(model, store, plain, speculative, mask, ids.shape[1], **turn_kwargs)
    assert torch.equal(speculative_2, plain_2)


@pytest.mark.parametrize("config", [dict(cache_implementation="static"), dict(compile=True)])
def test_static_caches_and_compile_run_chains_of_the_same_drafter(config):
    model = tiny_lm(seed=0, vocab_size=48)
    ids = torch.tensor([[1, 5, 9, 13, 5, 9, 13]])
    kwargs = dict(do_sample=False, max_new_tokens=16, pad_token_id=PAD)
    expected = model.generate(ids, **kwargs)
    store = SuffixDraft()
    store.add([expected[0, 7:].tolist()])
    speculative = {}
    if "compile" in config:
        speculative = dict(speculative_config=SpeculativeConfig(compile=True))
    else:
        kwargs.update(config)
    out = model.generate(ids, **kwargs, **speculative, draft_model=store, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert out.speculative_stats.shape.startswith("suffix chains (the call cannot verify trees: static caches")
    assert out.speculative_stats.suffix_accepted_tokens["store"] > 0
