"""Inputs plain `generate()` takes: each gives plain's result, or a refusal before any forward that says what to do.

Found by trying the library as a new user would (issue 52): EOS ids as tensors, a base model without an LM head as the
draft, a draft whose learned position table (GPT-2's `n_positions`) the text outgrows, the documented way to call it
with transformers' own `generate()` put back (streamer and stop strings kept), a draft narrower than the target's
tokenizer.
"""

import pytest
import torch
from exact import chisquare_pvalue, continuations, exact_distribution
from tiny import PAD, ForwardCounter, char_tokenizer, prepared_processors, tiny_lm
from transformers import (
    CodeGenConfig,
    CodeGenForCausalLM,
    CTRLConfig,
    CTRLLMHeadModel,
    GPT2Config,
    GPT2LMHeadModel,
    GPTJConfig,
    GPTJForCausalLM,
)
from transformers.generation.streamers import BaseStreamer

import hf_specsample
from hf_specsample import speculative_generate

VOCAB = 64
PROMPT = torch.tensor([[1, 17, 42, 5, 9]])


class RecordingStreamer(BaseStreamer):
    def __init__(self):
        self.tokens, self.ended = [], 0

    def put(self, value):
        self.tokens.extend(value.reshape(-1).tolist())

    def end(self):
        self.ended += 1


def greedy(model, prompt=PROMPT, **kwargs):
    return model.generate(prompt, do_sample=False, pad_token_id=PAD, **kwargs)


# --- EOS ids as tensors ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", ["0-d", "1-d"])
def test_eos_as_a_tensor_stops_as_plain_generate(target, draft, shape):
    free_run = greedy(target, max_new_tokens=12)[0, PROMPT.shape[1] :].tolist()
    ids = [free_run[4], VOCAB - 1] if shape == "1-d" else free_run[4]  # a token the run reaches: it stops there
    eos = torch.tensor(ids)
    expected = greedy(target, max_new_tokens=12, eos_token_id=eos)
    assert expected.shape[1] < PROMPT.shape[1] + 12  # the EOS was met
    for lookahead in (1, 4):
        got = greedy(target, max_new_tokens=12, eos_token_id=eos, draft_model=draft, num_lookahead=lookahead)
        assert torch.equal(got, expected)


def test_eos_as_a_tensor_in_a_batch_that_ends_apart(target, draft):
    prompts = torch.tensor([[1, 17, 42, 5, 9], [1, 3, 8, 21, 30]])
    first = greedy(target, prompts, max_new_tokens=10)[:, PROMPT.shape[1] :]
    eos = torch.tensor([first[0, 2].item(), first[1, 6].item()])
    expected = greedy(target, prompts, max_new_tokens=10, eos_token_id=eos)
    got = greedy(target, prompts, max_new_tokens=10, eos_token_id=eos, draft_model=draft, num_lookahead=3)
    assert torch.equal(got, expected)
    sampled = target.generate(
        prompts, do_sample=True, max_new_tokens=10, eos_token_id=eos, pad_token_id=PAD, draft_model=draft,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    for row in sampled[:, PROMPT.shape[1] :].tolist():  # each row ends at its first EOS, padding after
        ends = [i for i, token in enumerate(row) if token in eos.tolist()]
        assert not ends or all(token == PAD for token in row[ends[0] + 1 :])


# --- a model without an LM head ------------------------------------------------------------------------------------


def test_a_base_model_as_the_draft_is_refused_before_work(target, draft):
    with ForwardCounter(target, draft) as counter, pytest.raises(ValueError, match="no language-modelling head"):
        greedy(target, max_new_tokens=5, draft_model=draft.model)
    assert counter.calls == 0


# --- a draft whose position table the text outgrows --------------------------------------------------------------


def _gpt2(seed: int, positions: int, vocab: int = 32) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=vocab, n_positions=positions, n_embd=16, n_layer=1, n_head=2, bos_token_id=1, eos_token_id=None,
        pad_token_id=PAD, initializer_range=0.3,
    )  # fmt: skip
    return GPT2LMHeadModel(config).eval()


@pytest.fixture(scope="module")
def gpt2_target():
    return _gpt2(0, positions=256)


@pytest.mark.parametrize(
    "positions, prompt_length, new_tokens",
    [(64, 58, 12), (32, 10, 8), (20, 30, 6)],
    ids=["table-ends-mid-call", "form-timing-beyond-the-table", "prompt-beyond-the-table"],
)
@pytest.mark.parametrize("form", ["auto", "as_given"])
def test_a_draft_drafts_while_its_positions_fit_then_the_target_finishes_alone(
    gpt2_target, positions, prompt_length, new_tokens, form
):
    draft = _gpt2(0, positions)  # the target's own weights up to its table: it drafts well while it can
    with torch.no_grad():
        draft.transformer.wpe.weight.copy_(gpt2_target.transformer.wpe.weight[:positions])
    prompt = torch.randint(2, 32, (1, prompt_length), generator=torch.Generator().manual_seed(positions))
    expected = greedy(gpt2_target, prompt, max_new_tokens=new_tokens)
    out = greedy(
        gpt2_target, prompt, max_new_tokens=new_tokens, draft_model=draft, num_lookahead=4,
        speculative_config=hf_specsample.SpeculativeConfig(draft_form=form), return_dict_in_generate=True,
    )  # fmt: skip
    assert torch.equal(out.sequences, expected)
    stats = out.speculative_stats
    if prompt_length + new_tokens > positions:  # the text outgrows the table: said where it stopped the draft
        # a round drafts at most the room left and commits one token more: the text ends it at the table's end + 1
        ended = [prompt_length] if prompt_length > positions else [positions, positions + 1]
        assert stats.draft_positions_ended in ended
        assert "position table" in str(stats)
    else:
        assert stats.draft_positions_ended is None
    if prompt_length > positions:
        assert stats.draft_tokens == 0
    else:
        assert stats.draft_tokens > 0


def _fixed_position_buffer_draft(kind: str, positions: int):
    """Drafts whose positions come from a fixed buffer, not an embedding: GPT-J's and CodeGen's sines and cosines,
    CTRL's encoding."""
    torch.manual_seed(1)
    common = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=positions, pad_token_id=PAD)
    if kind == "gptj":
        return GPTJForCausalLM(GPTJConfig(rotary_dim=4, **common)).eval()
    if kind == "codegen":
        return CodeGenForCausalLM(CodeGenConfig(rotary_dim=4, n_ctx=positions, **common)).eval()
    return CTRLLMHeadModel(CTRLConfig(dff=64, **common)).eval()


@pytest.mark.parametrize("kind", ["gptj", "codegen", "ctrl"])
def test_drafts_with_a_fixed_buffer_of_positions_stop_drafting_at_its_end(target, kind):
    draft = _fixed_position_buffer_draft(kind, positions=16)
    prompt = torch.randint(2, VOCAB, (1, 10), generator=torch.Generator().manual_seed(0))
    expected = greedy(target, prompt, max_new_tokens=20)
    out = greedy(target, prompt, max_new_tokens=20, draft_model=draft, num_lookahead=3, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected) and out.speculative_stats.draft_positions_ended in (16, 17)


@pytest.mark.parametrize("positions", [2, 3, 4])
def test_a_draft_with_a_tiny_position_table_is_timed_without_overrunning_it(gpt2_target, positions):
    """AUTO's timing of the draft's forms fits its forwards into the table (or times nothing)."""
    prompt = torch.tensor([[3, 4, 5]])
    expected = greedy(gpt2_target, prompt, max_new_tokens=6)
    assert torch.equal(greedy(gpt2_target, prompt, max_new_tokens=6, draft_model=_gpt2(1, positions)), expected)


def test_a_draft_whose_table_ends_mid_call_samples_exactly():
    """Rounds drafted by the draft and rounds of the target alone, in one call: chi-square against the target's
    exact distribution, with power (the same samples against the target's distribution at another temperature fail).
    """
    target = _gpt2(0, positions=256, vocab=8)
    draft = _gpt2(1, positions=7, vocab=8)  # 4 prompt tokens: the draft runs out of positions within the call
    prompt = torch.tensor([[1, 5, 3, 6]])
    num_tokens, rows = 5, 8_000
    out = target.generate(
        prompt, do_sample=True, temperature=1.3, max_new_tokens=num_tokens, num_return_sequences=rows,
        pad_token_id=PAD, draft_model=draft, num_lookahead=2, generator=torch.Generator().manual_seed(11),
        return_dict_in_generate=True,
    )  # fmt: skip
    assert out.speculative_stats.draft_positions_ended is not None and out.speculative_stats.draft_tokens > 0
    samples = continuations(out.sequences, prompt.shape[1])
    processors, _ = prepared_processors(target, prompt, do_sample=True, temperature=1.3, max_new_tokens=num_tokens)
    assert chisquare_pvalue(exact_distribution(target, prompt, processors, num_tokens), samples) > 1e-3
    other, _ = prepared_processors(target, prompt, do_sample=True, temperature=1.0, max_new_tokens=num_tokens)
    assert chisquare_pvalue(exact_distribution(target, prompt, other, num_tokens), samples) < 1e-6


# --- the documented ways to call it ----------------------------------------------------------------------------


def test_every_documented_path_keeps_the_streamer_and_stop_strings(target, draft):
    tokenizer = char_tokenizer(VOCAB)
    free_run = tokenizer.decode(greedy(target, max_new_tokens=30)[0, PROMPT.shape[1] :])
    stop = free_run[9:11]
    expected = greedy(target, max_new_tokens=30, stop_strings=[stop], tokenizer=tokenizer)
    assert expected.shape[1] < PROMPT.shape[1] + 30

    def registered(**kwargs):
        return target.generate(PROMPT, **kwargs)

    def as_a_function(**kwargs):
        hf_specsample.unregister()
        try:
            return hf_specsample.generate(target, PROMPT, **kwargs)
        finally:
            hf_specsample.register()

    def explicit_callable(**kwargs):  # registered: the wrapper routes it
        return target.generate(PROMPT, custom_generate=speculative_generate, **kwargs)

    for path in (registered, as_a_function, explicit_callable):
        streamer = RecordingStreamer()
        got = path(
            do_sample=False, pad_token_id=PAD, max_new_tokens=30, stop_strings=[stop], tokenizer=tokenizer,
            draft_model=draft, num_lookahead=3, streamer=streamer,
        )  # fmt: skip
        assert torch.equal(got, expected), path.__name__
        assert streamer.tokens == expected[0].tolist() and streamer.ended == 1, path.__name__


def test_the_callable_on_transformers_own_generate_is_refused_before_work(target, draft):
    hf_specsample.unregister()
    try:
        with ForwardCounter(target, draft) as counter, pytest.raises(ValueError, match="hf_specsample.generate"):
            greedy(target, max_new_tokens=5, custom_generate=speculative_generate, draft_model=draft)
    finally:
        hf_specsample.register()
    assert counter.calls == 0


# --- a draft of another vocabulary ---------------------------------------------------------------------------------


@pytest.mark.parametrize("width", [16, 48, 60])
def test_a_draft_narrower_than_the_targets_tokenizer_is_refused_with_the_tokenizer(target, width):
    draft = tiny_lm(seed=3, vocab_size=width)
    with ForwardCounter(target, draft) as counter, pytest.raises(ValueError, match="draft_tokenizer="):
        greedy(target, max_new_tokens=5, draft_model=draft, tokenizer=char_tokenizer(VOCAB))
    assert counter.calls == 0


def test_a_draft_of_the_base_vocabulary_runs_beside_a_target_with_an_added_token():
    """A fine-tune that added a special token (its embeddings resized by one) with a draft of the base vocabulary:
    the same tokenizer, whose added token the draft never proposes. `tokenizer=` (for stop strings) must not refuse it.
    """
    tokenizer = char_tokenizer(VOCAB)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    target, draft = tiny_lm(seed=0, vocab_size=VOCAB + 1), tiny_lm(seed=3, vocab_size=VOCAB)
    expected = greedy(target, max_new_tokens=8)
    assert torch.equal(greedy(target, max_new_tokens=8, draft_model=draft, tokenizer=tokenizer), expected)


@pytest.mark.parametrize("width", [64, 72])
def test_a_draft_as_wide_as_the_targets_tokenizer_runs_with_it(target, width):
    draft = tiny_lm(seed=3, vocab_size=width)
    tokenizer = char_tokenizer(VOCAB)
    expected = greedy(target, max_new_tokens=8)
    assert torch.equal(greedy(target, max_new_tokens=8, draft_model=draft, tokenizer=tokenizer), expected)


@pytest.mark.parametrize("width", [256, 768])
def test_widths_a_padding_cannot_explain_are_refused_without_tokenizers(width):
    target, draft = tiny_lm(seed=0, vocab_size=512), tiny_lm(seed=3, vocab_size=width)
    with ForwardCounter(target, draft) as counter, pytest.raises(ValueError, match="different tokenizers"):
        greedy(target, max_new_tokens=5, draft_model=draft)
    assert counter.calls == 0


# --- max_time ----------------------------------------------------------------------------------------------------


def test_a_call_with_max_time_times_nothing_before_its_first_round(monkeypatch):
    """`max_time=` counts from the call's start, setup included, as plain's clock does: the call's setup must not
    spend it timing the draft's forms or the kernel's routing (they are chosen as a clock-free call chooses them)."""
    timed = []
    monkeypatch.setattr("hf_specsample.prepare.form_choice.time_forms", lambda *args: timed.append("forms"))
    monkeypatch.setattr("hf_specsample.kernels.routing._timed_routing", lambda *args: timed.append("routing"))
    target = tiny_lm(seed=0, vocab_size=VOCAB, layers=2, hidden=32, dtype=torch.bfloat16)
    draft = tiny_lm(seed=1, vocab_size=VOCAB, dtype=torch.bfloat16)  # fresh models: nothing prepared or timed yet
    out = greedy(target, max_new_tokens=6, max_time=60.0, draft_model=draft, return_dict_in_generate=True)
    assert timed == [] and out.sequences.shape[1] == PROMPT.shape[1] + 6
    assert "without the clock" in out.speculative_stats.draft_form
    out = greedy(target, max_time=0.0, max_new_tokens=6, draft_model=draft)  # the time is up: one round
    assert PROMPT.shape[1] < out.shape[1] < PROMPT.shape[1] + 6


def test_a_call_with_max_time_builds_no_kernel(monkeypatch):
    """Where no build of the small-rows kernel is ready, a bf16 call with `max_time=` (linear_kernel="auto") runs
    without the kernel rather than spend 15-20 s building it; its statistics say so."""
    loads = []
    monkeypatch.setattr("hf_specsample.plan.call_plan.ready", lambda: False)
    monkeypatch.setattr("hf_specsample.kernels.small_rows.load", lambda: loads.append(1))
    target = tiny_lm(seed=0, vocab_size=VOCAB, layers=2, hidden=32, dtype=torch.bfloat16)
    draft = tiny_lm(seed=1, vocab_size=VOCAB, dtype=torch.bfloat16)
    out = greedy(target, max_new_tokens=6, max_time=60.0, draft_model=draft, return_dict_in_generate=True)
    assert loads == [] and "builds no kernel" in out.speculative_stats.linear_kernel
    assert out.speculative_stats.kernel_build_seconds == 0.0
