"""Hybrid and state-space models: exact on every family transformers ships, or refused before any work.

Tiny random models of every family whose cache keeps convolution or recurrent states (`hf_specsample_bench.hybrids`:
2-3 layers, hidden size 32), drafted for by a noisy copy of themselves (rows accept different numbers of drafts, so
rollbacks are ragged in most rounds):
- every family the installed transformers has is in the table, exact or refused with its reason;
- greedy: one prompt, and ragged batches padded on either side, give plain greedy's tokens;
- EOS inside accepted blocks: sequences equal plain's, the returned cache holds plain's states (convolution windows,
  recurrent states, visible keys and values), and a second chat turn on it equals plain's;
- sampling follows the target's exact distribution (chi-square, one family per rollback mechanism), and sampled
  tokens stay in the target's top-k for every family;
- power: a rollback off by one token (recurrent states or convolution windows) fails greedy identity and the
  chi-square test;
- hybrid targets with attention drafts and the reverse, Mamba-1 drafts, prompt lookup, int8 drafts, static caches.
"""

import pytest
import torch
from exact import chisquare_pvalue, continuations, exact_distribution, sampled_pvalue
from test_architectures import (
    NEW_TOKENS,
    PROMPTS,
    assert_greedy_cases_match_plain,
    assert_prompt_lookup_matches_plain,
    assert_samples_in_top_k,
    batch,
    eos_mid_way,
)
from tiny import PAD, cache_of, perturbed_copy, prepared_processors, second_turns, tiny_arch, with_cache

from hf_specsample import SpeculativeConfig
from hf_specsample.cache import checkpoints, linear_states
from hf_specsample.core import transformers_api
from hf_specsample_bench.hybrids import HYBRID_FAMILIES, Kind, Status, available, tiny_hybrid, transformers_families

VOCAB = 48
CLOSE = 0.1  # noise of the greedy tests' drafts: they accept about half their tokens, in ragged counts
FAR = 0.2  # noise of the sampling tests' drafts: rejections in most rounds

EXACT = [name for name, family in HYBRID_FAMILIES.items() if family.status is Status.EXACT]
DRAFT_ONLY = [name for name, family in HYBRID_FAMILIES.items() if family.status is Status.DRAFT_ONLY]
REFUSED = [name for name, family in HYBRID_FAMILIES.items() if family.status is Status.REFUSED]


def _family(name: str):
    return pytest.param(
        name, marks=pytest.mark.skipif(not available(name), reason=f"this transformers has no {name} family")
    )


@pytest.fixture(scope="module", params=[_family(name) for name in EXACT])
def pair(request):
    target = tiny_hybrid(request.param, seed=0, vocab_size=VOCAB)
    return request.param, target, perturbed_copy(target, seed=1, scale=CLOSE)


def both(target, draft, ids, mask=None, **kwargs):
    """(plain, speculative) outputs of generate() with the same arguments."""
    kwargs = dict(max_new_tokens=NEW_TOKENS, pad_token_id=PAD, do_sample=False, **kwargs)
    plain = target.generate(ids, attention_mask=mask, **kwargs)
    speculative = target.generate(ids, attention_mask=mask, draft_model=draft, num_lookahead=3, **kwargs)
    return plain, speculative


def test_every_family_transformers_ships_is_in_the_table():
    """A family added to transformers fails here until it is tested exact or refused with a reason."""
    installed = transformers_families()
    assert installed <= set(HYBRID_FAMILIES), sorted(installed - set(HYBRID_FAMILIES))
    assert {name for name in HYBRID_FAMILIES if available(name)} == installed
    assert all(family.reason for family in HYBRID_FAMILIES.values() if family.status is not Status.EXACT)


@torch.no_grad()
def test_greedy_single_prompt_and_ragged_batches(pair):
    _, target, draft = pair
    assert_greedy_cases_match_plain(both, target, draft)


def linear_states_of(cache) -> dict:
    """{(layer, field, state): tensor} of every initialised convolution / recurrent state of a cache."""
    found = {}
    for index, layer in linear_states.linear_layers(cache):
        for field in linear_states.StateField:
            initialized = getattr(layer, f"is_{field.value}_initialized")
            for state, tensor in getattr(layer, field.value).items():
                if initialized[state]:
                    found[index, field, state] = tensor
    return found


def assert_same_states(plain_cache, speculative_cache):
    """The same convolution windows and recurrent states in every row, and layers that no longer record.

    Up to rounding: a scan over K+1 positions adds in another order than K+1 single steps, and some tiny models'
    states are sensitive to it (Zamba2's differ by up to 2e-2 in single elements); a state off by one token differs
    by far more, in most elements.
    """
    plain, mine = linear_states_of(plain_cache), linear_states_of(speculative_cache)
    assert mine.keys() == plain.keys()
    for key in plain:
        torch.testing.assert_close(
            mine[key], plain[key], rtol=5e-2, atol=5e-2, msg=lambda text, key=key: f"{key}: {text}"
        )
    for _, layer in linear_states.linear_layers(speculative_cache):
        assert not layer.record_past


def assert_same_keys(plain_cache, speculative_cache, attention_mask):
    """Same shapes, same keys and values in every slot the mask lets a query see, in every attention layer (values
    may have another head size than keys: multi-head latent attention)."""
    plain_layers, layers = list(attention_of(plain_cache)), list(attention_of(speculative_cache))
    assert len(layers) == len(plain_layers) and speculative_cache.get_seq_length() == plain_cache.get_seq_length()
    for plain_layer, layer in zip(plain_layers, layers):
        for mine, theirs in ((layer.keys, plain_layer.keys), (layer.values, plain_layer.values)):
            assert mine.shape == theirs.shape
            seen = attention_mask[:, -mine.shape[-2] :].bool()[:, None, :, None].expand_as(mine)
            torch.testing.assert_close(mine[seen], theirs[seen], rtol=1e-2, atol=1e-2)


def attention_of(cache):
    """The layers of a cache that hold keys and values."""
    return (layer for layer in cache.layers if getattr(layer, "keys", None) is not None)


@torch.no_grad()
def test_eos_in_block_outputs_cache_and_next_turn(pair):
    """Rows stop at different steps inside accepted blocks; the cache plain would return; a second chat turn on it."""
    name, target, draft = pair
    ids, mask = batch(PROMPTS, "left")
    eos = eos_mid_way(target, ids, mask)
    plain, speculative = both(target, draft, ids, mask, eos_token_id=eos, return_dict_in_generate=True)
    assert speculative.sequences.tolist() == plain.sequences.tolist()
    assert_same_states(cache_of(plain), cache_of(speculative))
    if not any(True for _ in attention_of(cache_of(plain))):
        return  # a state-space model: a cache of states alone cannot be continued (`test_refusals`)
    cached_mask = torch.cat([mask, torch.ones_like(plain.sequences[:, ids.shape[1] :])], dim=1)[:, :-1]
    assert_same_keys(cache_of(plain), cache_of(speculative), cached_mask)

    kwargs = dict(max_new_tokens=NEW_TOKENS, pad_token_id=PAD, do_sample=False, eos_token_id=eos)
    plain_2, speculative_2 = second_turns(target, draft, plain, speculative, mask, ids.shape[1], **kwargs)
    assert speculative_2.tolist() == plain_2.tolist(), name


@torch.no_grad()
def test_sampling_stays_in_target_top_k(pair):
    """Every sampled token is among the target's top 3 after its own prefix (computed without any cache)."""
    _, target, draft = pair
    assert_samples_in_top_k(target, draft, num_lookahead=3)


PROMPT = torch.tensor([[1, 5, 2, 5]])
SAMPLING = dict(top_k=3)
ROWS = 2000  # samples per chi-square test: 27 continuations of 3 tokens
ROWS_PER_CALL = 1000
# Kimi's and Bailing's linear attention run transformers' chunked CPU fallback, which pads every forward of several
# positions to 64: fewer samples there.
FEWER_ROWS = {"kimi_linear": 1000, "bailing_hybrid": 1000}
# Noise that makes a family's draft accept between a tenth and about half of its tokens (top-k 3, K = 2).
DRAFT_NOISE = {"lfm2_moe": 0.3, "qwen3_next": 0.15}


def sample(name: str, rows: int | None = None, **generate_kwargs) -> tuple[float, list]:
    """(chi-square p-value, statistics of each call) of `rows` continuations of `PROMPT`, sampled in batches of
    `ROWS_PER_CALL` with a draft that disagrees often (gated delta nets' CPU scans slow down on wider batches)."""
    rows = rows or FEWER_ROWS.get(name, ROWS)
    target = tiny_hybrid(name, seed=0, vocab_size=VOCAB)
    draft = perturbed_copy(target, seed=1, scale=DRAFT_NOISE.get(name, FAR))
    generator = torch.Generator().manual_seed(3)
    samples, stats = [], []
    for _ in range(rows // ROWS_PER_CALL):
        out = target.generate(
            PROMPT, do_sample=True, max_new_tokens=3, num_return_sequences=ROWS_PER_CALL, pad_token_id=PAD,
            draft_model=draft, num_lookahead=2, return_dict_in_generate=True, generator=generator, **SAMPLING,
            **generate_kwargs,
        )  # fmt: skip
        samples += continuations(out.sequences, PROMPT.shape[1])
        stats.append(out.speculative_stats)
    processors, _ = prepared_processors(target, PROMPT, do_sample=True, max_new_tokens=3, **SAMPLING)
    exact = exact_distribution(target, PROMPT, processors, 3)
    return chisquare_pvalue(exact, samples), stats


@pytest.mark.parametrize("name", [_family(name) for name in EXACT])
@torch.no_grad()
def test_sampling_is_exact(name):
    """Rows reject a draft in most rounds, at different positions: every rollback is ragged."""
    p_value, stats = sample(name)
    assert p_value > 1e-3
    accepted, drafted = sum(s.accepted_tokens for s in stats), sum(s.draft_tokens for s in stats)
    assert 0 < accepted < 0.6 * drafted  # K = 2: a round accepts both drafts with probability below 0.36
    if HYBRID_FAMILIES[name].kind is Kind.RECURRENT:
        assert all(s.target_refeed_passes > 0 for s in stats)


def off_by_one_recurrent(monkeypatch):
    """A wrong rollback: every row restored to the state one position after its last kept one (where it has one)."""
    original = checkpoints.StateCheckpoints.restore

    def restore(self, fed, keep, run):
        return original(self, fed, [min(kept + 1, held) for kept, held in zip(keep, fed)], run)

    monkeypatch.setattr(checkpoints.StateCheckpoints, "restore", restore)


def off_by_one_convolution(monkeypatch):
    """A wrong rollback: every convolution window keeps one position it should have dropped (where it has one)."""
    original = linear_states.trim_positional
    monkeypatch.setattr(
        linear_states, "trim_positional", lambda cache, drops: original(cache, [max(0, d - 1) for d in drops])
    )


@pytest.mark.parametrize(
    "name, wrong",
    [("lfm2", off_by_one_convolution), ("bamba", off_by_one_recurrent), ("qwen3_5", off_by_one_recurrent)],
)
@torch.no_grad()
def test_an_off_by_one_rollback_fails_the_tests(monkeypatch, name, wrong):
    """Power: the same greedy and chi-square tests catch a rollback that keeps one rejected token in the state."""
    target = tiny_hybrid(name, seed=0, vocab_size=VOCAB)
    draft = perturbed_copy(target, seed=1, scale=CLOSE)
    wrong(monkeypatch)
    for ids, mask in ((torch.tensor([PROMPTS[0]]), None), batch(PROMPTS, "left")):  # re-feeds deferred / run at once
        plain, speculative = both(target, draft, ids, mask)
        assert speculative.tolist() != plain.tolist()
    assert sample(name)[0] < 1e-3


# One family per kind of state for the tests below: convolutions (lfm2), Mamba-2 beside attention (bamba), gated
# delta nets (qwen3_5), Zaya (convolution windows and a one-token state), a state-space model alone (mamba2).
REPRESENTATIVES = ["lfm2", "bamba", "qwen3_5", "zaya", "mamba2"]


@pytest.mark.parametrize("name", [_family(name) for name in REPRESENTATIVES])
@torch.no_grad()
def test_hybrid_target_with_attention_draft_and_the_reverse(name):
    hybrid = tiny_hybrid(name, seed=0, vocab_size=VOCAB)
    llama = tiny_arch("llama", seed=0, vocab_size=VOCAB)
    ids, mask = batch(PROMPTS, "left")
    for target, draft in ((hybrid, llama), (llama, hybrid)):
        plain, speculative = both(target, draft, ids, mask)
        assert speculative.tolist() == plain.tolist(), type(target).__name__


@pytest.mark.parametrize("name", [_family(name) for name in DRAFT_ONLY])
@torch.no_grad()
def test_mamba1_drafts_are_exact(name):
    """Mamba-1 models are refused as targets (`test_errors.py`) but draft exactly: one position per forward."""
    draft = tiny_hybrid(name, seed=0, vocab_size=VOCAB)
    for target in (tiny_hybrid("qwen3_5", seed=0, vocab_size=VOCAB), tiny_arch("llama", seed=0, vocab_size=VOCAB)):
        ids, mask = batch(PROMPTS, "left")
        plain, speculative = both(target, draft, ids, mask)
        assert speculative.tolist() == plain.tolist(), type(target).__name__


def test_sampling_with_a_mamba1_draft_is_exact():
    target = tiny_hybrid("bamba", seed=0, vocab_size=VOCAB)
    draft = tiny_hybrid("mamba", seed=0, vocab_size=VOCAB)
    p_value = sampled_pvalue(target, PROMPT, 3, ROWS, seed=3, settings=SAMPLING, draft_model=draft, num_lookahead=2)
    assert p_value > 1e-3


@pytest.mark.parametrize("name", [_family(name) for name in REPRESENTATIVES])
@pytest.mark.parametrize("side", ["left", "right"])
@torch.no_grad()
def test_greedy_prompt_lookup_ragged_batch_with_eos(name, side):
    """Both prompt-lookup drafters (n-grams alone; n-grams first, then the model): rows roll back by other counts."""
    target = tiny_hybrid(name, seed=0, vocab_size=VOCAB)
    draft = perturbed_copy(target, seed=1, scale=CLOSE)
    assert_prompt_lookup_matches_plain(target, draft, side)


@pytest.mark.parametrize("form", ["dynamic_int8", "int8_weights", "int4_weights"])
@pytest.mark.parametrize("name", [_family(name) for name in REPRESENTATIVES])
@torch.no_grad()
def test_quantized_hybrid_drafts(name, form):
    """A hybrid draft's quantized forms (dynamic int8, the kernel's int8 / int4 weights; a linear whose weight tensor
    the forward reads stays float: Mamba-2's head casts its input to that weight's dtype)."""
    from hf_specsample.options import DraftForm
    from hf_specsample.prepare.surgery import quantized_forms

    target = tiny_hybrid(name, seed=0, vocab_size=VOCAB)
    draft = perturbed_copy(target, seed=1, scale=CLOSE)
    if DraftForm(form) not in quantized_forms(draft):
        pytest.skip(f"draft_form={form!r} cannot be made on this machine")
    ids, mask = batch(PROMPTS, "left")
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=PAD, do_sample=False)
    stats = {}
    for quantization in ("as_given", form):
        out = target.generate(
            ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=PAD, do_sample=False,
            draft_model=draft, num_lookahead=3, return_dict_in_generate=True,
            speculative_config=SpeculativeConfig(draft_form=quantization),
        )  # fmt: skip
        assert out.sequences.tolist() == plain.tolist()
        stats[quantization] = out.speculative_stats
    assert stats[form].draft_form.startswith(form)
    rate = {quantization: s.accepted_tokens / s.draft_tokens for quantization, s in stats.items()}
    assert rate[form] >= 0.6 * rate["as_given"]  # drafts about as well as the float draft (a head fed int8 input: 0.4x)


STATIC = dict(cache_implementation="static", max_cache_len=64)
STATIC_FAMILIES = [name for name in EXACT if not name.startswith("inkling")]  # Inkling: see test_refusals


@pytest.mark.parametrize("name", [_family(name) for name in STATIC_FAMILIES])
@torch.no_grad()
def test_static_caches(name):
    """Greedy through a static cache equals plain static decoding; its cache continues a second turn exactly."""
    target = tiny_hybrid(name, seed=0, vocab_size=VOCAB)
    draft = perturbed_copy(target, seed=1, scale=CLOSE)
    ids, mask = batch(PROMPTS, "left")
    kwargs = dict(max_new_tokens=NEW_TOKENS, pad_token_id=PAD, do_sample=False, return_dict_in_generate=True)
    plain = target.generate(ids, attention_mask=mask, **STATIC, **kwargs)
    mine = target.generate(ids, attention_mask=mask, draft_model=draft, num_lookahead=3, **STATIC, **kwargs)
    assert mine.sequences.tolist() == plain.sequences.tolist()
    assert_same_states(cache_of(plain), cache_of(mine))
    if not any(True for _ in attention_of(cache_of(plain))):
        return
    turn = torch.tensor([[11, 12, 13]] * ids.shape[0])
    second_ids = torch.cat([plain.sequences, turn], dim=1)
    second_mask = torch.cat([mask, torch.ones_like(plain.sequences[:, ids.shape[1] :]), torch.ones_like(turn)], 1)
    plain_2 = target.generate(second_ids, attention_mask=second_mask, **with_cache(cache_of(plain)), **kwargs)
    mine_2 = target.generate(
        second_ids, attention_mask=second_mask, **with_cache(cache_of(mine)), draft_model=draft, num_lookahead=3,
        **kwargs,
    )  # fmt: skip
    assert mine_2.sequences.tolist() == plain_2.sequences.tolist()


def test_refusals_before_any_work():
    """Each refused setup says why and what to do instead, before a forward runs."""
    calls = []
    qwen = tiny_hybrid("qwen3_5", seed=0, vocab_size=VOCAB)
    qwen.register_forward_hook(lambda *args: calls.append(1))
    prompt = torch.tensor([PROMPTS[0]])
    kwargs = dict(max_new_tokens=4, pad_token_id=PAD)
    for name in REFUSED:  # sparse (indexed) attention
        if available(name):
            with pytest.raises(ValueError, match="indexed sparse attention|DynamicIndexedLayer"):
                tiny_hybrid(name, seed=0, vocab_size=VOCAB).generate(prompt, draft_model=qwen, **kwargs)
    with pytest.raises(
        ValueError, match=r"compile=True\) cannot compile this target: it keeps convolution / recurrent"
    ):
        qwen.generate(prompt, draft_model=qwen, speculative_config=SpeculativeConfig(compile=True), **kwargs)
    state_space = tiny_hybrid("mamba2", seed=0, vocab_size=VOCAB)
    first = state_space.generate(prompt, return_dict_in_generate=True, **kwargs)
    with pytest.raises(ValueError, match="holds only recurrent / convolution states.*without the cache"):
        state_space.generate(  # under the name its forward takes (transformers < 5.24: not `generate()`'s own)
            torch.cat([first.sequences, prompt], 1), **transformers_api.cache_kwargs(state_space, cache_of(first)),
            draft_model=qwen, **kwargs,
        )  # fmt: skip
    inkling = tiny_hybrid("inkling2", seed=0, vocab_size=VOCAB) if available("inkling2") else None
    if inkling is not None:
        with pytest.raises(ValueError, match="fused with sliding-window attention.*default dynamic cache"):
            inkling.generate(prompt, draft_model=inkling, **STATIC, **kwargs)
    assert calls == []


@torch.no_grad()
def test_auto_drafts_of_a_hybrid_target():
    """On the CPU, draft_model="auto" is an int8 copy of the whole target: exact. The layer-skipping self-draft (the
    default off the CPU) is refused for hybrids: their per-layer config is not renumbered by the view."""
    from hf_specsample import prepare_draft

    target = tiny_hybrid("bamba", seed=0, vocab_size=VOCAB)
    ids, mask = batch(PROMPTS, "left")
    plain, speculative = both(target, "auto", ids, mask)
    assert speculative.tolist() == plain.tolist()
    with pytest.raises(ValueError, match="skips layers of the target.*convolution or recurrent states"):
        prepare_draft("auto", target, form="as_given")


def test_a_hybrid_draft_with_another_tokenizer_is_refused():
    from tiny import char_tokenizer

    target = tiny_arch("llama", seed=0, vocab_size=VOCAB)
    draft = tiny_hybrid("lfm2", seed=0, vocab_size=40)
    with pytest.raises(ValueError, match="keeps convolution or recurrent states.*another tokenizer"):
        target.generate(
            torch.tensor([PROMPTS[0]]), draft_model=draft, tokenizer=char_tokenizer(VOCAB),
            draft_tokenizer=char_tokenizer(40), max_new_tokens=4, pad_token_id=PAD,
        )  # fmt: skip


def test_the_lookahead_policy_sees_each_rounds_refeeds():
    """Every round's record carries the forwards its rollback re-fed (the clock-free costs count them; measured costs
    time them as part of the round), and they add up to the call's statistics."""
    from hf_specsample.policy.lookahead import FixedLookahead

    policies = []

    class Recording(FixedLookahead):
        def __init__(self):
            super().__init__(3)
            self.records = []
            policies.append(self)

        def observe(self, record):
            self.records.append(record)

    target = tiny_hybrid("qwen3_5", seed=0, vocab_size=VOCAB)
    ids, mask = batch(PROMPTS, "left")
    out = target.generate(
        ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=PAD, do_sample=False,
        draft_model=perturbed_copy(target, seed=1, scale=CLOSE), return_dict_in_generate=True,
        speculative_config=SpeculativeConfig(lookahead_policy=Recording),
    )  # fmt: skip
    refeeds = [record.refeed_forwards for record in policies[0].records]
    assert sum(refeeds) == out.speculative_stats.target_refeed_passes > 0


@torch.no_grad()
def test_a_static_cache_smaller_than_needed_is_grown_with_its_states():
    """Falcon-H1's layers fuse Mamba-2 states with static attention: a too-small caller cache grows, states kept."""
    from transformers import StaticCache

    target = tiny_hybrid("falcon_h1", seed=0, vocab_size=VOCAB)
    draft = perturbed_copy(target, seed=1, scale=CLOSE)
    prompt = torch.tensor([PROMPTS[0]])
    small = StaticCache(config=target.config, max_cache_len=6)
    kwargs = dict(max_new_tokens=NEW_TOKENS, pad_token_id=PAD, do_sample=False)
    plain = target.generate(prompt, **kwargs)
    mine = target.generate(prompt, **with_cache(small), draft_model=draft, num_lookahead=3, **kwargs)
    assert mine.tolist() == plain.tolist()
    assert min(layer.max_cache_len for layer in attention_of(small)) >= prompt.shape[1] + NEW_TOKENS


@pytest.mark.parametrize("name", [_family(name) for name in ["qwen3_5", "bamba", "zaya"]])
@torch.no_grad()
def test_one_rows_refeeds_are_deferred_to_the_next_verification(monkeypatch, name):
    """A single row's re-feed mostly waits for the next round's verification, which feeds its kept positions first
    (up to K of them: then it runs at once); without deferring, every rejected round re-feeds. Same tokens."""
    target = tiny_hybrid(name, seed=0, vocab_size=VOCAB)
    draft = perturbed_copy(target, seed=1, scale=CLOSE)
    kwargs = dict(max_new_tokens=NEW_TOKENS, pad_token_id=PAD, do_sample=False, return_dict_in_generate=True)
    prompt = torch.tensor([PROMPTS[0]])
    plain = target.generate(prompt, max_new_tokens=NEW_TOKENS, pad_token_id=PAD, do_sample=False)
    deferred = target.generate(prompt, draft_model=draft, num_lookahead=3, **kwargs)
    monkeypatch.setattr(checkpoints.StateCheckpoints, "deferred_keep", lambda *args, **kwargs: None)
    eager = target.generate(prompt, draft_model=draft, num_lookahead=3, **kwargs)
    assert deferred.sequences.tolist() == eager.sequences.tolist() == plain.tolist()
    assert eager.speculative_stats.target_refeed_passes == sum(eager.speculative_stats.row_rejections) > 0
    assert deferred.speculative_stats.target_refeed_passes < eager.speculative_stats.target_refeed_passes / 2


@pytest.mark.parametrize("name", [_family(name) for name in ["lfm2", "qwen3_5", "zaya"]])
@torch.no_grad()
def test_the_cache_object_passed_in_holds_the_result(name):
    """Clients that keep one cache object and pass it every turn see plain's states in that very object."""
    from transformers import DynamicCache

    target = tiny_hybrid(name, seed=0, vocab_size=VOCAB)
    draft = perturbed_copy(target, seed=1, scale=CLOSE)
    prompt = torch.tensor([PROMPTS[0]])
    kwargs = dict(max_new_tokens=9, do_sample=False, pad_token_id=PAD)
    theirs, ours = DynamicCache(config=target.config), DynamicCache(config=target.config)
    plain = target.generate(prompt, **with_cache(theirs), **kwargs)
    mine = target.generate(prompt, **with_cache(ours), draft_model=draft, num_lookahead=3, **kwargs)
    assert mine.tolist() == plain.tolist()
    assert_same_states(theirs, ours)
    conversation = torch.cat([plain, torch.tensor([[11, 12, 3]])], dim=1)
    plain_2 = target.generate(conversation, **with_cache(theirs), **kwargs)
    mine_2 = target.generate(conversation, **with_cache(ours), draft_model=draft, num_lookahead=3, **kwargs)
    assert mine_2.tolist() == plain_2.tolist()
    assert_same_states(theirs, ours)
