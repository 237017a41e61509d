"""The target's output head applied row chunk by row chunk (`cache.output_head`): where a round's rows are verified in
several chunks, its logits are made per chunk from the hidden states, with each architecture's post-processing
(Gemma's soft-capping, Cohere's scale, Granite's scaling) proven bit for bit on the call's first forward; greedy is
plain `generate()`'s, a seeded call samples what an unchunked one samples, and a model whose post-processing no
`Tail` reproduces falls back to its own full logits (same tokens). A tiny threshold forces the chunks."""

import functools

import pytest
import torch
from tiny import PAD, arch_draft, tiny_arch, tiny_lm
from transformers import LlamaForCausalLM, LogitsProcessorList

from hf_specsample.cache import output_head
from hf_specsample.cache.output_head import HeadLogits, Tail
from hf_specsample.core.draft_tree import DraftTree
from hf_specsample.sampling import draws
from hf_specsample.sampling.processing import PositionwiseProcessor
from hf_specsample.verify.rules import speculative_accept
from hf_specsample.verify.verifier import Verifier

LOOKAHEAD = 2
IDS = torch.tensor([[1, 5, 2, 5, 3, 4], [PAD, PAD, 1, 3, 3, 2], [PAD, 2, 2, 4, 1, 1]] * 4)  # 12 ragged rows
MASK = (IDS != PAD).long()


@pytest.fixture
def deferred(monkeypatch):
    """Forces rows of 3 a chunk (of K + 1 positions) and records what the output heads did: `tails` (per call's first
    deferral, the tail found), `made` (how many logits each read of `HeadLogits` made)."""
    record = {"tails": [], "made": []}
    matching, read = output_head.OutputHead._matching_tail, HeadLogits.__getitem__

    def spied_matching(self, *args):
        tail = matching(self, *args)
        record["tails"].append(tail)
        return tail

    def spied_read(self, rows):
        logits = read(self, rows)
        record["made"].append(logits.numel())
        return logits

    monkeypatch.setattr(output_head.OutputHead, "_matching_tail", spied_matching)
    monkeypatch.setattr(HeadLogits, "__getitem__", spied_read)

    def force(vocab: int, rows: int = 3):
        record["limit"] = rows * (LOOKAHEAD + 1) * vocab
        monkeypatch.setattr(draws, "ROW_CHUNK_ELEMENTS", record["limit"] + 1)

    record["force"] = force
    return record


def _generate(target, draft, **kwargs):
    settings = dict(attention_mask=MASK, max_new_tokens=10, pad_token_id=PAD, draft_model=draft)
    return target.generate(IDS, num_lookahead=LOOKAHEAD, **settings, **kwargs)


TAILS = {
    "llama": Tail.NONE, "gemma2": Tail.SOFT_CAPPING, "cohere": Tail.SCALE, "granite": Tail.SCALING, "gpt2": Tail.NONE,
}  # fmt: skip


@pytest.mark.parametrize("name", list(TAILS))
def test_greedy_with_the_head_in_chunks_is_plain_greedy(name, deferred):
    """Each architecture's post-processing is found (gpt2: tied embeddings) and greedy stays plain's."""
    target = tiny_arch(name, seed=0)
    if name == "granite":
        target.config.logits_scaling = 3.0  # the default 1.0 divides by one: any tail would do
    plain = target.generate(IDS, attention_mask=MASK, do_sample=False, max_new_tokens=10, pad_token_id=PAD)
    deferred["force"](target.config.vocab_size)
    ours = _generate(target, arch_draft(target, seed=1), do_sample=False)
    assert torch.equal(ours, plain)
    assert deferred["tails"] == [TAILS[name]]  # decided once, on the call's first forward
    assert deferred["made"] and max(deferred["made"]) == deferred["limit"]  # never more than a chunk at once


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_seeded_sampling_with_the_head_in_chunks_samples_what_full_logits_sample(name, deferred):
    target = tiny_arch(name, seed=0)
    draft = arch_draft(target, seed=1)
    settings = dict(do_sample=True, temperature=0.9, top_p=0.9)
    whole = _generate(target, draft, generator=torch.Generator().manual_seed(3), **settings)
    assert not deferred["made"]  # one chunk: the model's own logits
    deferred["force"](target.config.vocab_size)
    chunked = _generate(target, draft, generator=torch.Generator().manual_seed(3), **settings)
    assert torch.equal(chunked, whole) and deferred["made"]


def test_recorded_logits_are_made_whole_and_scores_are_kept_per_chunk(deferred):
    """Logits made per chunk differ from the forward's by rounding only (a product of fewer rows)."""
    target = tiny_arch("llama", seed=0)
    draft = arch_draft(target, seed=1)
    flags = dict(do_sample=False, return_dict_in_generate=True, output_scores=True)
    whole = _generate(target, draft, **flags, output_logits=True)
    deferred["force"](target.config.vocab_size)
    recorded = _generate(target, draft, **flags, output_logits=True)
    assert not deferred["made"]  # the caller keeps the raw logits: made whole, as plain makes them
    scored = _generate(target, draft, **flags)
    assert deferred["made"]  # scores alone: made per chunk, kept per chunk
    assert torch.equal(recorded.sequences, whole.sequences) and torch.equal(scored.sequences, whole.sequences)
    assert all(torch.equal(a, b) for a, b in zip(recorded.scores, whole.scores, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(recorded.logits, whole.logits, strict=True))
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(scored.scores, whole.scores, strict=True))


class DoubledLlama(LlamaForCausalLM):
    """Post-processing no `Tail` knows: its logits doubled. `forwards` counts its forwards."""

    forwards = 0

    @functools.wraps(LlamaForCausalLM.forward)  # its signature: the loop reads which arguments a forward takes
    def forward(self, *args, **kwargs):
        DoubledLlama.forwards += 1
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2
        return out


class RowCheckingLlama(LlamaForCausalLM):
    """Refuses logits of fewer rows than its input (it raises on the slice the head is handed)."""

    @functools.wraps(LlamaForCausalLM.forward)
    def forward(self, input_ids=None, **kwargs):
        out = super().forward(input_ids=input_ids, **kwargs)
        if out.logits.shape[:2] != (input_ids.shape[0], kwargs.get("logits_to_keep", 0) or input_ids.shape[1]):
            raise ValueError("logits of another shape")
        return out


def _as(model_class, target):
    model = model_class(target.config).eval()
    model.load_state_dict(target.state_dict())
    return model


@pytest.mark.parametrize("do_sample", [False, True])
def test_unknown_post_processing_falls_back_to_full_logits(do_sample, deferred):
    """The bit-for-bit check refuses a doubling no `Tail` makes: the forward runs again on the model's own logits,
    and the model's later calls run it once. A doubling the head missed would sample at another temperature."""
    target = _as(DoubledLlama, tiny_arch("llama", seed=0))
    draft = arch_draft(tiny_arch("llama", seed=0), seed=1)
    settings = dict(do_sample=do_sample, temperature=0.9) if do_sample else dict(do_sample=False)
    draws = {"generator": torch.Generator().manual_seed(3)} if do_sample else {}
    whole = _generate(target, draft, **settings, **draws)
    deferred["force"](target.config.vocab_size)
    DoubledLlama.forwards = 0
    draws = {"generator": torch.Generator().manual_seed(3)} if do_sample else {}
    chunked = _generate(target, draft, **settings, **draws)
    first_call = DoubledLlama.forwards
    assert torch.equal(chunked, whole)
    assert deferred["tails"] == [None] and not deferred["made"]
    DoubledLlama.forwards = 0
    draws = {"generator": torch.Generator().manual_seed(3)} if do_sample else {}
    assert torch.equal(_generate(target, draft, **settings, **draws), whole)
    assert DoubledLlama.forwards == first_call - 1  # remembered: no forward run twice
    assert deferred["tails"] == [None]  # not asked again


def test_post_processing_that_raises_on_the_slice_falls_back(deferred):
    target = _as(RowCheckingLlama, tiny_arch("llama", seed=0))
    draft = arch_draft(tiny_arch("llama", seed=0), seed=1)
    plain = target.generate(IDS, attention_mask=MASK, do_sample=False, max_new_tokens=10, pad_token_id=PAD)
    deferred["force"](target.config.vocab_size)
    assert torch.equal(_generate(target, draft, do_sample=False), plain)
    assert not deferred["made"]


def test_unknown_post_processing_on_a_sliding_window_cache_falls_back(deferred):
    """The re-run forward undoes the first by a crop, also on sliding-window layers (past the window)."""
    target = tiny_arch("gemma2", seed=0)
    target.config.final_logit_softcapping = None  # no tail then reproduces the doubling below
    doubled = target.forward

    @functools.wraps(doubled)
    def forward(*args, **kwargs):
        out = doubled(*args, **kwargs)
        out.logits = out.logits * 2
        return out

    target.forward = forward
    plain = target.generate(IDS, attention_mask=MASK, do_sample=False, max_new_tokens=10, pad_token_id=PAD)
    deferred["force"](target.config.vocab_size)
    assert torch.equal(_generate(target, arch_draft(tiny_arch("gemma2", seed=0), seed=1), do_sample=False), plain)
    assert deferred["tails"] == [None] and not deferred["made"]


@pytest.mark.parametrize("do_sample", [False, True])
def test_verifier_reads_head_logits_chunk_by_chunk_as_it_reads_logits(do_sample):
    batch, vocab, hidden_size = 7, 30, 5
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(batch, LOOKAHEAD + 1, hidden_size, generator=generator)
    weight = 2 * torch.randn(vocab, hidden_size, generator=generator)
    calls = []

    def head(states):
        calls.append(states.shape[0])
        return states @ weight.T

    logits = torch.cat([head(hidden[start : start + 2]) for start in range(0, batch, 2)])  # as the chunks make them
    calls.clear()
    draft_probs = torch.softmax(torch.randn(batch, LOOKAHEAD, vocab, generator=generator), dim=-1)
    draft_tokens = torch.multinomial(draft_probs.view(-1, vocab), 1, generator=generator).view(batch, LOOKAHEAD)
    tokens = torch.randint(0, vocab, (batch, 12), generator=generator)
    processor = PositionwiseProcessor(LogitsProcessorList([]), batch)
    results = []
    for given in (logits, HeadLogits(hidden, head, vocab, torch.device("cpu"))):
        generator = torch.Generator().manual_seed(5)
        verify = Verifier(processor, do_sample, speculative_accept, generator, None, True, 2 * logits[0].numel())
        chain = DraftTree.chain(draft_tokens)
        verdict, scores = verify(tokens, [8] * batch, given, list(range(batch)), chain, draft_probs, None)
        results.append((verdict.num_accepted, verdict.next_tokens, scores))
    assert calls == [2, 2, 2, 1]  # the head made two rows at a time
    for expected, got in zip(*results, strict=True):
        assert torch.equal(expected, got)


def test_a_single_chunk_keeps_the_models_logits(deferred):
    target = tiny_lm(seed=0)
    ours = target.generate(
        IDS % 8, attention_mask=MASK, do_sample=False, max_new_tokens=5, pad_token_id=PAD,
        draft_model=arch_draft(target, seed=1), num_lookahead=LOOKAHEAD,
    )  # fmt: skip
    assert ours.shape[1] == IDS.shape[1] + 5
    assert not deferred["tails"] and not deferred["made"]
