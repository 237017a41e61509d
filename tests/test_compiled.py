"""Compiled verification (`SpeculativeConfig(compile=True)`, `compile_config=`): exact, reused, never stale.

Tiny models compile in seconds with frozen weights only (the `light` fixture drops max-autotune, whose GEMM
benchmarking costs seconds per shape); one slow test runs the real CPU settings. K changes every round under the
adaptive policy, so the dynamic query length is exercised.
"""

import contextlib

import pytest
import torch
from exact import sampled_pvalue
from tiny import PAD, perturbed_copy, tiny_llama, tiny_lm
from transformers import CompileConfig

import hf_specsample.cache.compiled as compiled
from hf_specsample import FixedLookahead, LookaheadPolicy, SpeculativeConfig
from hf_specsample.kernels import routing as kernel_routing
from hf_specsample.kernels.routing import KernelRouting

COMPILE = SpeculativeConfig(compile=True)


class Cycling(LookaheadPolicy):
    """K = 1, 2, 3, 1, 2, 3, ...: rounds of several widths whatever the costs (a tiny draft costs what its target
    costs, so the default policy drafts little)."""

    def __init__(self):
        self.lookahead = 0

    def choose(self) -> int:
        self.lookahead = self.lookahead % 3 + 1
        return self.lookahead

    @property
    def needs_timing(self) -> bool:
        return False


WIDTHS = SpeculativeConfig(compile=True, lookahead_policy=Cycling)
PROMPT = torch.tensor([[1, 5, 2, 5]])


@pytest.fixture
def light(monkeypatch):
    """Frozen weights without max-autotune: the same compiled path, seconds instead of minutes."""
    monkeypatch.setattr(compiled, "CPU_INDUCTOR_OPTIONS", (("freezing", True),))


def make_pair():
    target = tiny_lm(seed=0, vocab_size=16, layers=2, hidden=32)
    return target, perturbed_copy(target, seed=1, scale=0.3)


@pytest.fixture(scope="module")
def pair():
    """Shared by the tests that leave the weights alone: compiled once (per shape class) for all of them."""
    return make_pair()


@pytest.fixture
def own_pair():
    """A pair whose weights a test changes."""
    return make_pair()


def greedy(target, **kwargs):
    return target.generate(PROMPT, max_new_tokens=16, pad_token_id=PAD, do_sample=False, **kwargs)


@torch.no_grad()
def test_compiled_greedy_equals_plain_and_is_reused(light, pair):
    target, draft = pair
    plain = greedy(target)
    first = greedy(target, draft_model=draft, speculative_config=WIDTHS, return_dict_in_generate=True)
    assert first.sequences.tolist() == plain.tolist()
    assert first.speculative_stats.compile_seconds > 0
    # One graph (one frozen weight copy) serves the warm-up and every round: one-position rounds run as two, and
    # the warm-up's inputs have the rounds' strides.
    assert next(iter(compiled._COMPILED[target].values())).compilations == 1
    assert len(set(first.speculative_stats.lookahead_per_round[1:])) > 1, "K should vary (dynamic query length)"
    again = greedy(target, draft_model=draft, speculative_config=COMPILE, return_dict_in_generate=True)
    assert again.sequences.tolist() == plain.tolist()
    assert again.speculative_stats.compile_seconds == 0.0  # the compiled forward is kept with the model
    assert "compiled target" in str(again.speculative_stats)
    # Another prompt length and max_new_tokens (so another cache size): no recompilation (dynamic shapes).
    longer = torch.tensor([[1, 5, 2, 5, 3, 7, 2, 6, 1]])
    other = target.generate(longer, max_new_tokens=27, pad_token_id=PAD, do_sample=False, draft_model=draft,
                            speculative_config=COMPILE, return_dict_in_generate=True)  # fmt: skip
    assert other.sequences.tolist() == target.generate(longer, max_new_tokens=27, pad_token_id=PAD).tolist()
    assert other.speculative_stats.compile_seconds == 0.0


@pytest.mark.parametrize("duck_shapes", [False, True])
@torch.no_grad()
def test_one_graph_when_a_head_count_equals_the_warm_up_width(light, monkeypatch, duck_shapes):
    """Two key/value heads, as Qwen2.5-1.5B has, and a warm-up over two positions: one graph serves the warm-up, the
    prompt and every round. The power check: with torch's duck shapes the width shares the head count's symbol, a
    guard on the heads pins it, and the next width compiles (and freezes the weights) a second time."""
    if duck_shapes:
        monkeypatch.setattr(compiled, "_no_duck_shapes", lambda symbolic: contextlib.nullcontext())
    target = tiny_llama(0, 16, 2, 32, heads=2, kv_heads=2, init_range=0.5)
    draft = perturbed_copy(target, seed=1, scale=0.3)
    widths = []
    call = compiled.CompiledForward.__call__

    def recording(self, **kwargs):
        widths.append(kwargs["input_ids"].shape[1])
        return call(self, **kwargs)

    monkeypatch.setattr(compiled.CompiledForward, "__call__", recording)
    prompt = torch.tensor([[1, 5, 2, 5, 3, 7, 2]])
    out = target.generate(prompt, max_new_tokens=16, pad_token_id=PAD, do_sample=False, draft_model=draft,
                          speculative_config=WIDTHS, return_dict_in_generate=True)  # fmt: skip
    assert out.sequences.tolist() == target.generate(prompt, max_new_tokens=16, pad_token_id=PAD).tolist()
    assert widths[0] == 2 and widths[1] >= prompt.shape[1], "the warm-up, then the prompt through compiled code"
    assert len(set(widths)) > 2, "several widths"
    widths.clear()  # a second call: a new cache, allocated eagerly, and its prompt through the compiled graph too
    again = target.generate(prompt, max_new_tokens=16, pad_token_id=PAD, do_sample=False, draft_model=draft,
                            speculative_config=WIDTHS, return_dict_in_generate=True)  # fmt: skip
    assert again.sequences.tolist() == out.sequences.tolist()
    first_round = prompt.shape[1] + again.speculative_stats.lookahead_per_round[0]  # the prompt and the K drafts
    assert widths[0] == first_round, "the second call's prompt (and first drafts) through compiled code"
    compilations = next(iter(compiled._COMPILED[target].values())).compilations
    assert compilations == 1 if not duck_shapes else compilations >= 2  # duck shapes: a width compiles again


@torch.no_grad()
def test_compiled_sampling_is_exact(light, pair):
    target, draft = pair
    settings = dict(temperature=0.9, top_k=5)
    p_value = sampled_pvalue(target, PROMPT, 3, 4000, seed=5, settings=settings, draft_model=draft,
                             speculative_config=COMPILE, num_lookahead=2)  # fmt: skip
    assert p_value > 1e-3


@torch.no_grad()
def test_weights_changed_after_compiling_are_used(light, own_pair):
    """Frozen weights are a copy: a change in place must be seen (recompiled), never the old model's output."""
    target, draft = own_pair
    greedy(target, draft_model=draft, speculative_config=COMPILE)
    with torch.no_grad():
        for parameter in target.parameters():
            parameter.mul_(-1.3)
    plain = greedy(target)
    again = greedy(target, draft_model=draft, speculative_config=COMPILE, return_dict_in_generate=True)
    assert again.sequences.tolist() == plain.tolist()
    # one recompilation for the new weights (needs_warm_up sees them stale, so the warm-up compiles, not a round)
    assert next(iter(compiled._COMPILED[target].values())).compilations == 2


@torch.no_grad()
def test_weight_guard_has_power(light, own_pair, monkeypatch):
    """Without the fingerprint check, the compiled forward keeps computing the old weights (what the guard stops)."""
    target, draft = own_pair
    monkeypatch.setattr(compiled, "_fingerprint", lambda model: ())
    before = greedy(target, draft_model=draft, speculative_config=COMPILE)
    with torch.no_grad():
        for parameter in target.parameters():
            parameter.mul_(-1.3)
    assert greedy(target).tolist() != before.tolist()
    stale = greedy(target, draft_model=draft, num_lookahead=3, speculative_config=COMPILE)
    assert stale.tolist() != greedy(target).tolist()


@torch.no_grad()
def test_compile_config_is_honoured_as_plain_generate_does(pair):
    """`cache_implementation="static"` + `compile_config=`: compiled on CPU only with `_compile_all_devices`."""
    target, draft = pair
    config = CompileConfig(fullgraph=False, dynamic=True, mode=None, options={"freezing": True})
    kwargs = dict(draft_model=draft, cache_implementation="static", return_dict_in_generate=True, num_lookahead=3)
    eager = greedy(target, compile_config=config, **kwargs)
    assert eager.speculative_stats.compile_seconds is None  # plain generate() does not compile on CPU either
    config._compile_all_devices = True
    out = greedy(target, compile_config=config, **kwargs)
    assert out.speculative_stats.compile_seconds is not None
    assert out.sequences.tolist() == greedy(target).tolist()
    assert (
        greedy(target, compile_config=config, disable_compile=True, **kwargs).speculative_stats.compile_seconds is None
    )


def test_compile_refused_where_it_cannot_run(pair):
    target, draft = pair
    target.hf_device_map = {"model.embed_tokens": "cpu", "model.layers": "disk"}
    try:
        with pytest.raises(ValueError, match="offloaded by accelerate"):
            greedy(target, draft_model=draft, speculative_config=COMPILE)
    finally:
        del target.hf_device_map
    with pytest.raises(TypeError, match="compile must be True or False"):
        SpeculativeConfig(compile="yes")


def test_settings_for_cpu_freeze_and_use_the_cpp_gemm():
    settings = compiled.CompileSettings.for_device(torch.device("cpu"))
    options = dict(settings.inductor_options)
    assert settings.freezes and options["freezing"] and "CPP" in options["max_autotune_gemm_backends"]
    assert dict(settings.compile_kwargs)["dynamic"] is True
    assert dict(compiled.CompileSettings.for_device(torch.device("cuda")).compile_kwargs)["mode"] == "reduce-overhead"


@pytest.mark.slow
@torch.no_grad()
def test_real_cpu_settings_greedy_equals_plain(pair):
    """The settings users get (max-autotune, C++ GEMM), on a tiny model: compiles for a minute or two."""
    target, draft = pair
    out = greedy(target, draft_model=draft, speculative_config=COMPILE)
    assert out.tolist() == greedy(target).tolist()


K0 = SpeculativeConfig(compile=True, lookahead_policy=lambda: FixedLookahead(0))  # every round one position


@torch.no_grad()
def test_one_position_rounds_run_padded_and_exact(light, pair):
    """K=0 rounds feed one position, run through the compiled graph as two (the extra slot rolled back)."""
    target, draft = pair
    forward = compiled.compiled_forward(target, compiled.CompileSettings.for_device(torch.device("cpu")))
    expected = forward.compilations + int(not forward.ready_for(1))  # this module's earlier tests may have warmed it
    out = greedy(target, draft_model=draft, speculative_config=K0, return_dict_in_generate=True)
    assert out.sequences.tolist() == greedy(target).tolist()
    assert set(out.speculative_stats.lookahead_per_round) == {0}
    # the first round (the prompt, one logit kept) and the one-position rounds: the graph of the warm-up
    assert forward.compilations == expected
    p_value = sampled_pvalue(target, PROMPT, 3, 4000, seed=6, settings=dict(temperature=0.9, top_k=5),
                             draft_model=draft, speculative_config=K0)  # fmt: skip
    assert p_value > 1e-3


@torch.no_grad()
def test_compiled_ragged_batch_that_shrinks_equals_plain(light, pair):
    """Rows stop at different rounds (EOS); the last row finishes eagerly (its one-row shape was not compiled)."""
    target, draft = pair
    ids = torch.tensor([[PAD, PAD, 1, 5, 2, 5], [1, 3, 3, 4, 6, 2], [PAD, 1, 7, 7, 2, 9]])
    mask = (ids != PAD).long()
    free = target.generate(ids, attention_mask=mask, max_new_tokens=16, pad_token_id=PAD, do_sample=False)
    eos = int(free[0, ids.shape[1] + 3])
    kwargs = dict(attention_mask=mask, max_new_tokens=16, pad_token_id=PAD, do_sample=False, eos_token_id=eos)
    plain = target.generate(ids, **kwargs)
    mine = target.generate(ids, **kwargs, draft_model=draft, speculative_config=COMPILE, num_lookahead=2)
    assert mine.tolist() == plain.tolist()


def test_compiled_inputs_are_fresh_row_major_tensors():
    """Dynamo guards on strides and on a view's base: a `(1, w)` slice of a wider row keeps the row's stride even
    through `.contiguous()`, and would compile (and freeze the weights) again where a fresh tensor was fed before."""
    from hf_specsample.cache.compiled import fresh_input as _fresh

    row = torch.arange(40)[None]
    view = row[:, -2:]
    assert view.contiguous().stride() == (40, 1)  # the trap
    fresh = _fresh(view)
    assert fresh.stride() == (2, 1) and fresh._base is None and fresh.tolist() == view.tolist()
    assert _fresh(None) is None


# --- The small-rows kernel inside compiled code (compile=True with linear_kernel="on") ----------------------------

KERNEL_COMPILED = SpeculativeConfig(compile=True, linear_kernel="on")
GEMM_COMPILED = SpeculativeConfig(compile=True, linear_kernel="off")  # inductor's frozen GEMM whatever the routing


@pytest.fixture(scope="module")
def bf16_pair():
    """A bf16 pair (the kernel serves CPU bf16 linears), compiled once for the tests that leave it alone."""
    target = tiny_lm(seed=0, vocab_size=16, layers=2, hidden=32, dtype=torch.bfloat16)
    return target, perturbed_copy(target, seed=1, scale=0.3)


def kernel_calls(function) -> int:
    """How many times the kernel's operator ran during `function()` (the profiler sees calls from compiled code)."""
    with torch.profiler.profile() as profile:
        function()
    return sum(event.count for event in profile.key_averages() if event.key == "hf_specsample::small_rows_linear")


@torch.no_grad()
def test_kernel_in_compiled_graph_greedy_equals_plain(built, light, bf16_pair):
    target, draft = bf16_pair
    settings = compiled.CompileSettings.for_device(torch.device("cpu"), kernel=True)
    assert settings.kernel_rows == 16 and not settings.freezes
    prompts = [PROMPT, torch.tensor([[3, 1, 4, 1, 5, 9]])]
    for prompt in prompts:
        plain = target.generate(prompt, max_new_tokens=16, pad_token_id=PAD, do_sample=False)
        out = target.generate(prompt, max_new_tokens=16, pad_token_id=PAD, do_sample=False, draft_model=draft,
                              speculative_config=KERNEL_COMPILED, return_dict_in_generate=True)  # fmt: skip
        assert out.sequences.tolist() == plain.tolist()
        assert out.speculative_stats.linear_kernel.startswith("target compiled, its linears of 1-16 rows on the kernel")
    assert compiled._COMPILED[target][settings].compilations == 1, "one graph: the warm-up, both prompts, every K"
    ids = torch.tensor([[PAD, PAD, 1, 5, 2, 5], [1, 3, 3, 4, 6, 2]])  # padded rows, 2 x (K+1) <= 16 rows
    kwargs = dict(attention_mask=(ids != PAD).long(), max_new_tokens=12, pad_token_id=PAD, do_sample=False)
    plain = target.generate(ids, **kwargs)
    mine = target.generate(ids, **kwargs, draft_model=draft, speculative_config=KERNEL_COMPILED)
    assert mine.tolist() == plain.tolist()
    forward = compiled._COMPILED[target][settings]
    assert forward.compilations == 2 and forward.warmed == {True, False}, "a graph per batch shape (one row, several)"
    # The rounds' linears run on the kernel inside compiled code. Prompt lookup runs no draft model, so every kernel
    # call is the target's; inductor's GEMM (compile=True with linear_kernel="off") makes none, so the count can tell.
    lookup = dict(draft_model="prompt_lookup", prompt_lookup_num_tokens=3)
    assert kernel_calls(lambda: greedy(target, **lookup, speculative_config=KERNEL_COMPILED)) > 0
    assert forward.compilations == 2
    assert kernel_calls(lambda: greedy(target, **lookup, speculative_config=GEMM_COMPILED)) == 0


@torch.no_grad()
def test_kernel_in_compiled_graph_samples_exactly(built, bf16_pair):
    """Rows x positions within the kernel's 16 rows, so the compiled rounds' linears are the kernel's."""
    from exact import chisquare_pvalue, continuations, exact_distribution
    from tiny import prepared_processors

    target, draft = bf16_pair
    settings = dict(temperature=0.9, top_k=5)
    generator = torch.Generator().manual_seed(11)
    samples = []
    for _ in range(300):  # 4 rows x 3 positions per round
        out = target.generate(PROMPT, do_sample=True, max_new_tokens=2, num_return_sequences=4, pad_token_id=PAD,
                              generator=generator, draft_model=draft, speculative_config=KERNEL_COMPILED,
                              num_lookahead=2, **settings)  # fmt: skip
        samples += continuations(out, PROMPT.shape[1])
    processors, _ = prepared_processors(target, PROMPT, do_sample=True, max_new_tokens=2, **settings)
    exact = exact_distribution(target, PROMPT, processors, 2)
    assert chisquare_pvalue(exact, samples) > 1e-3
    # power: the same samples against another model's distribution fail
    assert chisquare_pvalue(exact_distribution(draft, PROMPT, processors, 2), samples) < 1e-3


@pytest.mark.parametrize("config", [KERNEL_COMPILED, SpeculativeConfig(linear_kernel="on")], ids=["compiled", "eager"])
def test_kernel_on_refused_before_any_forward_where_it_cannot_serve(built, pair, config):
    """An fp32 target: linear_kernel="on" cannot be honoured, compiled or not; refused before any forward of either
    model (the draft's form timings and the calibration on a long prompt come later)."""
    target, draft = pair
    calls = []
    handles = [model.register_forward_pre_hook(lambda *args: calls.append(1)) for model in (target, draft)]
    prompt = torch.arange(1, 25).remainder(16)[None]  # long enough for AUTO to weigh the draft's forms on it
    try:
        with pytest.raises(ValueError, match="linear_kernel='on' cannot be honoured"):
            target.generate(prompt, max_new_tokens=4, pad_token_id=PAD, draft_model=draft, speculative_config=config)
    finally:
        for handle in handles:
            handle.remove()
    assert not calls


@torch.no_grad()
def test_kernel_in_compiled_graph_runs_wide_forwards_eagerly(built, light):
    """A forward the kernel does not serve (a 30-token prompt, 9 rows) runs eagerly instead of
    compiling a second graph in the middle of a call; greedy output stays plain generate()'s."""
    target = tiny_lm(seed=2, vocab_size=16, layers=2, hidden=32, dtype=torch.bfloat16)
    draft = perturbed_copy(target, seed=3, scale=0.3)
    settings = compiled.CompileSettings.for_device(torch.device("cpu"), kernel=True)
    prompt = torch.arange(3, 33).remainder(16)[None]
    plain = target.generate(prompt, max_new_tokens=16, pad_token_id=PAD, do_sample=False)
    mine = target.generate(prompt, max_new_tokens=16, pad_token_id=PAD, do_sample=False, draft_model=draft,
                           speculative_config=KERNEL_COMPILED)  # fmt: skip
    assert mine.tolist() == plain.tolist()
    forward = compiled._COMPILED[target][settings]
    assert forward.compilations == 1 and forward.serves(1, 16) and not forward.serves(1, 17)
    assert forward.serves(8, 1) and not forward.serves(9, 1)  # one position is fed as two
    rows = prompt.repeat(9, 1)  # 9 rows x 2 or more positions > 16 rows: all eager, nothing compiled for several rows
    out = target.generate(rows, max_new_tokens=8, pad_token_id=PAD, do_sample=False, draft_model=draft,
                          speculative_config=KERNEL_COMPILED, num_lookahead=5)  # fmt: skip
    assert out.tolist() == target.generate(rows, max_new_tokens=8, pad_token_id=PAD, do_sample=False).tolist()
    assert forward.compilations == 1


def test_auto_puts_the_kernel_in_the_graph_where_its_plan_serves_every_round():
    """compile=True under linear_kernel="auto": the kernel inside the graph only where the model's routing serves every
    forward of a round of this batch (one position runs as two), all within the kernel's 16 rows."""
    from hf_specsample.kernels.routing import KernelRouting
    from hf_specsample.options import LinearKernel
    from hf_specsample.plan.call_plan import _kernel_in_graph

    every = KernelRouting.every_round("timed")
    holed = KernelRouting(frozenset(range(1, 17)) - {6}, "timed")
    off = KernelRouting.off("off: fp32")
    assert _kernel_in_graph(every, LinearKernel.AUTO, batch=1, largest=9)
    assert _kernel_in_graph(every, LinearKernel.AUTO, batch=2, largest=8)
    assert not _kernel_in_graph(every, LinearKernel.AUTO, batch=2, largest=9), "18 rows: beyond the kernel"
    assert not _kernel_in_graph(holed, LinearKernel.AUTO, batch=1, largest=9), "a round width it loses at"
    assert _kernel_in_graph(holed, LinearKernel.AUTO, batch=1, largest=5)
    assert not _kernel_in_graph(holed, LinearKernel.AUTO, batch=3, largest=2), "3 rows x 2 positions = 6"
    assert not _kernel_in_graph(off, LinearKernel.AUTO, batch=1, largest=2)
    assert not _kernel_in_graph(every, LinearKernel.OFF, batch=1, largest=2)
    assert _kernel_in_graph(off, LinearKernel.ON, batch=1, largest=2)  # "on" was refused before, if it cannot


@pytest.mark.parametrize("kernel_wins", [True, False], ids=["routing-on", "routing-off"])
@torch.no_grad()
def test_compile_auto_follows_the_kernel_plan(built, light, monkeypatch, kernel_wins):
    """compile=True alone on a CPU bf16 target: the kernel inside the graph where AUTO's timing put it on every round
    width, inductor's GEMM where it lost (the timing is replaced here, so both sides run on any machine); the stats
    say which. On the kernel, greedy output is plain generate()'s."""

    routing = KernelRouting.every_round("on (timed)") if kernel_wins else KernelRouting.off("off (timed)")
    monkeypatch.setattr(kernel_routing, "_timed_routing", lambda weight: routing)
    target = tiny_lm(seed=4, vocab_size=16, layers=2, hidden=32, dtype=torch.bfloat16)  # its own routing and graphs
    draft = perturbed_copy(target, seed=5, scale=0.3)
    plain = greedy(target)
    out = greedy(target, draft_model=draft, speculative_config=COMPILE, return_dict_in_generate=True)
    if kernel_wins:  # inductor's frozen bf16 GEMM rounds otherwise than eager F.linear: its greedy output may part
        assert out.sequences.tolist() == plain.tolist()  # from plain's at near-ties (this one at its 11th new token)
    stats = out.speculative_stats.linear_kernel
    expected = (
        "target compiled, its linears of 1-16 rows on the kernel: on (timed)" if kernel_wins else "target compiled;"
    )
    assert stats.startswith(expected), stats
    # Prompt lookup runs no draft model: every kernel call is the target's, and only the routing-on graph makes them.
    lookup = dict(draft_model="prompt_lookup", prompt_lookup_num_tokens=3, speculative_config=COMPILE)
    count = kernel_calls(lambda: greedy(target, **lookup))
    assert count > 0 if kernel_wins else count == 0
    if kernel_wins:  # two rows of lookup rounds of at most 3 + 1 positions: 8 rows (not max_lookahead's 2 x 9)
        ids = torch.tensor([[1, 5, 2, 5], [3, 1, 4, 1]])
        kwargs = dict(max_new_tokens=12, pad_token_id=PAD, do_sample=False)
        out = target.generate(ids, **kwargs, **lookup, return_dict_in_generate=True)
        assert out.speculative_stats.linear_kernel.startswith("target compiled, its linears of 1-16 rows on the kernel")
        assert out.sequences.tolist() == target.generate(ids, **kwargs).tolist()


def test_most_draft_tokens_a_round_verifies():
    from hf_specsample.policy.lookahead import DEFAULT_LOOKUP_TOKENS, largest_round

    def most_draft_tokens(config, lookup_tokens, lookup_only):
        return largest_round(config, lookup_tokens, lookup_only) - 1

    config = SpeculativeConfig()
    assert most_draft_tokens(config, 3, lookup_only=True) == 3
    assert most_draft_tokens(config, None, lookup_only=True) == DEFAULT_LOOKUP_TOKENS
    assert most_draft_tokens(SpeculativeConfig(num_lookahead=5), None, lookup_only=True) == 5
    assert most_draft_tokens(config, None, lookup_only=False) == config.max_lookahead
    assert most_draft_tokens(config, 12, lookup_only=False) == 12
    assert most_draft_tokens(SpeculativeConfig(num_lookahead=11), 3, lookup_only=False) == 11
    # a suffix drafter beside a model drafts chains as deep as its rounds: N, else DEFAULT_LOOKUP_TOKENS
    assert largest_round(config, None, False, suffix=True) - 1 == max(config.max_lookahead, DEFAULT_LOOKUP_TOKENS)
    assert largest_round(config, 3, False, suffix=True) - 1 == config.max_lookahead
    assert largest_round(config, 30, False, suffix=True) - 1 == 30
