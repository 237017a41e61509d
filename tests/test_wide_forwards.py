"""A quantized draft's wide forwards (the prompt) on its float original: routed by rows, timed by AUTO, exact."""

import gc
import math
import weakref
from dataclasses import replace

import pytest
import torch
from exact import chisquare_pvalue, continuations, exact_distribution
from tiny import PAD, cache_of, implicit_draft, perturbed_copy, prepared_processors, tiny_lm, with_cache

from hf_specsample.cache.cached_model import CachedModel
from hf_specsample.cache.forwards import Forwards, WideForwards
from hf_specsample.core.model_facts import ModelFacts
from hf_specsample.core.sequences import Sequences
from hf_specsample.options import DraftForm
from hf_specsample.prepare import form_choice
from hf_specsample.prepare.draft_timing import forward_seconds
from hf_specsample.prepare.form_choice import PROMPT_LENGTHS
from hf_specsample.prepare.implicit import _IMPLICIT
from hf_specsample.prepare.prepared_draft import prepare_draft

PROMPT = torch.tensor([[1, 17, 42, 5, 9, 33, 2]])


@pytest.fixture(scope="module")
def pair():
    target = tiny_lm(seed=0, vocab_size=64, layers=2, hidden=64, init_range=0.3)
    return target, perturbed_copy(target, seed=1, scale=0.1)


def calls_of(model) -> list[int]:
    """The widths of `model`'s forwards from now on that pass `input_ids=` as the loop does (a test's reference
    forwards pass them by position); on models made by the test."""
    widths = []

    def record(module, args, kwargs, out):
        if "input_ids" in kwargs:
            widths.append(kwargs["input_ids"].shape[1])

    model.register_forward_hook(record, with_kwargs=True)
    return widths


@torch.no_grad()
def test_forwards_of_many_rows_run_on_the_wide_model_and_share_its_cache():
    """From `from_rows` rows on, the wide model runs and writes the cache the other model then reads."""
    narrow, wide = (tiny_lm(seed=seed, vocab_size=64, layers=2, hidden=32) for seed in (3, 4))
    narrow_calls, wide_calls = calls_of(narrow), calls_of(wide)
    sequences = Sequences(torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(0)), None, capacity=12)
    sequences.tokens[:, 6:] = 7
    cached = CachedModel(ModelFacts.of(narrow), batch=2, forwards=Forwards(wide=WideForwards(wide, from_rows=6)))
    sequences.rows.attach(cached)
    logits = cached.feed_upto(sequences, [6, 6], num_logits=1)  # 2 rows x 6 positions = 12 rows
    torch.testing.assert_close(logits[:, 0], wide(sequences.tokens[:, :6]).logits[:, -1])
    step = cached.feed_upto(sequences, [8, 8], num_logits=2)  # 2 x 2 = 4 rows: the narrow model, on wide's cache
    cache = cache_of(wide(sequences.tokens[:, :6], use_cache=True))
    expected = narrow(sequences.tokens[:, 6:8], **with_cache(cache), use_cache=True).logits
    torch.testing.assert_close(step, expected)
    assert (wide_calls, narrow_calls) == ([6], [2])
    cached.feed_upto(sequences, [11, 11], num_logits=1)  # 2 x 3 = 6 rows: the wide model again
    assert (wide_calls, narrow_calls) == ([6, 3], [2])


def sampled(target, draft, seed: int) -> list:
    settings = dict(temperature=0.9, top_k=6)
    out = target.generate(
        PROMPT, do_sample=True, max_new_tokens=3, num_return_sequences=3000, pad_token_id=PAD,
        generator=torch.Generator().manual_seed(seed), draft_model=draft, num_lookahead=2, **settings,
    )  # fmt: skip
    processors, _ = prepared_processors(target, PROMPT, do_sample=True, max_new_tokens=3, **settings)
    return exact_distribution(target, PROMPT, processors, 3), continuations(out, PROMPT.shape[1])


@torch.no_grad()
def test_sampling_is_exact_when_the_prompt_runs_on_another_model(pair):
    """The prompt forward (3000 rows x 7 positions) on an unrelated model, the draft's steps (at most 3000 x 2) on
    the draft: the draft's cache then holds another model's keys, and the samples still follow the target."""
    target, _ = pair
    draft = perturbed_copy(target, seed=1, scale=0.1)
    unrelated = tiny_lm(seed=9, vocab_size=64, layers=2, hidden=64, init_range=0.3)
    prepared = replace(prepare_draft(draft, target, form="as_given"), wide=WideForwards(unrelated, 3000 * 7))
    wide_calls, draft_calls = calls_of(unrelated), calls_of(draft)
    exact, samples = sampled(target, prepared, seed=4)
    assert wide_calls == [7] and draft_calls and max(draft_calls) <= 2
    assert chisquare_pvalue(exact, samples) > 1e-3


@torch.no_grad()
def test_greedy_is_the_targets_when_the_prompt_runs_on_the_float_draft(pair):
    target, _ = pair
    draft = perturbed_copy(target, seed=1, scale=0.1)
    prepared = prepare_draft(draft, target, form="int8_weights" if _kernel_built() else "dynamic_int8")
    prepared = replace(prepared, wide=WideForwards(draft, 4))
    wide_calls = calls_of(draft)
    kwargs = dict(do_sample=False, max_new_tokens=20, pad_token_id=PAD)
    out = target.generate(PROMPT, draft_model=prepared, num_lookahead=3, **kwargs)
    assert wide_calls == [7]  # the prompt only; single-token steps and catch-ups (1-2 positions) on the int8 form
    assert out.tolist() == target.generate(PROMPT, **kwargs).tolist()


def _kernel_built() -> bool:
    from hf_specsample.kernels import small_rows

    return small_rows.load().problem is None


@pytest.mark.parametrize(("faster_from", "expected"), [(32, 32), (128, 128), (None, None)])
def test_auto_runs_prompts_on_the_float_draft_from_the_narrowest_width_timed_faster(
    pair, monkeypatch, faster_from, expected
):
    from conftest import _timed_forms

    _timed_forms(monkeypatch, wide_faster_from=faster_from, dynamic_int8=0.001, as_given=0.003, int8_weights=0.002)
    target, draft = pair
    prepared = prepare_draft(draft, target)
    assert prepared.form is DraftForm.DYNAMIC_INT8
    timed = list(prepared.wide_seconds)
    if expected is None:
        assert prepared.wide is None and timed == list(PROMPT_LENGTHS)
        assert "on the draft as given" not in prepared.description
    else:
        assert prepared.wide == WideForwards(draft, expected)
        assert timed == [width for width in PROMPT_LENGTHS if width <= expected]  # no timing past the first win
        assert f"forwards of {expected}+ positions on the draft as given" in prepared.description
    forms = {DraftForm.DYNAMIC_INT8, DraftForm.AS_GIVEN}
    assert all(set(by_form) == forms for by_form in prepared.wide_seconds.values())


@torch.no_grad()
def test_no_prompt_forwards_on_a_draft_of_another_dtype(monkeypatch):
    """The dynamic-int8 copy computes in float32: a bf16 draft's keys could not join its cache (sdpa refuses mixed
    dtypes), so AUTO neither times nor uses the bf16 draft for its prompts, and generation runs."""
    from conftest import _timed_forms

    _timed_forms(monkeypatch, wide_faster_from=32, dynamic_int8=0.001, as_given=0.003, int8_weights=0.002)
    target = tiny_lm(seed=0, vocab_size=64, layers=2, hidden=64, init_range=0.3).to(torch.bfloat16)
    draft = perturbed_copy(target, seed=1, scale=0.1)
    prepared = prepare_draft(draft, target)
    assert prepared.form is DraftForm.DYNAMIC_INT8 and prepared.model.dtype == torch.float32
    assert prepared.wide is None and prepared.wide_seconds == {}
    kwargs = dict(do_sample=False, max_new_tokens=12, pad_token_id=PAD)
    out = target.generate(PROMPT, draft_model=prepared, num_lookahead=3, **kwargs)
    assert out.tolist() == target.generate(PROMPT, **kwargs).tolist()


def test_no_prompt_timing_where_the_draft_runs_as_given_or_without_the_clock(pair, monkeypatch):
    from conftest import _timed_forms

    target, draft = pair
    timed = []
    _timed_forms(monkeypatch, wide_faster_from=32, dynamic_int8=0.003, as_given=0.001, int8_weights=0.002)
    monkeypatch.setattr(form_choice, "time_wide_forwards", lambda models, width: timed.append(width) or [1.0, 0.5])
    assert prepare_draft(draft, target).form is DraftForm.AS_GIVEN  # the draft as given: nothing to time
    clock_free = implicit_draft(perturbed_copy(draft, 2, 0.01), target, clock_free=True)
    assert clock_free.form is not DraftForm.AS_GIVEN and clock_free.wide is None
    forced = prepare_draft(draft, target, form="dynamic_int8")  # a form asked for: it drafts, prompts included
    assert forced.wide is None
    assert timed == []


@pytest.mark.parametrize("self_draft", [False, True], ids=["draft", "auto"])
def test_the_implicit_entry_never_holds_the_model_it_runs_prompts_on(built, monkeypatch, self_draft):
    """The float model the prompt runs on is the entry's key (the draft; the target for "auto"): it is put back on
    each call, never stored, so the entry is freed with it. (bf16 models: AUTO weighs the int8-weights form, bf16 as
    they are, for them; "auto" of a float32 target has one form, dynamic int8, and nothing to time.)"""
    from conftest import _timed_forms

    _timed_forms(monkeypatch, wide_faster_from=32, dynamic_int8=0.002, as_given=0.003, int8_weights=0.001)
    gc.collect()  # entries of earlier tests' drafts that only the collector frees: not this test's
    entries = len(_IMPLICIT)

    def make_and_use():
        target = tiny_lm(seed=0, vocab_size=64, layers=2, hidden=64, init_range=0.3).to(torch.bfloat16)
        draft = "auto" if self_draft else perturbed_copy(target, seed=3, scale=0.1)
        owner = target if self_draft else draft
        prepared = implicit_draft(draft, target)
        assert prepared.wide is not None and prepared.wide.model is owner
        again = implicit_draft(draft, target)
        assert again.model is prepared.model and again.wide.model is owner  # the entry, with the owner put back
        out = target.generate(PROMPT, draft_model=draft, do_sample=False, max_new_tokens=5, pad_token_id=PAD,
                              return_dict_in_generate=True)  # fmt: skip
        source = "the target" if self_draft else "the draft as given"
        assert f"forwards of 32+ positions on {source}" in out.speculative_stats.draft_form
        return {"owner": weakref.ref(owner), "prepared model": weakref.ref(prepared.model)}

    references = make_and_use()
    gc.collect()
    assert [name for name, reference in references.items() if reference() is not None] == []
    assert len(_IMPLICIT) == entries


@torch.no_grad()
def test_forward_seconds_times_each_model_and_marks_a_failing_one():
    good = tiny_lm(seed=0, vocab_size=64, layers=1, hidden=32)
    broken = tiny_lm(seed=1, vocab_size=64, layers=1, hidden=32)
    broken.model.norm.register_forward_hook(lambda *args: (_ for _ in ()).throw(RuntimeError("broken")))
    seconds = forward_seconds([good, broken], width=16)
    assert 0 < seconds[0] < math.inf and seconds[1] == math.inf
