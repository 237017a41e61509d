"""Drafts with another tokenizer (`tokenizer=` + `draft_tokenizer=`): exact, greedy-identical, batched.

Two real (fast) BPE tokenizers built offline, sharing 6 of the target's 8 tokens in another id order:

    target (8 ids):  <pad> <s> </s> a b c ab ca        merges: a+b, c+a
    draft (10 ids):  b </s> x a <pad> <s> c bc xa y    merges: b+c, x+a

The draft can only propose the shared tokens; "ab" and "ca" come from the target alone, and reach the draft as two
draft tokens each ("a", "b"), so rows gain different numbers of draft ids per round. The target's distribution over
every continuation of NUM_TOKENS tokens is enumerated exactly (`exact.py`) and speculative samples are
chi-square-tested against it, under several processors and both verification rules; two deliberately wrong drafts
(the map forgotten, the draft's distribution not renormalised) must fail the same test.
"""

import pytest
import torch
from exact import chisquare_pvalue, continuations, exact_distribution
from test_architectures import assert_same_cache, batch
from tiny import PAD, cache_of, char_tokenizer, perturbed_copy, prepared_processors, tiny_arch, tiny_lm, with_cache
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LogitsProcessor, LogitsProcessorList, PreTrainedTokenizerFast
from transformers.generation.streamers import BaseStreamer

import hf_specsample.proposers.draft_model as draft_model_module
from hf_specsample import SpeculativeConfig, prepare_draft
from hf_specsample.proposers.cross_tokenizer import ABSENT, TokenForm, shared_vocabulary, token_contents, token_form
from hf_specsample.sampling.processing import probabilities

TARGET_TOKENS = ["<pad>", "<s>", "</s>", "a", "b", "c", "ab", "ca"]
DRAFT_TOKENS = ["b", "</s>", "x", "a", "<pad>", "<s>", "c", "bc", "xa", "y"]
SHARED = {"<pad>": (4, 0), "<s>": (5, 1), "</s>": (1, 2), "a": (3, 3), "b": (0, 4), "c": (6, 5)}  # (draft, target)
EOS = 2  # "</s>" in the target's ids
PROMPT = torch.tensor([[1, 5, 3, 6]])  # <s> c a ab: the draft reads <s> c a a b
NUM_TOKENS = 3
SAMPLES = 8_000
ALPHA = 1e-3  # seeded: each verdict is deterministic; a correct sampler fails with probability ALPHA


def bpe_tokenizer(tokens: list[str], merges: list[tuple[str, str]]) -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.BPE({token: i for i, token in enumerate(tokens)}, merges))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def tokenizers():
    return bpe_tokenizer(TARGET_TOKENS, [("a", "b"), ("c", "a")]), bpe_tokenizer(DRAFT_TOKENS, [("b", "c"), ("x", "a")])


@pytest.fixture(scope="module")
def target():
    return tiny_lm(seed=0, vocab_size=len(TARGET_TOKENS), layers=2, hidden=32, init_range=0.5)


def mapped_copy(target, vocabulary, width: int, seed: int, scale: float):
    """A draft close to `target` in the draft's ids: its weights with noise, each shared token's embedding and head
    rows moved to that token's draft id, random rows for the draft's own tokens."""
    draft = perturbed_copy(target, seed=seed, scale=scale)
    draft.resize_token_embeddings(width, mean_resizing=False)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for matrix, source in ((draft.model.embed_tokens.weight, target.model.embed_tokens.weight),
                               (draft.lm_head.weight, target.lm_head.weight)):  # fmt: skip
            matrix.copy_(torch.randn(matrix.shape, generator=generator) * source.std())
            matrix[vocabulary.draft_columns] = source[vocabulary.target_ids]
    return draft


@pytest.fixture(scope="module")
def drafts(target, tokenizers):
    vocabulary = shared_vocabulary(*tokenizers, len(TARGET_TOKENS), len(DRAFT_TOKENS))
    return {
        "close": mapped_copy(target, vocabulary, len(DRAFT_TOKENS), seed=1, scale=0.2),
        "far": tiny_lm(seed=2, vocab_size=len(DRAFT_TOKENS), layers=1, hidden=16, init_range=0.5),
    }


def cross(tokenizers, draft, **kwargs):
    """The arguments that make `draft` a draft with another tokenizer."""
    return dict(draft_model=draft, tokenizer=tokenizers[0], draft_tokenizer=tokenizers[1], **kwargs)


def greedy(model, inputs, **kwargs):
    inputs = inputs if isinstance(inputs, dict) else {"input_ids": inputs}
    return model.generate(**inputs, do_sample=False, pad_token_id=PAD, **kwargs)


# ----------------------------------------------------------------------------------------------------------------
# The shared vocabulary.
# ----------------------------------------------------------------------------------------------------------------
def test_shared_vocabulary_pairs_tokens_of_equal_content(tokenizers):
    vocabulary = shared_vocabulary(*tokenizers, len(TARGET_TOKENS), len(DRAFT_TOKENS))
    pairs = set(zip(vocabulary.draft_columns.tolist(), vocabulary.target_ids.tolist()))
    assert pairs == set(SHARED.values())
    assert vocabulary.target_ids.tolist() == sorted(vocabulary.target_ids.tolist())
    assert vocabulary.size == 6
    for token, (draft_id, target_id) in SHARED.items():
        assert TARGET_TOKENS[target_id] == DRAFT_TOKENS[draft_id] == token
        assert vocabulary.target_to_draft[target_id] == draft_id and vocabulary.draft_to_target[draft_id] == target_id
    assert vocabulary.target_to_draft[[6, 7]].tolist() == [ABSENT, ABSENT]  # ab, ca: the target's own
    assert vocabulary.draft_to_target[[2, 7, 8, 9]].tolist() == [ABSENT] * 4  # x, bc, xa, y: the draft's own


def test_shared_vocabulary_respects_the_model_widths(tokenizers):
    """Ids at or beyond a model's logit width are left out (a tokenizer may hold more ids than the model scores)."""
    vocabulary = shared_vocabulary(*tokenizers, target_width=4, draft_width=5)
    assert set(zip(vocabulary.draft_columns.tolist(), vocabulary.target_ids.tolist())) == {(4, 0), (1, 2), (3, 3)}
    assert vocabulary.target_to_draft.shape == (4,) and vocabulary.draft_to_target.shape == (5,)


def test_shared_vocabulary_is_kept_per_tokenizer_pair_and_renewed_when_one_changes():
    """A chat calls generate() once per turn: the pairs are built once per tokenizer pair. A tokenizer changed in
    place (`add_tokens`) gets a new map that pairs the new token, never the stale one (which would not)."""
    target_tokenizer = bpe_tokenizer(TARGET_TOKENS, [("a", "b"), ("c", "a")])
    draft_tokenizer = bpe_tokenizer(DRAFT_TOKENS, [("b", "c"), ("x", "a")])
    first = shared_vocabulary(target_tokenizer, draft_tokenizer, 16, 16)
    assert shared_vocabulary(target_tokenizer, draft_tokenizer, 16, 16) is first
    assert shared_vocabulary(target_tokenizer, draft_tokenizer, 5, 16) is not first  # another width, another map
    target_tokenizer.add_tokens(["<new>"])
    draft_tokenizer.add_tokens(["<new>"])
    renewed = shared_vocabulary(target_tokenizer, draft_tokenizer, 16, 16)
    assert renewed.size == first.size + 1
    pair = (draft_tokenizer.convert_tokens_to_ids("<new>"), target_tokenizer.convert_tokens_to_ids("<new>"))
    assert pair in set(zip(renewed.draft_columns.tolist(), renewed.target_ids.tolist()))


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """GPT-2 style: "Ġ" is a space, "Ċ" a newline, "Ã©" the two bytes of "é"; "<|im_end|>" an added special token."""
    tokens = ["<|endoftext|>", "h", "i", "Ġ", "Ċ", "Ã", "©", "hi", "Ġhi", "Ã©", "Ġhi!"]
    backend = Tokenizer(models.BPE({token: i for i, token in enumerate(tokens)}, [("h", "i"), ("Ġ", "hi"), ("Ã", "©")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    return tokenizer


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """Sentencepiece style: "▁" is a space, "<0x0A>" the newline byte; "<0x20>" and "▁" are both a space."""
    tokens = ["<unk>", "<|im_end|>", "▁", "<0x20>", "h", "i", "hi", "▁hi", "<0x0A>", "é", "▁ho"]
    backend = Tokenizer(models.BPE({token: i for i, token in enumerate(tokens)}, [("h", "i"), ("▁", "hi")]))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    return tokenizer


def test_byte_level_and_sentencepiece_tokens_meet_by_content():
    byte_level, metaspace = byte_level_tokenizer(), metaspace_tokenizer()
    assert token_form(byte_level) is TokenForm.BYTE_LEVEL and token_form(metaspace) is TokenForm.METASPACE
    assert token_contents(byte_level)[" hi".encode()] == 8
    assert token_contents(metaspace)[b" "] == 2, "two tokens of one content: the lowest id stands for it"
    vocabulary = shared_vocabulary(byte_level, metaspace, len(byte_level), len(metaspace))
    pairs = {(byte_level.convert_ids_to_tokens(t), metaspace.convert_ids_to_tokens(d))
             for d, t in zip(vocabulary.draft_columns.tolist(), vocabulary.target_ids.tolist())}  # fmt: skip
    expected = {("h", "h"), ("i", "i"), ("Ġ", "▁"), ("Ċ", "<0x0A>"), ("hi", "hi"), ("Ġhi", "▁hi"), ("Ã©", "é"),
                ("<|im_end|>", "<|im_end|>")}  # fmt: skip
    assert pairs == expected
    # one-to-one both ways
    assert len(set(vocabulary.draft_columns.tolist())) == len(set(vocabulary.target_ids.tolist())) == len(expected)
    assert int((vocabulary.target_to_draft != ABSENT).sum()) == int((vocabulary.draft_to_target != ABSENT).sum())


@pytest.mark.slow
def test_real_pair_qwen_and_smollm2():
    from transformers import AutoTokenizer

    from hf_specsample_bench.models import KnownModel, safetensors_dir

    folders = [
        safetensors_dir(model, torch.bfloat16) for model in (KnownModel.QWEN_CODER_1_5B, KnownModel.SMOLLM2_135M)
    ]
    if not all(folder.exists() for folder in folders):
        pytest.skip("the Qwen2.5-Coder / SmolLM2 checkpoints are not cached (python -m hf_specsample_bench.models)")
    qwen, smollm = (AutoTokenizer.from_pretrained(folder) for folder in folders)
    vocabulary = shared_vocabulary(qwen, smollm, 151936, 49152)
    assert 35_000 < vocabulary.size < 45_000
    for token in ("Ġhello", "Ċ", "<|im_start|>", "<|im_end|>", "def"):
        target_id, draft_id = qwen.convert_tokens_to_ids(token), smollm.convert_tokens_to_ids(token)
        assert vocabulary.target_to_draft[target_id] == draft_id


# ----------------------------------------------------------------------------------------------------------------
# Greedy: token for token the target's own.
# ----------------------------------------------------------------------------------------------------------------
PROMPTS = [[1, 7, 6], [1, 4], [1, 7, 7, 3, 5, 4, 6]]  # <s>caab, <s>b, <s>cacaacbab as the target's tokenizer has them
TWIN_TOKENS = ["ca", "</s>", "b", "<s>", "ab", "a", "<pad>", "c"]  # the target's tokens in another order


@pytest.fixture(scope="module")
def twin(target, tokenizers):
    """(draft, its tokenizer): the target itself, reading the same tokens under other ids."""
    tokenizer = bpe_tokenizer(TWIN_TOKENS, [("a", "b"), ("c", "a")])
    vocabulary = shared_vocabulary(tokenizers[0], tokenizer, len(TARGET_TOKENS), len(TWIN_TOKENS))
    assert vocabulary.size == len(TARGET_TOKENS)
    return mapped_copy(target, vocabulary, len(TWIN_TOKENS), seed=1, scale=0.0), tokenizer


def test_a_twin_under_other_ids_accepts_every_token(target, tokenizers, twin):
    """The draft is the target with its ids permuted: if prompts, padding, positions and the map are all right, it
    computes exactly the target's distributions, and every draft token is accepted (greedy and sampling)."""
    draft, draft_tokenizer = twin
    as_given = SpeculativeConfig(draft_form="as_given")
    assert [draft_tokenizer.decode(draft_tokenizer(text)["input_ids"]) for text in ("<s>caab", "<s>cacaacbab")] == [
        "<s>caab", "<s>cacaacbab"]  # fmt: skip
    for do_sample in (False, True):
        out = target.generate(
            **padded("left"), max_new_tokens=20, do_sample=do_sample, pad_token_id=PAD, num_lookahead=3,
            draft_model=draft, tokenizer=tokenizers[0], draft_tokenizer=draft_tokenizer, return_dict_in_generate=True,
            speculative_config=as_given, num_return_sequences=8 if do_sample else 1,
            generator=torch.Generator().manual_seed(0),
        )  # fmt: skip
        assert out.speculative_stats.acceptance_rate == 1.0


def padded(side: str) -> dict:
    """PROMPTS as one batch, padded on `side`."""
    ids, mask = batch(PROMPTS, side)
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("lookahead", [1, 2, 4])
@pytest.mark.parametrize("draft_kind", ["close", "far"])
def test_greedy_identical_single_and_batched(target, drafts, tokenizers, draft_kind, lookahead):
    draft = drafts[draft_kind]
    cases = [torch.tensor([prompt]) for prompt in PROMPTS] + [padded("left"), padded("right")]
    for inputs in cases:
        expected = greedy(target, inputs, max_new_tokens=24)
        got = greedy(target, inputs, max_new_tokens=24, **cross(tokenizers, draft, num_lookahead=lookahead))
        assert torch.equal(got, expected)


@pytest.mark.parametrize("lookahead", [2, 4])
def test_greedy_identical_with_eos_inside_blocks(target, drafts, tokenizers, twin, lookahead):
    """EOS ends rows inside accepted blocks at different rounds (the twin accepts every block), with the returned
    scores and cache equal to plain's."""
    inputs = {name: tensor.repeat_interleave(2, dim=0) for name, tensor in padded("left").items()}  # rows in pairs
    kwargs = dict(max_new_tokens=24, eos_token_id=EOS, return_dict_in_generate=True, output_scores=True)
    plain = greedy(target, inputs, **kwargs)
    width = inputs["input_ids"].shape[1]
    ends = [row.tolist()[width:].index(EOS) for row in plain.sequences if EOS in row.tolist()]
    assert len(set(ends)) > 1, "EOS must end rows at different lengths for this test to mean anything"
    seen = torch.cat([inputs["attention_mask"], torch.ones_like(plain.sequences[:, width:])], dim=1)[:, :-1]
    for draft, draft_tokenizer in (twin, (drafts["close"], tokenizers[1])):
        mine = greedy(target, inputs, draft_model=draft, tokenizer=tokenizers[0], draft_tokenizer=draft_tokenizer,
                      num_lookahead=lookahead, **kwargs)  # fmt: skip
        assert torch.equal(mine.sequences, plain.sequences)
        assert len(mine.scores) == len(plain.scores)
        for step, (ours, theirs) in enumerate(zip(mine.scores, plain.scores)):
            unfinished = ~(plain.sequences[:, width : width + step] == EOS).any(dim=1)
            torch.testing.assert_close(ours[unfinished], theirs[unfinished], rtol=1e-4, atol=1e-4)
        assert_same_cache(cache_of(plain), cache_of(mine), seen)
    assert mine.speculative_stats.shared_vocabulary == len(SHARED)


def test_greedy_with_prefix_dependent_processors_and_lookup(target, drafts, tokenizers):
    settings = dict(repetition_penalty=1.3, no_repeat_ngram_size=3, bad_words_ids=[[3, 4]], min_new_tokens=4)
    inputs = padded("left")
    expected = greedy(target, inputs, max_new_tokens=20, **settings)
    for extra in ({}, {"prompt_lookup_num_tokens": 3}):
        got = greedy(target, inputs, max_new_tokens=20, **cross(tokenizers, drafts["close"], num_lookahead=3), **extra,
                     **settings)  # fmt: skip
        assert torch.equal(got, expected)
    single = torch.tensor([PROMPTS[2]])  # one row: lookup-only rounds, the draft catching up later
    got = greedy(target, single, max_new_tokens=20, prompt_lookup_num_tokens=4, **cross(tokenizers, drafts["far"]))
    assert torch.equal(got, greedy(target, single, max_new_tokens=20))


def test_assistant_tokenizer_alias_stop_strings_and_streamer():
    """Stop strings need a target tokenizer that spells "abcdef" (transformers' StopStringCriteria does): a character
    tokenizer of 24 ids, and a draft tokenizer holding some of its characters in another order, and merges."""
    target_tokenizer = char_tokenizer(24)  # <pad> <s> </s> a b c ... u
    characters = list("uqkmaeiotsbcdfgh")
    draft_tokenizer = bpe_tokenizer(["<s>", "</s>", "<pad>", *characters, "ou", "ab", "ch"],
                                    [("o", "u"), ("a", "b"), ("c", "h")])  # fmt: skip
    target = tiny_lm(seed=0, vocab_size=24, layers=2, hidden=32, init_range=0.5)
    draft = tiny_lm(seed=2, vocab_size=len(draft_tokenizer), layers=1, hidden=16, init_range=0.5)
    prompt = target_tokenizer("<s>abcab", add_special_tokens=False, return_tensors="pt")["input_ids"]
    free_run = target_tokenizer.decode(greedy(target, prompt, max_new_tokens=20)[0, prompt.shape[1] :])
    stop = free_run[7:9]
    expected = greedy(target, prompt, max_new_tokens=20, stop_strings=[stop], tokenizer=target_tokenizer)
    assert expected.shape[1] < prompt.shape[1] + 20, "the stop string must end generation early"

    class Collect(BaseStreamer):
        def __init__(self):
            self.chunks = []

        def put(self, value):
            self.chunks.append(value.reshape(-1))

        def end(self):
            pass

    streamer = Collect()
    got = greedy(
        target, prompt, max_new_tokens=20, stop_strings=[stop], tokenizer=target_tokenizer, draft_model=draft,
        assistant_tokenizer=draft_tokenizer, num_lookahead=3, streamer=streamer,
    )  # fmt: skip
    assert torch.equal(got, expected)
    assert torch.cat(streamer.chunks).tolist() == expected[0].tolist()


def test_sliding_window_draft_in_a_ragged_batch(target, tokenizers):
    """Rows gain different numbers of draft ids, so the draft's rows drop positions committed in earlier rounds to
    even up: its cache keeps every slot (a window's layer would no longer hold them)."""
    draft = tiny_arch("mistral_sliding", seed=3, vocab_size=len(DRAFT_TOKENS))
    inputs = padded("left")
    expected = greedy(target, inputs, max_new_tokens=30)
    got = greedy(target, inputs, max_new_tokens=30, **cross(tokenizers, draft, num_lookahead=3))
    assert torch.equal(got, expected)


@torch.no_grad()
def test_chat_second_turn_on_the_returned_cache(target, drafts, tokenizers):
    kwargs = dict(max_new_tokens=8, return_dict_in_generate=True)
    prompt = torch.tensor([PROMPTS[0]])
    plain = greedy(target, prompt, **kwargs)
    mine = greedy(target, prompt, **cross(tokenizers, drafts["close"], num_lookahead=3), **kwargs)
    assert torch.equal(mine.sequences, plain.sequences)
    conversation = torch.cat([plain.sequences, torch.tensor([[4, 5, 3]])], dim=1)
    plain_2 = greedy(target, conversation, **with_cache(cache_of(plain)), **kwargs)
    mine_2 = greedy(target, conversation, **with_cache(cache_of(mine)),
                    **cross(tokenizers, drafts["close"], num_lookahead=3), **kwargs)  # fmt: skip
    assert torch.equal(mine_2.sequences, plain_2.sequences)
    for theirs, ours in zip(cache_of(plain_2).layers, cache_of(mine_2).layers):
        torch.testing.assert_close(ours.keys, theirs.keys, rtol=1e-4, atol=1e-4)


def test_prepared_draft_keeps_its_tokenizers_and_int8_copy(target, drafts, tokenizers, int8_steps_faster):
    """`prepare_draft(..., tokenizer=, draft_tokenizer=)`: the int8 copy still applies, and the prepared draft holds
    the tokenizers and their shared vocabulary, so a call needs neither again."""
    prepared = prepare_draft(drafts["far"], target, tokenizer=tokenizers[0], draft_tokenizer=tokenizers[1])
    assert str(prepared.form) == "dynamic_int8" and prepared.model is not drafts["far"]
    assert prepared.shared_vocabulary.size == len(SHARED)
    prompt = torch.tensor([PROMPTS[2]])
    expected = greedy(target, prompt, max_new_tokens=12)
    for extra in (cross(tokenizers, prepared), {"draft_model": prepared}):
        out = greedy(target, prompt, max_new_tokens=12, num_lookahead=2, return_dict_in_generate=True, **extra)
        assert torch.equal(out.sequences, expected)
        assert out.speculative_stats.shared_vocabulary == len(SHARED)


# ----------------------------------------------------------------------------------------------------------------
# Sampling: exactly the target's distribution (chi-square), and the test has power.
# ----------------------------------------------------------------------------------------------------------------
class NextTokenBias(LogitsProcessor):
    """A user's processor reading token ids: favours the token after the last one (mod vocabulary)."""

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        rows = torch.arange(scores.shape[0])
        scores[rows, (input_ids[:, -1] + 1) % scores.shape[-1]] += 1.5
        return scores


SETTINGS = {
    "temperature_top_p": dict(temperature=0.8, top_p=0.9),
    "top_k": dict(top_k=3),
    "repetition_penalty": dict(repetition_penalty=1.8),
    "bad_words": dict(bad_words_ids=[[3, 4], [5]], temperature=1.2),
    "no_repeat_ngram": dict(no_repeat_ngram_size=2, temperature=1.3),
    "user_processor": dict(logits_processor=LogitsProcessorList([NextTokenBias()])),
}


def exact_for(target, prompt=PROMPT, attention_mask=None, eos_token_ids=(), **settings):
    processors, _ = prepared_processors(target, prompt, do_sample=True, max_new_tokens=NUM_TOKENS, **settings)
    return exact_distribution(target, prompt, processors, NUM_TOKENS, eos_token_ids, attention_mask)


def sample(target, tokenizers, draft, seed: int, inputs=PROMPT, rows: int = SAMPLES, **kwargs):
    inputs = inputs if isinstance(inputs, dict) else {"input_ids": inputs}
    return target.generate(
        **inputs, do_sample=True, max_new_tokens=NUM_TOKENS, pad_token_id=PAD, num_return_sequences=rows,
        generator=torch.Generator().manual_seed(seed), **cross(tokenizers, draft), **kwargs,
    )  # fmt: skip


# Every processor with the far draft and block verification (the default); token verification and the close draft
# on those that read token ids or come from the user.
CASES = [(setting, "far", "block") for setting in sorted(SETTINGS)] + [
    ("temperature_top_p", "close", "token"), ("bad_words", "close", "token"), ("user_processor", "close", "token"),
    ("repetition_penalty", "close", "block"),
]  # fmt: skip


@pytest.mark.parametrize(("setting", "draft_kind", "verification"), CASES)
def test_samples_follow_the_target_under_every_processor(target, drafts, tokenizers, setting, draft_kind, verification):
    settings = SETTINGS[setting]
    out = sample(target, tokenizers, drafts[draft_kind], seed=11, num_lookahead=2,
                 speculative_config=SpeculativeConfig(verification=verification), **settings)  # fmt: skip
    assert chisquare_pvalue(exact_for(target, **settings), continuations(out, PROMPT.shape[1])) > ALPHA


def test_samples_with_eos_and_k3(target, drafts, tokenizers):
    settings = dict(temperature=0.9, top_k=6, eos_token_id=EOS)
    out = sample(target, tokenizers, drafts["close"], seed=12, num_lookahead=3, **settings)
    samples = continuations(out, PROMPT.shape[1], (EOS,))
    assert sum(EOS in s for s in samples) > SAMPLES // 50, "EOS too rare to test anything"
    assert chisquare_pvalue(exact_for(target, eos_token_ids=(EOS,), **settings), samples) > ALPHA


def test_samples_with_prompt_lookup_first(target, drafts, tokenizers):
    """`prompt_lookup_num_tokens=` with a draft of another tokenizer: rows with an n-gram continuation take its target
    tokens first (point masses; a token the draft lacks is fed to it as id 0), the draft's proposals after them."""
    settings = dict(temperature=1.1)
    prompt = torch.tensor([[1, 5, 3, 5, 3]])  # "c a c a": n-grams recur from the first step
    out = sample(target, tokenizers, drafts["far"], seed=14, inputs=prompt, num_lookahead=2,
                 prompt_lookup_num_tokens=2, **settings)  # fmt: skip
    exact = exact_for(target, prompt, **settings)
    assert chisquare_pvalue(exact, continuations(out, prompt.shape[1])) > ALPHA


def test_batched_rows_of_different_prompts(target, drafts, tokenizers):
    """Two prompts of different lengths, left-padded, each repeated: every row follows its own prompt's target."""
    inputs = {"input_ids": torch.tensor([[1, 5, 3, 6], [PAD, PAD, 1, 4]]),
              "attention_mask": torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])}  # fmt: skip
    settings = dict(temperature=0.9, top_p=0.95)
    out = sample(target, tokenizers, drafts["far"], seed=13, inputs=inputs, rows=SAMPLES // 2, num_lookahead=2,
                 **settings)  # fmt: skip
    for row in range(2):
        prompt, mask = inputs["input_ids"][row : row + 1], inputs["attention_mask"][row : row + 1]
        exact = exact_for(target, prompt, mask, **settings)
        samples = continuations(out[row * (SAMPLES // 2) : (row + 1) * (SAMPLES // 2)], prompt.shape[1])
        assert chisquare_pvalue(exact, samples) > ALPHA


def _wrong_full_map_forgotten(self, probs):
    """Wrong: compact probabilities placed at the draft's own ids (the map forgotten), not at the target ids."""
    full = probs.new_zeros((*probs.shape[:-1], self.vocab_size))
    inside = self.columns < self.vocab_size
    return full.scatter_(-1, self.columns[inside].expand(*probs.shape[:-1], -1), probs[..., inside])


def _wrong_not_renormalised(scores):
    """Wrong: the draft's probabilities with a fifth of the mass left on tokens the target lacks (not renormalised
    over the shared tokens), while the proposal is drawn from the renormalised ones (sampling is scale-free)."""
    return probabilities(scores) * 0.8


VARIANTS = {  # name -> (what is replaced, by what); None: the library as it is
    "correct": None,
    "map_forgotten": (draft_model_module.DraftModelProposer, "_full", _wrong_full_map_forgotten),
    "not_renormalised": (draft_model_module, "probabilities", _wrong_not_renormalised),
}


@pytest.mark.parametrize("verification", ["token", "block"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_test_rejects_wrong_cross_tokenizer_drafts(target, drafts, tokenizers, monkeypatch, variant, verification):
    """The same seeded chi-square test passes the library and fails each wrong variant."""
    if VARIANTS[variant] is not None:
        monkeypatch.setattr(*VARIANTS[variant])
    settings = dict(temperature=1.3)  # vocabulary-free: the draft is processed compactly, then placed
    out = sample(target, tokenizers, drafts["far"], seed=11, num_lookahead=2,
                 speculative_config=SpeculativeConfig(verification=verification), **settings)  # fmt: skip
    pvalue = chisquare_pvalue(exact_for(target, **settings), continuations(out, PROMPT.shape[1]))
    print(f"\n{variant}, {verification} verification: chi-square p = {pvalue:.3g}")
    assert pvalue > ALPHA if variant == "correct" else pvalue < 1e-6


# ----------------------------------------------------------------------------------------------------------------
# Refusals, each before any forward pass.
# ----------------------------------------------------------------------------------------------------------------
class ForwardCounter:
    def __init__(self, *models):
        self.calls = 0
        self.handles = [model.register_forward_hook(self._count) for model in models if hasattr(model, "forward")]

    def _count(self, *args):
        self.calls += 1


def refused(target, match, **kwargs):
    counter = ForwardCounter(target, *[kwargs[k] for k in ("draft_model",) if not isinstance(kwargs.get(k), str)])
    try:
        with pytest.raises(ValueError, match=match):
            target.generate(PROMPT, max_new_tokens=4, pad_token_id=PAD, **kwargs)
    finally:
        for handle in counter.handles:
            handle.remove()
    assert counter.calls == 0


def test_refusals(target, drafts, tokenizers):
    target_tokenizer, draft_tokenizer = tokenizers
    other = tiny_lm(seed=4, vocab_size=300)  # a width far from the target's 8: another tokenizer, surely
    refused(target, "Pass the target's tokenizer as `tokenizer=` and the draft's as `draft_tokenizer=`",
            draft_model=other)  # fmt: skip
    with pytest.raises(ValueError, match="look like models with different tokenizers"):
        prepare_draft(other, target)
    refused(target, "FR-Spec draft_vocabulary", **cross(tokenizers, drafts["far"]),
            speculative_config=SpeculativeConfig(draft_vocabulary=4))  # fmt: skip
    with pytest.raises(ValueError, match="FR-Spec draft_vocabulary"):
        prepare_draft(drafts["far"], target, vocabulary=4, tokenizer=target_tokenizer, draft_tokenizer=draft_tokenizer)
    frspec = prepare_draft(drafts["far"], target, vocabulary=4)  # prepared as a same-tokenizer draft
    refused(target, "FR-Spec draft_vocabulary", **cross(tokenizers, frspec))
    for named in ("auto", "prompt_lookup"):
        refused(target, f"draft_model='{named}' drafts in the target's own token ids", **cross(tokenizers, named))
    refused(target, "made by prepare_draft\\('auto'", **cross(tokenizers, prepare_draft("auto", target)))
    no_overlap = bpe_tokenizer(["q", "r", "s", "t", "u", "v", "w", "z", "o", "p"], [])
    # a draft no call has prepared yet, whatever ran before in this process: its implicit preparation times forwards
    unprepared = tiny_lm(seed=3, vocab_size=len(DRAFT_TOKENS), layers=1, hidden=16, init_range=0.5)
    refused(target, "shares no token", draft_model=unprepared, tokenizer=target_tokenizer,
            draft_tokenizer=no_overlap)  # fmt: skip
    counter = ForwardCounter(target, unprepared)
    try:
        with pytest.raises(ValueError, match="shares no token"):
            prepare_draft(unprepared, target, tokenizer=target_tokenizer, draft_tokenizer=no_overlap)
    finally:
        for handle in counter.handles:
            handle.remove()
    assert counter.calls == 0
    refused(target, "pass the target's as `tokenizer=`", draft_model=drafts["far"], draft_tokenizer=draft_tokenizer)


def test_same_vocabulary_given_twice_is_the_usual_path(target, tokenizers):
    draft = perturbed_copy(target, seed=5, scale=0.1)
    same = bpe_tokenizer(TARGET_TOKENS, [("a", "b"), ("c", "a")])  # another object, the same vocabulary
    out = greedy(target, PROMPT, max_new_tokens=10, draft_model=draft, tokenizer=tokenizers[0], draft_tokenizer=same,
                 return_dict_in_generate=True)  # fmt: skip
    assert out.speculative_stats.shared_vocabulary is None
    assert torch.equal(out.sequences, greedy(target, PROMPT, max_new_tokens=10))
