"""A call's plan (`plan/call_plan.py`): each model inspected once, the plan's decisions, and the refusal of what it
does not know."""

import collections

import pytest
import torch
from tiny import PAD, cache_of, perturbed_copy, tiny_arch, tiny_lm, with_cache
from transformers import ClassifierFreeGuidanceLogitsProcessor, DynamicCache, LogitsProcessorList, cache_utils

from hf_specsample import DraftForm, SpeculativeConfig, prepare_draft
from hf_specsample.core import model_facts
from hf_specsample.kernels.routing import KernelRouting
from hf_specsample.plan import call_plan as plan
from hf_specsample.policy import validation
from hf_specsample.prepare import prepared_draft
from hf_specsample.proposers.suffix_store import MAX_MATCH
from hf_specsample_bench.hybrids import tiny_hybrid

PROMPT = torch.tensor([[1, 17, 42, 5, 9, 33, 2, 8, 19, 41, 7, 3, 11, 29, 5, 9, 61, 4]])


@pytest.fixture
def counted(monkeypatch):
    """Per model object: how often its logit width, cache kind (its config's cache layers) and kernel routing were
    worked out, and how often it was inspected (`ModelFacts.of`)."""
    counts = collections.defaultdict(collections.Counter)
    for name in ("logit_width", "_cache_kind"):
        real = getattr(model_facts, name)

        def wrapper(model, *args, _real=real, _name=name):
            counts[id(model)][_name] += 1
            return _real(model, *args)

        monkeypatch.setattr(model_facts, name, wrapper)
    real_of, real_plan = model_facts.ModelFacts.of.__func__, KernelRouting.for_model.__func__

    def of(cls, model, same_config=None):
        counts[id(model)]["facts"] += 1
        return real_of(cls, model, same_config)

    def for_model(cls, facts, *args, **kwargs):
        counts[id(facts.model)]["kernel routing"] += 1
        return real_plan(cls, facts, *args, **kwargs)

    monkeypatch.setattr(model_facts.ModelFacts, "of", classmethod(of))
    monkeypatch.setattr(KernelRouting, "for_model", classmethod(for_model))
    return counts


@pytest.mark.parametrize("form", ["as_given", "dynamic_int8", "auto"])
def test_each_model_is_inspected_once_per_call(counted, form):
    """Within one generate() call each model's logit width, cache kind (hybrid layers included) and kernel routing are
    worked out once: the target's, the draft's as given, and the prepared draft's (a quantized copy: its cache
    questions are its source's, not asked again). A call that builds the implicit draft (the first) also inspects
    the forms it times; the target and the draft as given still once."""
    target = tiny_lm(seed=0, vocab_size=64)
    draft = perturbed_copy(target, seed=1, scale=0.1)
    config = SpeculativeConfig(draft_form=form)
    for call in range(2):
        counted.clear()
        out = target.generate(PROMPT, max_new_tokens=6, pad_token_id=PAD, draft_model=draft, num_lookahead=2,
                              speculative_config=config, return_dict_in_generate=True)  # fmt: skip
        assert out.speculative_stats.rounds > 0
        for model in (target, draft):
            assert counted[id(model)]["facts"] == 1 and counted[id(model)]["_cache_kind"] == 1, (call, counted)
            assert counted[id(model)]["logit_width"] == 1, (call, counted)
        assert counted[id(target)]["kernel routing"] == 1
        others = [counts for key, counts in counted.items() if key not in (id(target), id(draft))]
        assert all(counts["_cache_kind"] == 0 for counts in others)  # a copy's cache is its source's
        if call == 1:  # the implicit draft is made: every model of the call, once
            assert all(
                value == 1 for counts in counted.values() for key, value in counts.items() if key != "_cache_kind"
            )


def test_the_plan_refuses_before_any_forward():
    """Every refusal runs before the first forward of either model: here one of the last (a logits processor that
    keeps state across calls) stops a call whose draft would otherwise be timed (AUTO) and run."""
    target = tiny_lm(seed=0, vocab_size=64)
    draft = perturbed_copy(target, seed=1, scale=0.1)
    forwards = []
    for model in (target, draft):
        model.register_forward_pre_hook(lambda *args: forwards.append(1))
    processors = LogitsProcessorList([ClassifierFreeGuidanceLogitsProcessor(1.5)])
    with pytest.raises(ValueError, match="keeps state across calls"):
        target.generate(PROMPT, max_new_tokens=4, pad_token_id=PAD, draft_model=draft, logits_processor=processors)
    assert forwards == []


def test_a_plans_decisions_are_frozen_and_read_by_the_decoder():
    target = tiny_lm(seed=0, vocab_size=64)
    draft = perturbed_copy(target, seed=1, scale=0.1)
    captured = []
    real = plan.plan_call

    def recording(inputs):
        captured.append(real(inputs))
        return captured[-1]

    import hf_specsample.decoding as decoding

    original = decoding.plan_call
    decoding.plan_call = recording
    try:
        target.generate(PROMPT, max_new_tokens=4, pad_token_id=PAD, draft_model=draft, num_lookahead=2)
    finally:
        decoding.plan_call = original
    (made,) = captured
    assert made.target.model is target and made.draft.prepared.model is not None
    assert made.draft.vocabulary.target_width == made.target.logit_width == 64
    assert made.max_ngram is None and not made.clock_free and made.config.num_lookahead == 2
    with pytest.raises(AttributeError):
        made.clock_free = True  # frozen


def test_a_wrong_form_names_the_choices_wherever_it_is_passed():
    target = tiny_lm(seed=0, vocab_size=64)
    draft = perturbed_copy(target, seed=1, scale=0.1)
    assert list(DraftForm) == [DraftForm(value) for value in ("auto", "as_given", "dynamic_int8", "int8_weights",
                                                              "int4_weights")]  # fmt: skip
    for value in ("bogus", "int8", "none"):
        with pytest.raises(ValueError, match=f"draft_form must be one of 'auto', 'as_given', .*got '{value}'"):
            SpeculativeConfig(draft_form=value)
        with pytest.raises(ValueError, match=f"form must be one of 'auto', 'as_given', .*got '{value}'"):
            prepare_draft(draft, target, form=value)


@pytest.mark.parametrize("draft_model", ["model", "prompt_lookup"])
def test_an_unknown_keyword_gets_plain_generates_error(draft_model):
    """A keyword generate() does not know (a typo, a name that never shipped) is refused with plain generate()'s own
    error, as transformers words it, with `draft_model=` as without."""
    target = tiny_lm(seed=0, vocab_size=64)
    draft = perturbed_copy(target, seed=1, scale=0.1) if draft_model == "model" else draft_model
    for name in ("bogus", "draft_quantization"):
        with pytest.raises(ValueError) as plain:
            target.generate(PROMPT, max_new_tokens=2, pad_token_id=PAD, **{name: 1})
        with pytest.raises(ValueError) as ours:
            target.generate(PROMPT, max_new_tokens=2, pad_token_id=PAD, draft_model=draft, **{name: 1})
        assert str(ours.value) == str(plain.value) and repr(name) in str(plain.value)


@pytest.mark.parametrize(
    "model, options",
    [
        ("llama", dict(speculative_config=SpeculativeConfig(draft_form="as_given"))),
        ("llama", dict(cache_implementation="static", speculative_config=SpeculativeConfig(draft_form="as_given"))),
        ("llama", dict(prompt_lookup_num_tokens=3, do_sample=True, generator=torch.Generator().manual_seed(0))),
        ("llama", dict(batch=3)),
        ("llama", dict(draft_model="prompt_lookup")),
        ("gemma2", dict(speculative_config=SpeculativeConfig(draft_form="as_given"))),
        ("qwen3_5", dict(do_sample=True, speculative_config=SpeculativeConfig(draft_form="as_given"))),
        ("lfm2", dict(do_sample=True, speculative_config=SpeculativeConfig(draft_form="as_given"))),
    ],
    ids=["dynamic", "static", "lookup-and-model", "batch", "lookup-only", "sliding-window", "recurrent", "convolution"],
)
def test_a_call_builds_only_the_caches_it_runs_on(model, options, monkeypatch):
    """One generate() call builds at most two caches, the target's (generate() makes it) and the draft's, and one
    without a draft model only the target's: no cache is built to ask a model what kind its cache is. (A draft's
    first preparation under draft_form="auto" times each form's forwards on caches of their own: not counted here,
    the draft is prepared first.)"""

    options = dict(options)
    target = tiny_lm(seed=0, vocab_size=64) if model == "llama" else None
    target = target or (tiny_arch(model, seed=0) if model == "gemma2" else tiny_hybrid(model, seed=0, vocab_size=64))
    draft = options.pop("draft_model", None) or perturbed_copy(target, seed=1, scale=0.1)
    prompt = PROMPT.repeat(options.pop("batch", 1), 1) % 48
    kwargs = dict(max_new_tokens=10, pad_token_id=PAD, num_lookahead=3, draft_model=draft, **options)
    target.generate(prompt, **kwargs)  # the draft's preparation, if any
    built = []
    real_init = cache_utils.Cache.__init__

    def counting(cache, *args, **kwargs):
        built.append(type(cache).__name__)
        real_init(cache, *args, **kwargs)

    monkeypatch.setattr(cache_utils.Cache, "__init__", counting)
    out = target.generate(prompt, return_dict_in_generate=True, **kwargs)
    assert out.speculative_stats.rounds > 0
    assert len(built) == (1 if isinstance(draft, str) else 2), built


CALL_KINDS = ["dynamic", "static", "compile", "compile-static", "caller", "caller-compile", "chat", "chat-compile",
              "lookup-only", "lookup-only-compile"]  # fmt: skip


@pytest.mark.parametrize("kind", CALL_KINDS)
def test_no_call_builds_a_cache_it_does_not_run_on(kind, monkeypatch, eager_compiled):
    """Whoever makes the target's cache (generate(), the plan under compile=True, the caller, an earlier chat turn),
    a call builds at most the two caches it runs on, and each is one a forward writes: none is built only to be
    thrown away. Checked on the call that allocates and on the next, which may find the caches the first one kept."""
    target = tiny_lm(seed=0, vocab_size=64)
    lookup = kind.startswith("lookup-only")
    draft = "prompt_lookup" if lookup else perturbed_copy(target, seed=1, scale=0.1)
    config = SpeculativeConfig(compile="compile" in kind, **({} if lookup else dict(draft_form="as_given")))
    options = dict(cache_implementation="static") if "static" in kind else {}
    kwargs = dict(max_new_tokens=10, pad_token_id=PAD, num_lookahead=3, draft_model=draft, speculative_config=config,
                  return_dict_in_generate=True, **options)  # fmt: skip
    built = []
    real_init = cache_utils.Cache.__init__

    def counting(cache, *args, **kwargs):
        built.append(cache)
        real_init(cache, *args, **kwargs)

    for _ in range(2):
        prompt, caller = PROMPT % 48, {}
        if kind.startswith("caller"):
            caller = with_cache(DynamicCache(config=target.config))
        elif kind.startswith("chat"):  # the second turn continues the first's conversation on its returned cache
            first = target.generate(prompt, **kwargs)
            prompt = torch.cat([first.sequences, torch.tensor([[11, 12, 13]])], dim=1)
            caller = with_cache(cache_of(first))
        built.clear()
        with monkeypatch.context() as patched:
            patched.setattr(cache_utils.Cache, "__init__", counting)
            out = target.generate(prompt, **caller, **kwargs)
        assert out.speculative_stats.rounds > 0
        assert len(built) <= (1 if lookup else 2), [type(cache).__name__ for cache in built]
        unwritten = [type(cache).__name__ for cache in built if cache.get_seq_length() == 0]
        assert not unwritten, f"built and never run on: {unwritten}"


def test_the_drafts_refusals_are_asked_in_one_place(monkeypatch):
    """`prepare_draft` and a call's plan refuse a draft through the same `check_draft`: the models and the ids the
    draft reads are checked there once per call (a held `PreparedDraft` too), and nowhere else."""
    target = tiny_lm(seed=0, vocab_size=64)
    draft = perturbed_copy(target, seed=1, scale=0.1)
    asked = collections.Counter()
    for name in ("check_models", "check_tokenizers"):
        real = getattr(prepared_draft, name)

        def counting(*args, _real=real, _name=name):
            asked[_name] += 1
            return _real(*args)

        monkeypatch.setattr(prepared_draft, name, counting)
        monkeypatch.setattr(validation, name, counting)  # a second home would count twice
    prepared = prepare_draft(draft, target, form="as_given")
    assert asked == {"check_models": 1, "check_tokenizers": 1}
    for draft_model in (draft, prepared, "auto"):
        asked.clear()
        target.generate(PROMPT, max_new_tokens=3, pad_token_id=PAD, draft_model=draft_model, num_lookahead=2)
        assert asked == {"check_models": 1, "check_tokenizers": 1}, draft_model


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        (dict(draft_model="suffix"), MAX_MATCH),
        (dict(draft_model="suffix", max_matching_ngram_size=3), 3),
        (dict(draft_model="prompt_lookup", max_matching_ngram_size=2), 2),
        (dict(suffix_draft_store=True, max_matching_ngram_size=4), 4),
    ],
)
def test_every_suffix_drafter_matches_what_the_plan_says(monkeypatch, kwargs, expected):
    """The plan decides how many of a row's last tokens a suffix drafter matches (`CallPlan.max_ngram`), for the
    suffix drafter alone, beside a model and for prompt lookup alike; the loop builds its drafter with that."""
    from hf_specsample import SuffixDraft
    from hf_specsample.proposers import suffix as suffix_module

    target = tiny_lm(seed=0, vocab_size=64)
    if kwargs.pop("suffix_draft_store", False):
        kwargs.update(draft_model=perturbed_copy(target, seed=1, scale=0.1), suffix_draft=SuffixDraft())
    made = []
    real = suffix_module.SuffixProposer.__init__

    def recording(self, *args, **named):
        real(self, *args, **named)
        made.append(self.max_match)

    monkeypatch.setattr(suffix_module.SuffixProposer, "__init__", recording)
    target.generate(PROMPT, max_new_tokens=4, pad_token_id=PAD, **kwargs)
    assert made == [expected]
