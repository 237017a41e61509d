"""Structured output with the processors of outlines (its xgrammar, outlines_core and llguidance backends),
transformers-cfg and lm-format-enforcer (`sampling/grammar_matchers.py`): greedy output is plain `generate()`'s token
for token with a fresh processor of that library, sampled output is distributed as the target under the grammar's
mask, and what is not driven is refused before any forward.

The tiny raw vocabulary and random Llama models of tests/test_grammars.py, with a real fast tokenizer over it (a
WordLevel model, one token per character or pair, built offline), and one small language that forbids and forces:
`{`, then items a, b, ab or ba separated by commas, then `}` and EOS. Each library's tests skip where it is not
installed (pyproject.toml's `test` extra installs them)."""

from __future__ import annotations

import re

import pytest
import torch
from exact import chisquare_pvalue, continuations, exact_distribution
from tiny import PAD, ForwardCounter, perturbed_copy, prepared_processors, tiny_lm
from transformers import LogitsProcessor, LogitsProcessorList

from hf_specsample import SpeculativeConfig
from hf_specsample.sampling import stateful

VOCAB = ["<pad>", "<bos>", "<eos>", "{", "}", "a", "b", ",", "ab", "ba", "x", "y"]
V, EOS = len(VOCAB), 2
REGEX = r"\{(a|b|ab|ba)(,(a|b|ab|ba))*\}"
EBNF = 'root ::= "{" item ("," item)* "}"\nitem ::= "a" | "b" | "ab" | "ba"'
VIABLE = re.compile(r"\{((a|b|ab|ba),)*((a|b|ab|ba)\}?)?")  # every prefix of the language but the empty one
ALPHA = 1e-3
SHAPES = {
    "chain": dict(),
    "tree": dict(speculative_config=SpeculativeConfig(draft_shape="tree")),
    "lookup": dict(draft_model="prompt_lookup"),
}
PROMPTS = [torch.tensor([[1, 5, 6, 10]]), torch.tensor([[PAD, PAD, 1, 5], [1, 6, 10, 11]])]


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaTokenizerFast

    backend = Tokenizer(models.WordLevel({token: index for index, token in enumerate(VOCAB)}, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    backend.decoder = decoders.ByteLevel()  # what llguidance reads token bytes from (our tokens are ASCII)
    # a Llama class: transformers-cfg maps token bytes by the tokenizer's class
    return LlamaTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<pad>"
    )


@pytest.fixture(scope="module")
def models():
    target = tiny_lm(0, vocab_size=V, layers=2, hidden=32, init_range=1.0, eos_token_id=EOS)
    return target, perturbed_copy(target, seed=3, scale=0.2)


def outlines_backend(name: str, target, tokenizer):
    """A fresh-processor factory of one of outlines' backends, as outlines builds them for a transformers model."""
    outlines = pytest.importorskip("outlines")
    module = pytest.importorskip(f"outlines.backends.{name}")
    kind = {"xgrammar": "XGrammarBackend", "outlines_core": "OutlinesCoreBackend", "llguidance": "LLGuidanceBackend"}
    backend = getattr(module, kind[name])(outlines.from_transformers(target, tokenizer))
    return lambda: backend.get_regex_logits_processor(REGEX)


def transformers_cfg_processor(tokenizer, **settings):
    """A fresh transformers-cfg processor (and constraint: plain's call advances the constraint's own state)."""
    pytest.importorskip("transformers_cfg")
    from transformers_cfg.generation.logits_process import GrammarConstrainedLogitsProcessor
    from transformers_cfg.grammar_utils import IncrementalGrammarConstraint

    return GrammarConstrainedLogitsProcessor(IncrementalGrammarConstraint(EBNF, "root", tokenizer), **settings)


LIBRARIES = ["outlines-xgrammar", "outlines_core", "llguidance", "transformers-cfg"]


@pytest.fixture(scope="module", params=LIBRARIES)
def library(request, models, tokenizer):
    """(name, a factory of fresh processors of that library)."""
    name = request.param
    if name == "transformers-cfg":
        return name, lambda: transformers_cfg_processor(tokenizer)
    return name, outlines_backend(name.removeprefix("outlines-"), models[0], tokenizer)


def generate(target, prompt, processor, **kwargs):
    # finished rows are padded with EOS: transformers-cfg's processor raises on any other token after EOS
    kwargs.setdefault("max_new_tokens", 16)
    mask = (prompt != PAD).long()
    return target.generate(prompt, attention_mask=mask, pad_token_id=EOS, logits_processor=[processor], **kwargs)


def assert_in_language(sequences: torch.Tensor, prompt_length: int) -> None:
    """Each row's text is a prefix of the language, the whole of it where the row ended with EOS."""
    ended = 0
    for row in sequences[:, prompt_length:].tolist():
        end = row.index(EOS) if EOS in row else len(row)
        text = "".join(VOCAB[token] for token in row[:end])
        assert VIABLE.fullmatch(text), text
        if end < len(row):
            assert re.fullmatch(REGEX, text), text
            ended += 1
    assert ended > 0  # the grammar had to end a row: the check has power


@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_is_plain_greedy_under_each_library(models, library, shape):
    """One row and a ragged batch: the tokens plain `generate()` makes with a fresh processor of the library, and
    text the language accepts."""
    target, draft = models
    name, new_processor = library
    for prompt in PROMPTS:
        plain = generate(target, prompt, new_processor(), do_sample=False)
        kwargs = dict(SHAPES[shape])
        kwargs.setdefault("draft_model", draft)
        ours = generate(target, prompt, new_processor(), do_sample=False, **kwargs)
        assert torch.equal(ours, plain), (name, shape, ours.tolist(), plain.tolist())
        assert (plain[:, prompt.shape[1]] == VOCAB.index("{")).all()  # the grammar forced it
        assert_in_language(plain, prompt.shape[1])


class LanguageMask(LogitsProcessor):
    """The language's mask as a function of each row's prefix, from the regular expression alone (no library): the
    reference of the sampling tests. A token is allowed where the text stays a prefix of the language, EOS where the
    text is in it."""

    def __init__(self, prompt_length: int):
        self.prompt_length = prompt_length

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        allowed = torch.zeros_like(scores, dtype=torch.bool)
        for row, tokens in enumerate(input_ids[:, self.prompt_length :].tolist()):
            text = "".join(VOCAB[token] for token in tokens)
            allowed[row, EOS] = re.fullmatch(REGEX, text) is not None
            for token in range(3, V):
                allowed[row, token] = VIABLE.fullmatch(text + VOCAB[token]) is not None
        return scores.masked_fill(~allowed, float("-inf"))


def sampled_pvalue(target, draft, prompt, processor, shape: str) -> tuple[float, int]:
    """Chi-square p-value of 2,000 sampled 4-token continuations against the target under `LanguageMask`, and the
    number of continuations it allows."""
    rows, tokens = 2000, 4
    out = generate(
        target,
        prompt,
        processor,
        do_sample=True,
        max_new_tokens=tokens,
        num_return_sequences=rows,
        generator=torch.Generator().manual_seed(5),
        **dict(SHAPES[shape], draft_model=draft),
    )
    mask = LanguageMask(prompt.shape[1])
    processors, _ = prepared_processors(target, prompt, do_sample=True, max_new_tokens=tokens, logits_processor=[mask])
    exact = exact_distribution(target, prompt, LogitsProcessorList(processors), tokens, (EOS,))
    return chisquare_pvalue(exact, continuations(out, prompt.shape[1], (EOS,))), len(exact)


@pytest.mark.parametrize("name", ["outlines_core", "llguidance"])
def test_sampled_continuations_follow_the_masked_target(models, tokenizer, name):
    """Every sample a prefix of the language, and distributed as the target under its mask."""
    target, draft = models
    processor = outlines_backend(name, target, tokenizer)()
    pvalue, cells = sampled_pvalue(target, draft, torch.tensor([[1, 5, 6, 10]]), processor, "chain")
    assert pvalue > ALPHA
    assert cells > 10  # the language leaves choices: the test has cells to tell samplers apart


def test_a_stale_mask_fails_the_same_test(models, tokenizer, monkeypatch):
    """The power check: outlines_core's guide masking with the state one token behind fails the test above."""
    target, draft = models
    masked_at = stateful.GrammarPrefixes._mask
    monkeypatch.setattr(stateful.GrammarPrefixes, "_mask", lambda self, row, tokens: masked_at(self, row, tokens[:-1]))
    monkeypatch.setattr(stateful.GrammarPrefixes, "_refuse_if_committed", lambda *args: None)
    processor = outlines_backend("outlines_core", target, tokenizer)()
    pvalue, _ = sampled_pvalue(target, draft, torch.tensor([[1, 5, 6, 10]]), processor, "chain")
    assert pvalue < ALPHA


def test_transformers_cfg_speculation_mode_is_refused_before_any_forward(models, tokenizer):
    """Its mask depends on the scores' argmax (the draft's differ from the target's): refused, saying what to use."""
    target, draft = models
    processor = transformers_cfg_processor(tokenizer, execution_mode="speculation")
    with ForwardCounter(target, draft) as counter, pytest.raises(ValueError, match='"full_mask"'):
        generate(target, PROMPTS[0], processor, draft_model=draft)
    assert counter.calls == 0


def test_a_subclass_of_a_driven_processor_is_refused_before_any_forward(models, tokenizer):
    """A subclass may keep a state of its own: not driven as outlines' processor, and refused."""
    target, draft = models
    processor = outlines_backend("outlines_core", target, tokenizer)()
    processor.__class__ = type("LoggingProcessor", (type(processor),), {})
    with ForwardCounter(target, draft) as counter, pytest.raises(ValueError, match="not a subclass"):
        generate(target, PROMPTS[0], processor, draft_model=draft)
    assert counter.calls == 0


@pytest.mark.parametrize("shape", list(SHAPES))
def test_lm_format_enforcers_prefix_function_is_exact_as_it_stands(models, tokenizer, shape):
    """lm-format-enforcer's transformers route, `prefix_allowed_tokens_fn=`: its `TokenEnforcer` keeps each
    prefix's state keyed by the prefix's tokens and derives it from its parent prefix's, so it is a function of the
    prefix wherever a prefix is asked after its parent. (Its `integrations.transformers` module does not import under
    transformers 5; the function below is what `build_transformers_prefix_allowed_tokens_fn` returns.)"""
    pytest.importorskip("lmformatenforcer")
    from lmformatenforcer import RegexParser, TokenEnforcer, TokenEnforcerTokenizerData

    target, draft = models
    regular = [(token, VOCAB[token], False) for token in range(3, V)]
    data = TokenEnforcerTokenizerData(regular, tokenizer.decode, EOS, False, V)

    def fresh():
        enforcer = TokenEnforcer(data, RegexParser(REGEX))
        return lambda batch_id, ids: enforcer.get_allowed_tokens(ids.tolist()).allowed_tokens

    for prompt in PROMPTS:
        mask = (prompt != PAD).long()
        settings = dict(attention_mask=mask, pad_token_id=EOS, max_new_tokens=16, do_sample=False)
        plain = target.generate(prompt, prefix_allowed_tokens_fn=fresh(), **settings)
        kwargs = dict(SHAPES[shape])
        kwargs.setdefault("draft_model", draft)
        ours = target.generate(prompt, prefix_allowed_tokens_fn=fresh(), **settings, **kwargs)
        assert torch.equal(ours, plain), (shape, ours.tolist(), plain.tolist())
        assert_in_language(plain, prompt.shape[1])
