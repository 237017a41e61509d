"""`SpeculativeConfig(compile_draft=True)`: the draft's single-token steps run compiled (tiny models compile in
seconds). What the draft computes changes only how often its proposals are accepted: greedy output stays the
target's own and samples follow the target's distribution."""

from __future__ import annotations

import pytest
import torch
from exact import sampled_pvalue
from tiny import PAD, perturbed_copy, tiny_lm

from hf_specsample import SpeculativeConfig
from hf_specsample.cache.compiled import CompiledForward
from hf_specsample.kernels import small_rows
from hf_specsample.kernels.quantized_linear import SiblingProjection
from hf_specsample.kernels.small_rows import KernelPath
from hf_specsample.prepare.surgery import int4_weights_copy, int8_weights_copy, without_siblings

PROMPT = torch.tensor([[1, 5, 2, 5]])
BATCH = torch.tensor([[PAD, PAD, 1, 5], [1, 5, 2, 5]])  # left-padded rows: the draft's steps take a mask
BATCH_MASK = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])


def pair():
    target = tiny_lm(seed=0, vocab_size=16, layers=2, hidden=32)
    return target, perturbed_copy(target, seed=1, scale=0.3)


def count_steps(monkeypatch) -> list[tuple[int, ...]]:
    """The shapes of the input ids every compiled forward of a round is called with (the warm-up's, at position 2 of
    a throwaway cache, are left out: every prompt here is longer)."""
    calls = []
    real = CompiledForward.__call__

    def counting(self, **kwargs):
        if int(kwargs["position_ids"].min()) > 2:
            calls.append(tuple(kwargs["input_ids"].shape))
        return real(self, **kwargs)

    monkeypatch.setattr(CompiledForward, "__call__", counting)
    return calls


def greedy(model, inputs=PROMPT, **kwargs):
    mask = BATCH_MASK if inputs is BATCH else None
    return model.generate(inputs, attention_mask=mask, do_sample=False, max_new_tokens=16, pad_token_id=PAD, **kwargs)


@pytest.mark.parametrize("form", ["as_given", "int8_weights"])
@pytest.mark.parametrize("inputs", [PROMPT, BATCH], ids=["one row", "padded rows"])
@torch.no_grad()
def test_greedy_with_compiled_draft_steps_equals_plain(built, monkeypatch, form, inputs):
    target, draft = pair()
    calls = count_steps(monkeypatch)
    config = SpeculativeConfig(compile_draft=True, draft_form=form)
    out = greedy(target, inputs, draft_model=draft, num_lookahead=3, speculative_config=config,
                 return_dict_in_generate=True)  # fmt: skip
    assert out.sequences.tolist() == greedy(target, inputs).tolist()
    stats = out.speculative_stats
    assert stats.draft_compile_seconds is not None and "compiled draft steps" in str(stats)
    assert calls and all(shape == (inputs.shape[0], 1) for shape in calls)  # single-token steps of every row
    # the rounds' steps ran compiled too, not only the warm-up's three
    assert stats.draft_forward_passes > 0


@torch.no_grad()
def test_a_second_call_reuses_the_compiled_steps(built):
    target, draft = pair()
    config = SpeculativeConfig(compile_draft=True, draft_form="int8_weights")
    first = greedy(target, draft_model=draft, speculative_config=config, return_dict_in_generate=True)
    second = greedy(target, draft_model=draft, speculative_config=config, return_dict_in_generate=True)
    assert first.speculative_stats.draft_compile_seconds > 0.0
    assert second.speculative_stats.draft_compile_seconds == 0.0  # the prepared draft's view, compiled once
    assert first.sequences.tolist() == second.sequences.tolist()


@pytest.mark.parametrize("form", ["as_given", "int8_weights"])
@torch.no_grad()
def test_sampling_with_compiled_draft_steps_is_exact(built, monkeypatch, form):
    target, draft = pair()
    calls = count_steps(monkeypatch)
    config = SpeculativeConfig(compile_draft=True, draft_form=form)
    pvalue = sampled_pvalue(
        target, PROMPT, num_tokens=3, rows=4000, seed=4, settings=dict(temperature=0.9, top_k=5),
        draft_model=draft, num_lookahead=2, speculative_config=config,
    )  # fmt: skip
    assert pvalue > 1e-3
    assert calls  # the rounds drafted through the compiled step


@torch.no_grad()
def test_sampling_test_catches_a_compiled_step_whose_probabilities_are_not_the_drafts(built, monkeypatch):
    """Power: proposals drawn from another distribution than the one the compiled step reports (its
    probabilities cubed) fail the same test."""
    from hf_specsample.proposers import draft_model

    target, draft = pair()
    real = draft_model.sample_from_weights
    monkeypatch.setattr(draft_model, "sample_from_weights", lambda weights, generator: real(weights**3, generator))
    config = SpeculativeConfig(compile_draft=True, draft_form="int8_weights")
    pvalue = sampled_pvalue(
        target, PROMPT, num_tokens=3, rows=4000, seed=4, settings=dict(temperature=0.9, top_k=5),
        draft_model=draft, num_lookahead=2, speculative_config=config,
    )  # fmt: skip
    assert pvalue < 1e-3


def test_compile_draft_is_refused_before_any_forward_where_the_draft_cannot_compile(built):
    """A hybrid draft (its states roll back in eager forwards only) is refused before the draft or the target runs
    (AUTO's timings included), with what to do instead."""
    from hf_specsample_bench.hybrids import tiny_hybrid

    target = tiny_lm(seed=0, vocab_size=48, layers=2, hidden=32)
    hybrid = tiny_hybrid("lfm2", seed=1, vocab_size=48)
    forwards = []
    for model in (target, hybrid):
        model.register_forward_hook(lambda *args: forwards.append(1))
    config = SpeculativeConfig(compile_draft=True)
    with pytest.raises(ValueError, match="compile_draft=True cannot compile this draft: it keeps convolution"):
        greedy(target, draft_model=hybrid, speculative_config=config)
    assert not forwards
    with pytest.raises(TypeError, match="compile_draft must be True or False"):
        SpeculativeConfig(compile_draft="yes")


@torch.no_grad()
def test_torchs_dynamic_int8_form_drafts_eagerly_and_says_so(built, monkeypatch):
    """Its linears break a compiled graph each (packed script objects): where that form drafts (forced here, or
    chosen by AUTO), the steps run eagerly, exactly, and the statistics say why."""
    target, draft = pair()
    calls = count_steps(monkeypatch)
    config = SpeculativeConfig(compile_draft=True, draft_form="dynamic_int8")
    out = greedy(target, draft_model=draft, speculative_config=config, return_dict_in_generate=True)
    assert out.sequences.tolist() == greedy(target).tolist()
    stats = out.speculative_stats
    assert not calls and stats.draft_compile_seconds is None
    assert "its steps run eagerly under compile_draft: torch's dynamic int8" in stats.draft_form


@pytest.mark.parametrize("form", ["int8_weights", "int4_weights"])
@torch.no_grad()
def test_without_siblings_shares_the_weights_and_computes_the_same(built, form):
    """The view compiled steps run: each sibling a layer of its own over its rows of the fused weight (no copy),
    computing what the fused form computes, bit for bit."""
    if form == "int4_weights" and small_rows.best_path(torch.uint8) is KernelPath.SCALAR:
        pytest.skip("int4 weights need a vector path that reads them")
    model = tiny_lm(seed=0, vocab_size=16, layers=2, hidden=128).to(torch.bfloat16)
    fused = (int8_weights_copy if form == "int8_weights" else int4_weights_copy)(model)
    view = without_siblings(fused)
    assert any(isinstance(module, SiblingProjection) for module in fused.modules())
    assert not any(isinstance(module, SiblingProjection) for module in view.modules())
    attention, fused_attention = view.model.layers[0].self_attn, fused.model.layers[0].self_attn
    name = "weight" if form == "int8_weights" else "packed"
    shared = getattr(fused_attention.q_proj.fused, name)
    for projection in ("q_proj", "k_proj", "v_proj"):
        weight = getattr(getattr(attention, projection), name)
        assert weight.untyped_storage().data_ptr() == shared.untyped_storage().data_ptr()
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    assert torch.equal(view(ids).logits, fused(ids).logits)
    assert torch.equal(view(ids[:, :1]).logits, fused(ids[:, :1]).logits)
    assert without_siblings(model) is model  # nothing fused: the model itself


@pytest.mark.parametrize("name", ["mistral_sliding", "gemma2"])
@torch.no_grad()
def test_sliding_window_drafts_run_compiled_past_the_window(built, monkeypatch, name):
    """A draft whose cache layers record their past and trim to a window (4 slots here) runs compiled steps past the
    window, and greedy output is the target's own. (Passing the window takes another code path in the cache layer:
    dynamo compiles it then, once; a round that compiled is kept out of the policy's cost estimates.)"""
    from tiny import arch_draft, tiny_arch

    target = tiny_arch(name, seed=0)
    draft = arch_draft(target, seed=1)
    calls = count_steps(monkeypatch)
    # the draft as given: AUTO's timed choice of a form could pick dynamic int8, whose steps run eagerly
    config = SpeculativeConfig(compile_draft=True, draft_form="as_given")
    out = target.generate(PROMPT, do_sample=False, max_new_tokens=24, pad_token_id=PAD, draft_model=draft,
                          num_lookahead=3, speculative_config=config, return_dict_in_generate=True)  # fmt: skip
    plain = target.generate(PROMPT, do_sample=False, max_new_tokens=24, pad_token_id=PAD)
    assert out.sequences.tolist() == plain.tolist()
    assert len(calls) > 5 and all(shape == (1, 1) for shape in calls)  # steps in the rounds, past the window


@torch.no_grad()
def test_rows_that_diverge_compile_nothing_in_the_rounds(built, monkeypatch):
    """Unpadded rows that commit different counts leave masked slots: the warm-up compiled the masked step too."""
    from hf_specsample.cache.cached_model import CachedModel

    target, draft = pair()
    warmed = []
    real = CachedModel.warm_step

    def recording(self):
        real(self)
        if self.step is not None:
            warmed.append((self.step, self.step.compilations))

    monkeypatch.setattr(CachedModel, "warm_step", recording)
    config = SpeculativeConfig(compile_draft=True, draft_form="int8_weights")
    target.generate(
        PROMPT.repeat(3, 1), do_sample=True, max_new_tokens=16, pad_token_id=PAD, draft_model=draft, num_lookahead=3,
        generator=torch.Generator().manual_seed(0), speculative_config=config, temperature=1.5,
    )  # fmt: skip
    ((step, compilations),) = warmed
    assert compilations > 0 and step.compilations == compilations  # nothing compiled after the warm-up


def test_a_draft_used_with_compiled_steps_is_freed_with_its_last_reference(built, monkeypatch):
    """Where AUTO keeps the draft as given (timed fastest), the implicit cache's entry does not hold it through the
    compiled step's model: the draft is freed with its last reference."""
    import gc
    import weakref

    from hf_specsample import DraftForm
    from hf_specsample.prepare import form_choice

    def none_fastest(forms, source, target, target_routing, kernel=True):
        seconds = {form: 0.001 if form is DraftForm.AS_GIVEN else 0.002 for form in forms}
        return form_choice.FormTimings(seconds, None)

    monkeypatch.setattr(form_choice, "time_forms", none_fastest)
    target, draft = pair()
    out = greedy(target, draft_model=draft, speculative_config=SpeculativeConfig(compile_draft=True),
                 return_dict_in_generate=True)  # fmt: skip
    assert out.speculative_stats.draft_form.startswith("as_given (timed per step")
    assert out.speculative_stats.draft_compile_seconds > 0.0
    alive = weakref.ref(draft)
    del draft
    gc.collect()
    assert alive() is None
