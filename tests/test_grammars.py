"""Structured output with speculation (`sampling/stateful.py`): xgrammar's transformers processor driven as a pure
function of each row's prefix, so that greedy output is plain `generate()`'s token for token and sampled output is
distributed as the grammar-masked target; the processors of libraries no adapter drives yet are refused before any
forward.

A tiny raw vocabulary and a small grammar that forbids and forces (`{`, then letters separated by commas, then `}`
and EOS), tiny random Llama models; xgrammar is a test dependency (`pyproject.toml`'s `test` extra)."""

from __future__ import annotations

import pytest
import torch
from exact import chisquare_pvalue, continuations, exact_distribution
from tiny import PAD, ForwardCounter, perturbed_copy, prepared_processors, tiny_lm
from transformers import LogitsProcessor, LogitsProcessorList

from hf_specsample import DynamicTree, SpeculativeConfig
from hf_specsample.sampling import stateful

xgr = pytest.importorskip("xgrammar")
from xgrammar.contrib.hf import LogitsProcessor as XGrammarProcessor  # noqa: E402

VOCAB = ["<pad>", "<bos>", "<eos>", "{", "}", "a", "b", ",", "ab", "ba", "x", "y"]
V, EOS = len(VOCAB), 2
GRAMMAR = 'root ::= "{" ("a" | "b" | "ab" | "ba") ("," ("a" | "b" | "ab" | "ba"))* "}"'
SHORT = 'root ::= "{" ("a" | "b") "}"'
ALPHA = 1e-3
SHAPES = {
    "chain": dict(),
    "tree": dict(speculative_config=SpeculativeConfig(draft_shape="tree")),
    "dynamic": dict(speculative_config=SpeculativeConfig(draft_shape=DynamicTree(nodes=6, depth=3, expand=2))),
    "lookup": dict(draft_model="prompt_lookup"),
}


@pytest.fixture(scope="module")
def compiled():
    info = xgr.TokenizerInfo(VOCAB, vocab_type=xgr.VocabType.RAW, vocab_size=V, stop_token_ids=[EOS])
    compiler = xgr.GrammarCompiler(info)
    return compiler.compile_grammar(GRAMMAR), compiler.compile_grammar(SHORT)


@pytest.fixture(scope="module")
def models():
    target = tiny_lm(0, vocab_size=V, layers=2, hidden=32, init_range=1.0, eos_token_id=EOS)
    return target, perturbed_copy(target, seed=3, scale=0.2)


class GrammarMask(LogitsProcessor):
    """The grammar's mask as a function of each row's prefix, from a fresh matcher per call: what plain decoding's
    processor applies at that prefix (the reference of the exactness tests)."""

    def __init__(self, grammar, prompt_length: int):
        self.grammar, self.prompt_length = grammar, prompt_length

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        bitmask = xgr.allocate_token_bitmask(input_ids.shape[0], V)
        for row, tokens in enumerate(input_ids[:, self.prompt_length :].tolist()):
            matcher = xgr.GrammarMatcher(self.grammar)
            assert all(matcher.accept_token(token) for token in tokens if not matcher.is_terminated())
            matcher.fill_next_token_bitmask(bitmask, row)
        scores = scores.clone()
        xgr.apply_token_bitmask_inplace(scores, bitmask)
        return scores


def generate(target, prompt, grammar, **kwargs):
    mask = (prompt != PAD).long()
    kwargs.setdefault("max_new_tokens", 16)
    processor = XGrammarProcessor(grammar)
    return target.generate(prompt, attention_mask=mask, pad_token_id=PAD, logits_processor=[processor], **kwargs)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_is_plain_greedy_under_a_grammar(models, compiled, shape):
    """One row and a ragged batch (one grammar for all rows, and one per row): the tokens plain `generate()` makes
    with a fresh xgrammar processor, and text the grammar accepts."""
    target, draft = models
    grammar, short = compiled
    for prompt, grammars_of_rows in [
        (torch.tensor([[1, 5, 6, 10]]), grammar),
        (torch.tensor([[PAD, PAD, 1, 5], [1, 6, 10, 11]]), grammar),
        (torch.tensor([[PAD, PAD, 1, 5], [1, 6, 10, 11]]), [grammar, short]),
    ]:
        plain = generate(target, prompt, grammars_of_rows, do_sample=False)
        kwargs = dict(SHAPES[shape])
        kwargs.setdefault("draft_model", draft)
        ours = generate(target, prompt, grammars_of_rows, do_sample=False, **kwargs)
        assert torch.equal(ours, plain), (shape, ours.tolist(), plain.tolist())
        assert (plain[:, prompt.shape[1]] == VOCAB.index("{")).all()  # the grammar forced it: the test has power


def test_forced_tokens_cost_no_draft_forward(models):
    """Where the grammar allows one token only, the draft proposes it without a forward (a point mass) and the
    statistics count it: a grammar that forces every token runs no draft forward at all, and the text is plain's."""
    target, draft = models
    info = xgr.TokenizerInfo(VOCAB, vocab_type=xgr.VocabType.RAW, vocab_size=V, stop_token_ids=[EOS])
    forced_only = xgr.GrammarCompiler(info).compile_grammar('root ::= "{" "a" "," "b" "," "a" "}"')
    prompt = torch.tensor([[1, 5, 6, 10]])
    for do_sample in (False, True):
        plain = generate(target, prompt, forced_only, do_sample=do_sample)
        out = generate(
            target,
            prompt,
            forced_only,
            do_sample=do_sample,
            draft_model=draft,
            num_lookahead=4,
            return_dict_in_generate=True,
        )
        assert torch.equal(out.sequences, plain)  # the only text the grammar allows
        stats = out.speculative_stats
        assert stats.draft_forward_passes == 0 and stats.grammar_forced_tokens == sum(stats.row_accepted_tokens) > 0


def test_the_callers_processor_is_not_advanced(models, compiled):
    """The user's processor is read (its grammars), never called: its matchers stay unmade."""
    target, draft = models
    processor = XGrammarProcessor(compiled[0])
    prompt = torch.tensor([[1, 5, 6, 10]])
    target.generate(prompt, max_new_tokens=8, pad_token_id=PAD, logits_processor=[processor], draft_model=draft)
    assert processor.matchers == [] and not processor.prefilled


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_sampled_continuations_follow_the_masked_target(models, compiled, shape):
    """Chi-square of 2,000 sampled 4-token continuations against the exact distribution of the target under the
    grammar's mask (every prefix masked from a fresh matcher); every sample parses as a grammar prefix."""
    target, draft = models
    grammar = compiled[0]
    prompt = torch.tensor([[1, 5, 6, 10]])
    rows, tokens = 2000, 4
    kwargs = dict(SHAPES[shape], draft_model=draft)
    out = generate(
        target,
        prompt,
        grammar,
        do_sample=True,
        max_new_tokens=tokens,
        num_return_sequences=rows,
        generator=torch.Generator().manual_seed(5),
        **kwargs,
    )
    mask = GrammarMask(grammar, prompt.shape[1])
    processors, _ = prepared_processors(target, prompt, do_sample=True, max_new_tokens=tokens, logits_processor=[mask])
    exact = exact_distribution(target, prompt, LogitsProcessorList(processors), tokens, (EOS,))
    samples = continuations(out, prompt.shape[1], (EOS,))
    assert chisquare_pvalue(exact, samples) > ALPHA
    assert len(exact) > 10  # the grammar leaves choices: the test has cells to tell samplers apart


def test_a_stale_mask_fails_the_same_test(models, compiled, monkeypatch):
    """The power check: an adapter that masks with the state one token behind (a matcher advanced one call late)
    fails the chi-square above."""
    target, draft = models
    grammar = compiled[0]
    masked_at = stateful.GrammarPrefixes._mask
    monkeypatch.setattr(stateful.GrammarPrefixes, "_mask", lambda self, row, tokens: masked_at(self, row, tokens[:-1]))
    # its samples break the grammar, which the real adapter refuses to commit: let them through to the test
    monkeypatch.setattr(stateful.GrammarPrefixes, "_refuse_if_committed", lambda *args: None)
    prompt = torch.tensor([[1, 5, 6, 10]])
    out = generate(
        target,
        prompt,
        grammar,
        do_sample=True,
        max_new_tokens=4,
        num_return_sequences=2000,
        generator=torch.Generator().manual_seed(5),
        draft_model=draft,
    )
    mask = GrammarMask(grammar, prompt.shape[1])
    processors, _ = prepared_processors(target, prompt, do_sample=True, max_new_tokens=4, logits_processor=[mask])
    exact = exact_distribution(target, prompt, LogitsProcessorList(processors), 4, (EOS,))
    assert chisquare_pvalue(exact, continuations(out, prompt.shape[1], (EOS,))) < ALPHA


@pytest.mark.parametrize(
    "module, library",
    [
        ("outlines.processors.structured", "outlines"),
        ("llguidance.hf", "llguidance"),
        ("transformers_cfg.generation.logits_process", "transformers-cfg"),
        ("lmformatenforcer.integrations.transformers", "lm-format-enforcer"),
    ],
)
def test_grammar_processors_without_an_adapter_are_refused_before_any_forward(models, module, library):
    target, draft = models
    stateful = type("OtherGrammarProcessor", (LogitsProcessor,), {"__module__": module})
    stateful.__call__ = lambda self, input_ids, scores: scores
    prompt = torch.tensor([[1, 5, 6, 10]])
    with ForwardCounter(target, draft) as counter, pytest.raises(ValueError, match=library) as refusal:
        target.generate(prompt, max_new_tokens=4, pad_token_id=PAD, logits_processor=[stateful()], draft_model=draft)
    assert counter.calls == 0
    assert "xgrammar.contrib.hf.LogitsProcessor" in str(refusal.value)


def test_a_subclass_of_xgramars_processor_is_refused_before_any_forward(models, compiled):
    """A subclass may keep a state of its own: it is not driven as xgrammar's processor, and it is refused (it keeps
    the grammar's state per row) unless declared stateful."""
    target, draft = models
    subclass = type("LoggingGrammarProcessor", (XGrammarProcessor,), {})
    prompt = torch.tensor([[1, 5, 6, 10]])
    with ForwardCounter(target, draft) as counter, pytest.raises(ValueError, match="not a subclass"):
        target.generate(
            prompt, max_new_tokens=4, pad_token_id=PAD, logits_processor=[subclass(compiled[0])], draft_model=draft
        )
    assert counter.calls == 0


@pytest.mark.parametrize("case", ["min_new_tokens", "suppress_tokens"])
def test_a_committed_token_the_grammar_forbids_raises_as_plain_does(models, compiled, case):
    """A grammar that must end (EOS its only token) while another processor forbids EOS: the target's greedy token
    is one the grammar forbids. Plain `generate()` fails at its next step (xgrammar's processor asserts); so does the
    speculative call, saying why, instead of committing text the grammar does not allow."""
    target, draft = models
    short = compiled[1]
    prompt = torch.tensor([[1, 6, 10, 11]])
    settings = dict(min_new_tokens=6) if case == "min_new_tokens" else dict(suppress_tokens=[EOS])
    with pytest.raises(AssertionError):
        generate(target, prompt, short, do_sample=False, max_new_tokens=10, **settings)
    with pytest.raises(ValueError, match="does not allow"):
        generate(target, prompt, short, do_sample=False, max_new_tokens=10, draft_model=draft, **settings)


def test_a_grammar_per_row_must_fit_the_batch(models, compiled):
    target, draft = models
    prompt = torch.tensor([[1, 5, 6, 10]] * 3)
    with pytest.raises(ValueError, match="one per row"):
        generate(target, prompt, list(compiled), draft_model=draft)


@pytest.mark.parametrize("allowed", [1, 3, 200, 0.5, 0.97])
@pytest.mark.parametrize("extra", [-40, 0, 45])
def test_a_mask_applies_as_xgrammars_kernel_does(allowed, extra):
    """`GrammarMask` (by index where few tokens are allowed, by a cap elsewhere) writes what xgrammar's CPU kernel
    writes, over logits narrower than the bitmask, as wide, and wider (past it: left as they are), float32 and
    bfloat16, with a -inf score kept; and finds the one token a mask allows."""
    from hf_specsample.sampling.grammar_matchers import GrammarMask, MaskKind

    generator = torch.Generator().manual_seed(allowed if isinstance(allowed, int) else int(100 * allowed))
    vocab = 20_000  # past `SPARSE` tokens: a dense mask is applied by a cap
    chosen = (
        torch.randperm(vocab, generator=generator)[:allowed]
        if isinstance(allowed, int)
        else (torch.rand(vocab, generator=generator) < allowed).nonzero().flatten()
    )
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    bitmask.zero_()
    for token in chosen.tolist():
        bitmask[0, token // 32] |= torch.tensor(1 << (token % 32)).to(torch.int32)
    mask = GrammarMask(bitmask[0].clone())
    assert mask.kind is (MaskKind.KEEP if isinstance(allowed, int) else MaskKind.CAP)
    assert mask.forced == (int(chosen[0]) if allowed == 1 else None)
    for dtype in (torch.float32, torch.bfloat16):
        scores = torch.randn(vocab + extra, generator=generator).to(dtype)
        scores[int(chosen[0]) % scores.shape[0]] = float("-inf")
        expected = scores.clone().unsqueeze(0)
        xgr.apply_token_bitmask_inplace(expected, bitmask)
        out = torch.empty_like(scores)
        mask.write(scores, out)
        assert torch.equal(out, expected[0]), (allowed, extra, dtype)
