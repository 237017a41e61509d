"""generate() integration: registration, stopping, streaming, output objects and statistics."""

import pytest
import torch
from tiny import PAD, cache_of, char_tokenizer, perturbed_copy
from transformers import StoppingCriteria, StoppingCriteriaList, TextStreamer
from transformers.generation.streamers import BaseStreamer

import hf_specsample
from hf_specsample import SpeculativeConfig, SpeculativeDecoderOnlyOutput

VOCAB = 64
PROMPT = torch.tensor([[1, 17, 42, 5, 9]])


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer(VOCAB)


def greedy(model, **kwargs):
    return model.generate(PROMPT, do_sample=False, pad_token_id=PAD, **kwargs)


class RecordingStreamer(BaseStreamer):
    def __init__(self):
        self.chunks, self.shapes, self.ended = [], [], 0

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())
        self.shapes.append(tuple(value.shape))

    def end(self):
        self.ended += 1


# --- registration ------------------------------------------------------------------------------------------------


def test_generate_without_draft_is_untouched(target):
    kwargs = dict(do_sample=True, top_k=10, max_new_tokens=20, pad_token_id=PAD)
    torch.manual_seed(5)
    registered = target.generate(PROMPT, **kwargs)
    hf_specsample.unregister()
    try:
        torch.manual_seed(5)
        original = target.generate(PROMPT, **kwargs)
    finally:
        hf_specsample.register()
    assert hf_specsample.is_registered()
    assert torch.equal(registered, original)


def test_generator_makes_sampling_reproducible(target, draft):
    def sample(seed):
        generator = torch.Generator().manual_seed(seed)
        return target.generate(
            PROMPT, do_sample=True, max_new_tokens=25, draft_model=draft, generator=generator, pad_token_id=PAD
        )

    assert torch.equal(sample(3), sample(3))
    assert not torch.equal(sample(3), sample(4))


# --- stopping ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_new_tokens", [1, 2, 5, 13])
@pytest.mark.parametrize("lookahead", [1, 4, 7])
def test_max_new_tokens_is_never_exceeded(target, draft, max_new_tokens, lookahead):
    for do_sample in (False, True):
        out = target.generate(
            PROMPT, do_sample=do_sample, max_new_tokens=max_new_tokens, draft_model=draft, num_lookahead=lookahead,
            pad_token_id=PAD,
        )  # fmt: skip
        assert out.shape == (1, PROMPT.shape[1] + max_new_tokens)


def test_max_length_is_honoured(target, draft):
    assert greedy(target, max_length=12, draft_model=draft, num_lookahead=5).shape[1] == 12


def test_min_new_tokens_suppresses_early_eos(target, draft):
    eos = greedy(target, max_new_tokens=3)[0, -3].item()  # the target's very first greedy token
    assert greedy(target, max_new_tokens=20, eos_token_id=eos).shape[1] == PROMPT.shape[1] + 1
    for do_sample in (False, True):
        out = target.generate(
            PROMPT, do_sample=do_sample, max_new_tokens=20, min_new_tokens=6, eos_token_id=eos, draft_model=draft,
            num_lookahead=4, pad_token_id=PAD,
        )  # fmt: skip
        new = out[0, PROMPT.shape[1] :].tolist()
        assert len(new) >= 6 and eos not in new[:5]


def test_stop_strings_with_tokenizer(target, draft, tokenizer):
    free_run = tokenizer.decode(greedy(target, max_new_tokens=30)[0, PROMPT.shape[1] :])
    stop = free_run[9:11]  # two characters the target emits in the middle of its run
    expected = greedy(target, max_new_tokens=30, stop_strings=[stop], tokenizer=tokenizer)
    assert expected.shape[1] < PROMPT.shape[1] + 30
    for lookahead in (1, 3, 6):
        got = greedy(
            target, max_new_tokens=30, stop_strings=[stop], tokenizer=tokenizer, draft_model=draft,
            num_lookahead=lookahead,
        )  # fmt: skip
        assert torch.equal(got, expected)


def test_stop_strings_from_generation_config(target, draft, tokenizer):
    free_run = tokenizer.decode(greedy(target, max_new_tokens=30)[0, PROMPT.shape[1] :])
    config = target.generation_config.__class__(stop_strings=[free_run[7:9]], max_new_tokens=30, pad_token_id=PAD)
    expected = target.generate(PROMPT, generation_config=config, tokenizer=tokenizer)
    got = target.generate(PROMPT, generation_config=config, tokenizer=tokenizer, draft_model=draft, num_lookahead=4)
    assert torch.equal(got, expected) and expected.shape[1] < PROMPT.shape[1] + 30


class StopAfterToken(StoppingCriteria):
    """Stops a row once `token` appears among the last three tokens."""

    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids[:, -3:] == self.token).any(dim=-1)


def test_custom_stopping_criteria(target, draft):
    token = greedy(target, max_new_tokens=30)[0, PROMPT.shape[1] + 8].item()
    criteria = StoppingCriteriaList([StopAfterToken(token)])
    expected = greedy(target, max_new_tokens=30, stopping_criteria=criteria)
    got = greedy(target, max_new_tokens=30, stopping_criteria=criteria, draft_model=draft, num_lookahead=5)
    assert torch.equal(got, expected)


# --- streaming -----------------------------------------------------------------------------------------------------


def test_streamer_receives_prompt_then_committed_tokens(target, draft):
    """As plain `generate()` streams: the prompt `(1, length)`, then each new token on its own as a `(1,)` tensor."""
    streamer, plain = RecordingStreamer(), RecordingStreamer()
    out = greedy(target, max_new_tokens=25, draft_model=draft, num_lookahead=3, streamer=streamer)
    assert torch.equal(out, greedy(target, max_new_tokens=25, streamer=plain))
    assert streamer.chunks[0] == PROMPT[0].tolist()
    assert sum(streamer.chunks[1:], []) == out[0, PROMPT.shape[1] :].tolist()
    assert (streamer.chunks, streamer.shapes, streamer.ended) == (plain.chunks, plain.shapes, 1)


def test_text_streamer_prints_the_text(target, draft, tokenizer, capsys):
    out = greedy(target, max_new_tokens=20, draft_model=draft, streamer=TextStreamer(tokenizer, skip_prompt=True))
    assert capsys.readouterr().out.strip() == tokenizer.decode(out[0, PROMPT.shape[1] :]).strip()


# --- outputs and statistics ----------------------------------------------------------------------------------------


def test_output_object_matches_plain_generate(target, draft):
    kwargs = dict(max_new_tokens=20, return_dict_in_generate=True, output_scores=True, output_logits=True)
    plain = greedy(target, repetition_penalty=1.2, **kwargs)
    spec = greedy(target, repetition_penalty=1.2, draft_model=draft, num_lookahead=3, **kwargs)
    assert isinstance(spec, SpeculativeDecoderOnlyOutput)
    assert torch.equal(spec.sequences, plain.sequences)
    assert len(spec.scores) == len(spec.logits) == 20
    for mine, theirs in zip(spec.scores, plain.scores):
        assert mine.shape == (1, VOCAB)
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    for mine, theirs in zip(spec.logits, plain.logits):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    assert cache_of(spec).get_seq_length() == spec.sequences.shape[1] - 1


def test_statistics_add_up(target, draft):
    out = target.generate(
        PROMPT, do_sample=True, max_new_tokens=40, draft_model=draft, num_lookahead=4, return_dict_in_generate=True,
        pad_token_id=PAD,
    )  # fmt: skip
    stats = out.speculative_stats
    assert stats.new_tokens == 40 == out.sequences.shape[1] - PROMPT.shape[1]
    assert stats.rounds == stats.target_forward_passes == len(stats.lookahead_per_round)
    assert stats.draft_tokens == sum(stats.nodes_per_round) == stats.draft_forward_passes
    assert 0 < stats.accepted_tokens <= stats.draft_tokens
    assert stats.accepted_tokens + stats.rounds == stats.new_tokens  # every round: accepted + 1 recovered/bonus
    assert stats.tokens_per_target_pass == pytest.approx(40 / stats.target_forward_passes)
    assert stats.acceptance_rate == pytest.approx(stats.accepted_tokens / stats.draft_tokens)
    # tested draft tokens = accepted + one rejection per rejected round <= proposed
    assert stats.alpha == pytest.approx(stats.accepted_tokens / (stats.accepted_tokens + sum(stats.row_rejections)))
    assert stats.alpha >= stats.acceptance_rate
    assert sum(stats.row_rejections) <= stats.rounds
    assert stats.to_dict()["acceptance_rate"] == stats.acceptance_rate
    assert "acceptance" in str(stats)


def test_returns_plain_tensor_by_default(target, draft):
    assert isinstance(greedy(target, max_new_tokens=5, draft_model=draft), torch.Tensor)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_draft_on_another_device(target, draft):
    expected = greedy(target, max_new_tokens=20)
    gpu_draft = perturbed_copy(target, seed=1, scale=0.1).to("cuda")
    assert torch.equal(greedy(target, max_new_tokens=20, draft_model=gpu_draft), expected)


def outcome(call):
    """What a call gives: ("tokens", its sequences as lists) or ("error", its type and message)."""
    try:
        return "tokens", call().tolist()
    except Exception as error:  # noqa: BLE001  (the very error plain raises is what is compared)
        return "error", (type(error), str(error))


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("mask", [False, True])
@pytest.mark.parametrize("bos", [None, 1])
@pytest.mark.parametrize("do_sample", [False, True])
def test_an_empty_prompt_behaves_as_plain_generate(target, draft, mask, bos, do_sample, compile):
    """`input_ids` of shape (1, 0), with or without an attention mask and a BOS id: plain generate()'s tokens or its
    error (a forward over no positions fails in the model), never a message about a cache nobody passed (under
    compile=True, where generate() builds no cache for the call, neither)."""
    empty = torch.zeros((1, 0), dtype=torch.long)
    kwargs = dict(max_new_tokens=5, pad_token_id=PAD, bos_token_id=bos, do_sample=do_sample)
    if mask:
        kwargs["attention_mask"] = torch.zeros((1, 0), dtype=torch.long)
    torch.manual_seed(0)
    plain = outcome(lambda: target.generate(empty, **kwargs))
    torch.manual_seed(0)
    config = SpeculativeConfig(compile=compile)
    speculative = outcome(lambda: target.generate(empty, draft_model=draft, speculative_config=config, **kwargs))
    assert speculative == plain


def test_no_prompt_starts_from_bos_as_plain_generate(target, draft):
    """No input at all: generate() makes the prompt from the BOS id; the speculative call's tokens are plain's."""
    kwargs = dict(max_new_tokens=6, pad_token_id=PAD, bos_token_id=1, do_sample=False)
    assert torch.equal(target.generate(draft_model=draft, num_lookahead=2, **kwargs), target.generate(**kwargs))
