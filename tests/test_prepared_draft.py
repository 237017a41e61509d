"""Prepared drafts: explicit objects from `prepare_draft`, and the implicit cache of `generate(draft_model=model)`,
which must never serve a copy that no longer matches the draft's weights or the options asked for, and must free
its memory with the draft."""

import copy
import gc
import weakref

import pytest
import torch
from tiny import PAD, implicit_draft, perturbed_copy, tiny_lm

import hf_specsample
from hf_specsample import DraftForm, SpeculativeConfig, prepare_draft
from hf_specsample.core.model_facts import ModelFacts
from hf_specsample.kernels.routing import KernelRouting
from hf_specsample.options import LinearKernel
from hf_specsample.prepare.implicit import _IMPLICIT
from hf_specsample.prepare.surgery import SharedFloat32Embedding, int8_dynamic_copy

INT8_LINEAR = torch.ao.nn.quantized.dynamic.Linear
# The forms AUTO times for a float32 CPU draft: as given and dynamic int8 (the kernel's forms: for bf16 drafts only).
FORMS = ["as_given", "dynamic_int8"]
PROMPT = torch.tensor([[1, 17, 42, 5, 9]])


def make_target(seed: int = 0, vocab_size: int = 64):
    return tiny_lm(seed=seed, vocab_size=vocab_size, layers=2, hidden=64, init_range=0.3)


@pytest.fixture(scope="module")
def pair():
    target = make_target()
    return target, perturbed_copy(target, seed=1, scale=0.1)


def greedy(target, **kwargs):
    return target.generate(PROMPT, do_sample=False, max_new_tokens=24, pad_token_id=PAD, **kwargs)


def test_a_prepared_draft_runs_as_it_is(pair, int8_steps_faster):
    target, draft = pair
    prepared = hf_specsample.prepare_draft(draft, target)
    assert isinstance(prepared.model.model.layers[0].mlp.up_proj, INT8_LINEAR)
    assert prepared.form is DraftForm.DYNAMIC_INT8  # AUTO resolved: a float draft on the CPU
    calls = []
    handle = prepared.model.register_forward_hook(lambda *args: calls.append(1))
    gc.collect()  # entries of earlier tests' drafts that only the collector frees: not this test's
    entries = len(_IMPLICIT)
    try:
        assert torch.equal(greedy(target, draft_model=prepared), greedy(target))
    finally:
        handle.remove()
    assert calls and len(_IMPLICIT) == entries  # its own model ran; nothing was prepared behind the caller's back


@pytest.mark.parametrize(
    "config", [SpeculativeConfig(draft_form="as_given"), SpeculativeConfig(draft_vocabulary=32)], ids=str
)
def test_options_of_a_prepared_draft_belong_to_prepare_draft(pair, config):
    target, draft = pair
    with pytest.raises(ValueError, match=r"set them there \(prepare_draft"):
        greedy(target, draft_model=prepare_draft(draft, target), speculative_config=config)


def test_prepared_vocabulary_and_int_vocabulary(pair):
    target, draft = pair
    prepared = prepare_draft(draft, target, form="as_given", vocabulary=10)
    assert prepared.vocabulary.tolist() == list(range(10))  # the tiny target's EOS/pad/BOS ids are below 10
    assert prepared.model(PROMPT).logits.shape[-1] == 10
    assert torch.equal(greedy(target, draft_model=prepared), greedy(target))


def test_the_implicit_cache_keys_on_the_exact_vocabulary(pair):
    """A fingerprint (count, sum, last id) mixed these two up and served the draft prepared for the other."""
    target, draft = pair
    first = implicit_draft(draft, target, vocabulary=torch.tensor([1, 2, 5, 10]))
    second = implicit_draft(draft, target, vocabulary=torch.tensor([0, 3, 5, 10]))
    assert first.vocabulary.tolist() == [1, 2, 5, 10] and second.vocabulary.tolist() == [0, 3, 5, 10]
    assert implicit_draft(draft, target, vocabulary=torch.tensor([10, 2, 5, 1])) is first  # same ids, same entry


def test_the_implicit_cache_keys_on_the_form(pair):
    target, draft = pair
    int8 = implicit_draft(draft, target, "dynamic_int8")
    assert int8 is not implicit_draft(draft, target, "dynamic_int8", vocabulary=40)
    assert implicit_draft(draft, target, "as_given", vocabulary=40).model.model is draft.model  # a view, no int8 copy


def mutations():
    """Ways of changing a draft's weights after its int8 copy was made; each must make a new copy."""

    def load_state_dict(draft, other):
        draft.load_state_dict(other.state_dict())

    @torch.no_grad()
    def copy_in_no_grad(draft, other):
        draft.lm_head.weight.copy_(other.lm_head.weight)

    def add_in_inference_mode(draft, other):
        with torch.inference_mode():
            draft.model.layers[0].mlp.up_proj.weight.add_(1.0)

    def optimizer_step(draft, other):
        optimizer = torch.optim.SGD(draft.parameters(), lr=0.1)
        draft(PROMPT).logits.sum().backward()
        optimizer.step()
        draft.zero_grad(set_to_none=True)

    def replace_parameter(draft, other):
        draft.lm_head.weight = torch.nn.Parameter(other.lm_head.weight.detach().clone())

    def assign_data(draft, other):
        draft.lm_head.weight.data = other.lm_head.weight.detach().clone()

    def change_dtype(draft, other):
        draft.to(torch.bfloat16)

    return [load_state_dict, copy_in_no_grad, add_in_inference_mode, optimizer_step, replace_parameter, assign_data,
            change_dtype]  # fmt: skip


@pytest.mark.parametrize("mutate", mutations(), ids=lambda mutate: mutate.__name__)
def test_a_changed_draft_gets_a_new_copy(mutate, int8_steps_faster):
    target = make_target()
    draft, other = perturbed_copy(target, seed=1, scale=0.1), make_target(seed=7)
    first = implicit_draft(draft, target)
    assert implicit_draft(draft, target) is first
    mutate(draft, other)
    second = implicit_draft(draft, target)
    assert second is not first
    assert implicit_draft(draft, target) is second  # and that one is kept while nothing changes
    reference = int8_dynamic_copy(draft)
    torch.testing.assert_close(second.model(PROMPT).logits, reference(PROMPT).logits)


def test_a_draft_made_under_inference_mode_is_prepared_once(pair, int8_steps_faster):
    """Inference tensors have no version counter; such a draft still works and its copy is still kept."""
    target, _ = pair
    with torch.inference_mode():
        draft = perturbed_copy(target, seed=1, scale=0.1)
    assert next(draft.parameters()).is_inference()
    assert torch.equal(greedy(target, draft_model=draft), greedy(target))
    assert implicit_draft(draft, target) is implicit_draft(draft, target)


def test_acceptance_follows_weights_loaded_into_the_draft():
    """The stale int8 copy kept acceptance at 0.00 after load_state_dict; a fresh one gets what the weights give."""
    target = make_target()
    draft = make_target(seed=7)  # unrelated weights: a useless draft

    def acceptance() -> float:
        out = greedy(target, draft_model=draft, num_lookahead=4, return_dict_in_generate=True)
        assert torch.equal(out.sequences, greedy(target))
        return out.speculative_stats.acceptance_rate

    useless = acceptance()
    draft.load_state_dict(target.state_dict())  # now an int8 copy of the target itself
    assert acceptance() > max(0.8, useless)


def collected(make_and_use) -> list[str]:
    """Names of the objects `make_and_use()` returns (as weak references) that are still alive after a collection."""
    references = make_and_use()
    gc.collect()
    return [name for name, reference in references.items() if reference() is not None]


@pytest.mark.parametrize(
    "options",
    [dict(), dict(vocabulary=40), dict(form="as_given", vocabulary=40)],
    ids=["int8", "int8+vocabulary", "vocabulary-view"],
)
def test_the_draft_and_its_prepared_copy_are_freed_with_the_draft(pair, options, int8_steps_faster):
    target, _ = pair
    gc.collect()  # entries of earlier tests' drafts that only the collector frees: not this test's
    entries = len(_IMPLICIT)

    def make_and_use():
        draft = perturbed_copy(target, seed=3, scale=0.1)
        prepared = implicit_draft(draft, target, **options)
        assert prepared.model is not draft and len(_IMPLICIT) == entries + 1
        greedy(
            target,
            draft_model=draft,
            speculative_config=SpeculativeConfig(
                draft_form=options.get("quantization", "auto"), draft_vocabulary=options.get("vocabulary")
            ),
        )
        return {"draft": weakref.ref(draft), "prepared model": weakref.ref(prepared.model)}

    assert collected(make_and_use) == []
    assert len(_IMPLICIT) == entries


def test_the_auto_draft_is_freed_with_the_target():
    gc.collect()  # entries of earlier tests' drafts that only the collector frees: not this test's
    entries = len(_IMPLICIT)

    def make_and_use():
        target = make_target()
        greedy(target, draft_model="auto")
        prepared = implicit_draft("auto", target)
        return {"target": weakref.ref(target), "auto draft": weakref.ref(prepared.model)}

    assert collected(make_and_use) == []
    assert len(_IMPLICIT) == entries


def test_the_int8_copy_shares_the_embedding_and_computes_what_a_float32_copy_computes():
    """The copy no longer holds a float32 copy of the embedding (Qwen2.5-Coder-1.5B: 934 MB); logits are the same
    bit for bit as those of the former full float32 copy."""
    draft = make_target().to(torch.bfloat16)
    quantized = int8_dynamic_copy(draft)
    assert isinstance(quantized.get_input_embeddings(), SharedFloat32Embedding)
    assert quantized.get_input_embeddings().weight is draft.model.embed_tokens.weight
    assert draft.model.embed_tokens.weight.dtype == torch.bfloat16  # .float() on the copy left the source alone
    reference = copy.deepcopy(draft).float().eval()
    torch.ao.quantization.quantize_dynamic(reference, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
    assert torch.equal(quantized(PROMPT).logits, reference(PROMPT).logits)


def test_an_auto_draft_drafts_only_for_its_own_target(pair):
    target, _ = pair
    prepared = prepare_draft("auto", target)
    assert torch.equal(greedy(target, draft_model=prepared), greedy(target))
    with pytest.raises(ValueError, match="from another target"):
        greedy(make_target(seed=5), draft_model=prepared)


def test_auto_without_quantization_skips_middle_layers():
    target = tiny_lm(seed=0, vocab_size=64, layers=10, hidden=32, init_range=0.3)
    prepared = prepare_draft("auto", target, form="as_given")
    assert len(prepared.model.model.layers) == 8  # layers 4 and 5 skipped
    assert prepared.model.model.layers[4].mlp.up_proj.weight is target.model.layers[6].mlp.up_proj.weight
    assert torch.equal(greedy(target, draft_model=prepared), greedy(target))


def test_a_prepared_draft_serves_targets_of_another_width():
    """Which ids a draft proposes over depends on the target's width: computed per call, not frozen."""
    target = make_target(vocab_size=64)
    draft = perturbed_copy(target, seed=1, scale=0.1)
    prepared = prepare_draft(draft, target)
    assert prepared.ids_for(ModelFacts.of(target)) is None
    wide = make_target(vocab_size=64)
    wide.resize_token_embeddings(72, mean_resizing=False)
    assert prepared.ids_for(ModelFacts.of(wide)).tolist() == list(range(64))
    assert torch.equal(greedy(wide, draft_model=prepared), greedy(wide))
    subset = prepare_draft(draft, wide, vocabulary=torch.tensor([0, 1, 2, 63]))
    narrow = make_target(vocab_size=48)
    with pytest.raises(ValueError, match="scores only 48 ids"):
        greedy(narrow, draft_model=subset)


# --- AUTO times the draft's forms at first use and keeps the faster one ---


def test_auto_keeps_the_form_that_steps_faster(pair, as_given_steps_faster):
    """Where the draft as given steps faster than its int8 copy (a CPU with fast bf16, or a tiny draft), it drafts
    as given; the decision is timed once per draft, and the statistics say what drafted and what was measured."""
    target, _ = pair
    draft = perturbed_copy(target, seed=5, scale=0.1)
    prepared = prepare_draft(draft, target)
    assert prepared.model is draft and prepared.form is DraftForm.AS_GIVEN
    timed = {DraftForm.AS_GIVEN: 0.001, DraftForm.DYNAMIC_INT8: 0.002, DraftForm.INT8_WEIGHTS: 0.003}
    timed = {form: seconds for form, seconds in timed.items() if form in FORMS}
    assert prepared.step_seconds == timed
    assert as_given_steps_faster == [len(FORMS)]
    out = greedy(target, draft_model=draft, return_dict_in_generate=True)
    out = greedy(target, draft_model=draft, return_dict_in_generate=True)  # the decision is remembered
    assert as_given_steps_faster == [len(FORMS)] * 2  # prepare_draft above, then the first generate() only
    shown = ", ".join(f"{form} {seconds * 1e3:.1f} ms" for form, seconds in timed.items())
    assert out.speculative_stats.draft_form == f"as_given (timed per step: {shown})"
    assert torch.equal(out.sequences, greedy(target))


def test_auto_keeps_the_int8_copy_where_it_steps_faster(pair, int8_steps_faster):
    target, _ = pair
    draft = perturbed_copy(target, seed=6, scale=0.1)
    out = greedy(target, draft_model=draft, return_dict_in_generate=True)
    timed = "dynamic_int8 (timed per step: as_given 2.0 ms, dynamic_int8 1.0 ms"
    assert out.speculative_stats.draft_form.startswith(timed)
    assert isinstance(implicit_draft(draft, target).model.model.layers[0].mlp.up_proj, INT8_LINEAR)
    assert int8_steps_faster == [len(FORMS)]
    forced = greedy(target, draft_model=draft, return_dict_in_generate=True,
                    speculative_config=SpeculativeConfig(draft_form="dynamic_int8"))  # fmt: skip
    assert forced.speculative_stats.draft_form == "dynamic_int8"
    assert int8_steps_faster == [len(FORMS)]  # asked for: not timed


def test_an_as_given_decision_does_not_keep_the_draft_alive(pair, as_given_steps_faster):
    target, _ = pair
    gc.collect()  # entries of earlier tests' drafts that only the collector frees: not this test's
    entries = len(_IMPLICIT)

    def make_and_use():
        draft = perturbed_copy(target, seed=7, scale=0.1)
        greedy(target, draft_model=draft)
        assert len(_IMPLICIT) == entries + 1 and implicit_draft(draft, target).model is draft
        return {"draft": weakref.ref(draft)}

    assert collected(make_and_use) == []
    assert len(_IMPLICIT) == entries


def test_decode_step_seconds_times_each_model_and_skips_a_broken_one(pair):
    from hf_specsample.prepare.draft_timing import decode_step_seconds

    target, draft = pair
    broken = perturbed_copy(draft, seed=2, scale=0.0)
    broken.forward = lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("cannot run"))
    quick, slow, failed = decode_step_seconds([draft, make_target(vocab_size=64).to(torch.float64), broken])
    assert 0 < quick < float("inf") and 0 < slow < float("inf") and failed == float("inf")


def test_prompt_lookup_statistics_name_the_drafter(pair):
    target, _ = pair
    out = greedy(target, draft_model="prompt_lookup", return_dict_in_generate=True)
    assert out.speculative_stats.draft_form == "prompt_lookup"


# --- a seeded call (and a tensor-parallel target, tests/test_tensor_parallel.py) chooses without the clock ---


def test_a_seeded_call_chooses_the_form_without_the_clock(pair, as_given_steps_faster):
    """A seeded sample must repeat in another process, where timings differ: AUTO then times nothing and takes the
    first form made in `CLOCK_FREE_ORDER`; an unseeded call with the same options still times (its own entry)."""
    from hf_specsample.prepare.form_choice import CLOCK_FREE_ORDER

    target, _ = pair
    draft = perturbed_copy(target, seed=8, scale=0.1)
    generator = torch.Generator().manual_seed(0)
    out = target.generate(PROMPT, do_sample=True, max_new_tokens=12, pad_token_id=PAD, draft_model=draft,
                          generator=generator, return_dict_in_generate=True)  # fmt: skip
    expected = next(form for form in CLOCK_FREE_ORDER if str(form) in FORMS)
    assert as_given_steps_faster == []  # nothing timed
    assert out.speculative_stats.draft_form.startswith(f"{expected} (chosen without the clock, weights read per step")
    timed = greedy(target, draft_model=draft, return_dict_in_generate=True)
    assert as_given_steps_faster == [len(FORMS)]  # the timed choice is its own entry
    assert timed.speculative_stats.draft_form.startswith("as_given (timed per step")
    again = target.generate(PROMPT, do_sample=True, max_new_tokens=12, pad_token_id=PAD, draft_model=draft,
                            generator=torch.Generator().manual_seed(0), return_dict_in_generate=True)  # fmt: skip
    assert torch.equal(again.sequences, out.sequences) and as_given_steps_faster == [len(FORMS)]


def test_a_seeded_calls_draft_does_not_depend_on_earlier_calls(pair):
    """Clock-free, the implicit draft is chosen from the weights alone, not from the first call's prompt: a long
    prompt's seeded sample is the same whether or not a short-prompt call prepared the draft before it."""
    target, _ = pair
    fresh = perturbed_copy(target, seed=9, scale=0.1)
    used = copy.deepcopy(fresh)
    long_prompt = torch.arange(1, 41)[None, :] % 60 + 1  # (1, 40): long enough to calibrate on

    def seeded(draft, prompt):
        return target.generate(prompt, do_sample=True, max_new_tokens=16, pad_token_id=PAD, draft_model=draft,
                               generator=torch.Generator().manual_seed(0), return_dict_in_generate=True)  # fmt: skip

    alone = seeded(fresh, long_prompt)
    seeded(used, PROMPT)
    after = seeded(used, long_prompt)
    assert torch.equal(alone.sequences, after.sequences)
    assert alone.speculative_stats.draft_form == after.speculative_stats.draft_form
    assert "acceptance" not in alone.speculative_stats.draft_form  # the prompt did not weigh in


def test_clock_free_with_calibration_weighs_acceptance_by_weight_bytes(pair, as_given_steps_faster):
    """`prepare_draft(..., calibration=)` for a tensor-parallel target: no clock; the best expected speedup with
    each form's cost taken as its weight bytes per step over the target's."""
    from hf_specsample.policy.round_costs import expected_speedup, weight_bytes
    from hf_specsample.prepare.prepared_draft import DraftRecipe, build_draft, resolve_draft

    target, _ = pair
    draft = perturbed_copy(target, seed=10, scale=0.1)
    calibration = torch.arange(1, 41) % 60 + 1
    facts = ModelFacts.of(target)
    routing = KernelRouting.for_model(facts, LinearKernel.AUTO, clock_free=True)

    def build():
        recipe = DraftRecipe(resolve_draft(draft), facts, ModelFacts.of(draft), DraftForm.AUTO, None, routing)
        return build_draft(recipe._replace(calibration=calibration, clock_free=True))

    prepared = build()
    assert as_given_steps_faster == []
    assert set(prepared.acceptance) == set(prepared.step_bytes) and len(prepared.step_bytes) >= len(FORMS)
    value = {
        form: expected_speedup(rate, prepared.step_bytes[form] / weight_bytes(target))
        for form, rate in prepared.acceptance.items()
    }
    assert prepared.form is max(value, key=value.get)
    again = build()
    assert again.form is prepared.form and again.acceptance == prepared.acceptance
