"""Runners (`cache/runner.py`): fixed-shape forwards through static buffers, padded, exact, on every backend the CPU
has; and through the decoding loop (a static draft cache under `compile=True`, a target forced onto runners)."""

import pytest
import torch
from exact import sampled_pvalue
from tiny import PAD, arch_draft, perturbed_copy, tiny_arch, tiny_lm, with_cache
from transformers import StaticCache

import hf_specsample.cache.compiled as compiled
from hf_specsample import SpeculativeConfig
from hf_specsample.cache import row_ops
from hf_specsample.cache.cached_model import CachedModel
from hf_specsample.cache.forwards import Forwards
from hf_specsample.cache.runner import ForwardRunner, RunnerBackend, RunnerPlan
from hf_specsample.core.model_facts import ModelFacts
from hf_specsample.core.transformers_api import CACHE
from hf_specsample.plan import call_plan as plan
from hf_specsample.policy.graph_choice import GraphChoice

PROMPT = torch.tensor([[1, 5, 2, 5], [3, 7, 2, 6]])
CAPACITY = 16


@pytest.fixture
def light(monkeypatch):
    """Frozen weights without max-autotune (seconds instead of minutes), as `tests/test_compiled.py`."""
    monkeypatch.setattr(compiled, "CPU_INDUCTOR_OPTIONS", (("freezing", True),))


@pytest.fixture(scope="module")
def model():
    return tiny_lm(seed=0, vocab_size=16, layers=2, hidden=32)


def prefilled(model) -> StaticCache:
    cache = StaticCache(config=model.config, max_cache_len=CAPACITY)
    mask = torch.zeros((2, CAPACITY), dtype=torch.long)
    mask[:, :4] = 1
    model(input_ids=PROMPT, attention_mask=mask, **with_cache(cache))
    return cache


def runner(model, cache, width=4, backend=RunnerBackend.EAGER) -> ForwardRunner:
    return ForwardRunner(model, CAPACITY, 2, width, backend, CACHE, True, torch.device("cpu"))


def unpadded(model, cache, ids, slots) -> torch.Tensor:
    """The plain eager forward of `ids` after `slots - width` slots, masked over every slot."""
    mask = torch.zeros((2, CAPACITY), dtype=torch.long)
    mask[:, :slots] = 1
    width = ids.shape[1]
    positions = torch.arange(slots - width, slots).repeat(2, 1)
    return model(input_ids=ids, attention_mask=mask, position_ids=positions, **with_cache(cache)).logits.float()


@torch.no_grad()
def test_padded_verification_equals_unpadded_at_valid_positions(model):
    padded_cache, plain_cache = prefilled(model), prefilled(model)
    run = runner(model, padded_cache)
    for width in (1, 2, 3, 4):
        slots = row_ops.total_slots(plain_cache) + width
        ids = torch.randint(0, 16, (2, width), generator=torch.Generator().manual_seed(width))
        positions = torch.arange(slots - width, slots).repeat(2, 1)
        logits = run.run(padded_cache, ids, positions, torch.ones((2, slots), dtype=torch.bool))
        expected = unpadded(model, plain_cache, ids, slots)
        assert logits.shape == expected.shape
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)  # rounding of a longer GEMM
        assert row_ops.total_slots(padded_cache) == slots, "the padded positions are rolled back by position"
        for padded_layer, plain_layer in zip(padded_cache.layers, plain_cache.layers):
            torch.testing.assert_close(
                padded_layer.keys[:, :, :slots], plain_layer.keys[:, :, :slots], rtol=1e-4, atol=1e-4
            )


@torch.no_grad()
def test_a_runner_serves_the_rows_left_after_others_finished(model):
    """A cache whose first row finished (`select_rows` keeps the storage) runs on the runner of both rows: the row
    left gets the logits and keys an unpadded forward of that row alone gives, and the cache still holds one row."""
    padded_cache, plain_cache = prefilled(model), prefilled(model)
    row_ops.select_rows(padded_cache, torch.tensor([1]))
    plain_cache = row_ops.copy_rows(plain_cache, [1])
    run = runner(model, padded_cache)
    for width in (1, 3, 4):
        slots = row_ops.total_slots(plain_cache) + width
        ids = torch.randint(0, 16, (1, width), generator=torch.Generator().manual_seed(width))
        positions = torch.arange(slots - width, slots)[None]
        logits = run.run(padded_cache, ids, positions, torch.ones((1, slots), dtype=torch.bool))
        mask = torch.zeros((1, CAPACITY), dtype=torch.long)
        mask[:, :slots] = 1
        expected = model(input_ids=ids, attention_mask=mask, position_ids=positions, **with_cache(plain_cache))
        assert logits.shape == (1, width, 16)
        torch.testing.assert_close(logits, expected.logits.float(), rtol=1e-4, atol=1e-4)
        assert row_ops.total_slots(padded_cache) == slots
        for padded_layer, plain_layer in zip(padded_cache.layers, plain_cache.layers):
            assert padded_layer.keys.shape[0] == padded_layer.batch_size == 1, "the cache holds the row left"
            torch.testing.assert_close(
                padded_layer.keys[:, :, :slots], plain_layer.keys[:, :, :slots], rtol=1e-4, atol=1e-4
            )


@torch.no_grad()
def test_a_second_run_leaves_the_first_outputs_and_the_buffers_in_place(model):
    cache = prefilled(model)
    run = runner(model, cache)
    buffers = [tensor.data_ptr() for tensor in (run.input_ids, run.position_ids, run.attention_mask)]
    keys = [layer.keys.data_ptr() for layer in cache.layers]
    first = run.run(
        cache, torch.tensor([[1, 2], [3, 4]]), torch.tensor([[4, 5], [4, 5]]), torch.ones((2, 6), dtype=bool)
    )
    kept = first.clone()
    row_ops.crop(cache, 2)
    second = run.run(
        cache, torch.tensor([[9, 8, 7], [6, 5, 4]]), torch.tensor([[4, 5, 6]] * 2), torch.ones((2, 7), dtype=bool)
    )
    assert torch.equal(first, kept) and not torch.equal(first, second[:, :2])
    assert [tensor.data_ptr() for tensor in (run.input_ids, run.position_ids, run.attention_mask)] == buffers
    assert [layer.keys.data_ptr() for layer in cache.layers] == keys


def test_runner_sizes():
    sizes = RunnerPlan(RunnerBackend.EAGER, (1, 2, 5))
    assert [sizes.size_for(width) for width in (1, 2, 3, 5, 6)] == [1, 2, 5, 5, None]


def target_on_runners(monkeypatch, backend: RunnerBackend):
    """The plan's target forwards, compile=True, with every round on one runner of the largest round's size."""
    original = plan._target_forwards

    def forwards(inputs, target, kernel, largest, graphs=None):
        cache, chosen, description, pooled = original(inputs, target, kernel, largest, graphs)
        runner_plan = RunnerPlan(backend, (largest,))
        return cache, Forwards(kernel=chosen.kernel, runner=runner_plan, largest_round=largest), description, pooled

    monkeypatch.setattr(plan, "_target_forwards", forwards)


@pytest.fixture(scope="module")
def pair():
    target = tiny_lm(seed=0, vocab_size=16, layers=2, hidden=32)
    return target, perturbed_copy(target, seed=1, scale=0.3)


def counted_runs(monkeypatch) -> list[tuple[int, int]]:
    shapes = []
    original = ForwardRunner.run

    def run(self, cache, input_ids, position_ids, slot_is_real):
        shapes.append((self.width, input_ids.shape[1]))
        return original(self, cache, input_ids, position_ids, slot_is_real)

    monkeypatch.setattr(ForwardRunner, "run", run)
    return shapes


COMPILE = SpeculativeConfig(compile=True, num_lookahead=3)


@torch.no_grad()
def test_eager_runners_greedy_equal_plain_on_a_ragged_batch(monkeypatch, pair):
    """Both models' rounds through eager runners: the draft's steps (its static cache under compile=True) and the
    target's verification padded to the largest round."""
    target, draft = pair
    target_on_runners(monkeypatch, RunnerBackend.EAGER)
    shapes = counted_runs(monkeypatch)
    prompt = torch.tensor([[1, 5, 2, 5, 3], [PAD, PAD, 3, 7, 2]])
    mask = (prompt != PAD).long()
    kwargs = dict(attention_mask=mask, max_new_tokens=14, pad_token_id=PAD, do_sample=False)
    out = target.generate(prompt, draft_model=draft, speculative_config=COMPILE, **kwargs)
    assert out.tolist() == target.generate(prompt, **kwargs).tolist()
    largest = max(width for width, _ in shapes)
    assert any(valid < width == largest for width, valid in shapes), "rounds shorter than the largest, padded"
    assert {width for width, _ in shapes} >= {1, largest}, "the draft's steps and the target's rounds"


@torch.no_grad()
def test_eager_runners_sample_exactly(monkeypatch, pair):
    target, draft = pair
    target_on_runners(monkeypatch, RunnerBackend.EAGER)
    config = SpeculativeConfig(compile=True, num_lookahead=2)
    settings = dict(temperature=0.9, top_k=5)
    p_value = sampled_pvalue(target, PROMPT[:1], 3, 3000, seed=7, settings=settings, draft_model=draft,
                             speculative_config=config)  # fmt: skip
    assert p_value > 1e-3


@torch.no_grad()
def test_compiled_runners_compile_whole_graphs_once(monkeypatch, light, pair):
    """fullgraph=True, dynamic=False: no graph break, and no recompilation after the first run of each runner over a
    whole call with ragged rows (`error_on_recompile`); greedy output is plain's."""
    target, draft = pair
    target_on_runners(monkeypatch, RunnerBackend.COMPILED)
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    prompt = torch.tensor([[1, 5, 2, 5, 3], [PAD, PAD, 3, 7, 2]])
    mask = (prompt != PAD).long()
    kwargs = dict(attention_mask=mask, max_new_tokens=12, pad_token_id=PAD, do_sample=False)
    out = target.generate(prompt, draft_model=draft, speculative_config=COMPILE, **kwargs)
    assert out.tolist() == target.generate(prompt, **kwargs).tolist()


def test_the_cached_model_only_runs_a_static_cache_on_runners(model):
    facts = ModelFacts.of(model)
    plan_ = Forwards(runner=RunnerPlan(RunnerBackend.EAGER, (2,)))
    assert CachedModel(facts, 1, forwards=plan_).runner_plan is None  # a dynamic cache
    static = CachedModel(facts, 1, cache=StaticCache(config=model.config, max_cache_len=8), forwards=plan_)
    assert static.runner_plan is not None


@torch.no_grad()
def test_runners_are_kept_with_the_cache_for_the_next_call(monkeypatch, pair):
    """A second call gets the first call's caches back (`static_addresses.POOL`) and with them the same runners
    (the same buffers: a captured graph is not recorded again)."""
    target, draft = pair
    target_on_runners(monkeypatch, RunnerBackend.EAGER)
    calls: list[list[ForwardRunner]] = [[], []]
    original = ForwardRunner.run

    def run(self, cache, *args):
        calls[-1].append(self)
        return original(self, cache, *args)

    monkeypatch.setattr(ForwardRunner, "run", run)
    kwargs = dict(max_new_tokens=10, pad_token_id=PAD, do_sample=False, draft_model=draft, speculative_config=COMPILE)
    target.generate(PROMPT[:1], **kwargs)
    first, calls[:] = calls[0] + calls[1], [[]]
    target.generate(PROMPT[:1], **kwargs)
    assert calls[0] and all(any(runner is kept for kept in first) for runner in calls[0])


def ending_apart(target, prompt, mask) -> int:
    """An EOS id on which the rows of `prompt` stop at different rounds of plain greedy decoding (row 0 early)."""
    plain = target.generate(prompt, attention_mask=mask, max_new_tokens=14, pad_token_id=PAD, do_sample=False,
                            eos_token_id=None)  # fmt: skip
    first, second = plain[0, prompt.shape[1] :].tolist(), plain[1, prompt.shape[1] :].tolist()
    return next(token for token in first[4:8] if token != PAD and token not in second + first[:4])


@torch.no_grad()
def test_rows_that_finish_keep_the_caches_and_runners_of_the_full_batch(monkeypatch, light, pair):
    """A row that finishes leaves both static caches holding the same storage, the rows left run on the full
    batch's compiled runners (spare rows: no new shape is compiled), and the next call of the full batch gets those
    caches and their runners back: nothing compiles again; greedy output is plain's in both calls."""
    from torch._dynamo.utils import counters

    from hf_specsample.cache import static_addresses

    target, draft = pair
    graphs = GraphChoice(RunnerBackend.COMPILED, "as CUDA chooses under compile=True")  # both models' runners
    monkeypatch.setattr(plan, "choose_graphs", lambda device, compile_asked: graphs)
    prompt = torch.tensor([[1, 5, 2, 5, 3], [PAD, PAD, 3, 7, 2]])
    mask = (prompt != PAD).long()
    eos = ending_apart(target, prompt, mask)
    kwargs = dict(attention_mask=mask, max_new_tokens=14, pad_token_id=PAD, do_sample=False, eos_token_id=eos)
    plain = target.generate(prompt, **kwargs).tolist()
    # the draft as given, as on CUDA (AUTO's timed choice could take the CPU kernel's int8 form, not compiled here)
    config = SpeculativeConfig(compile=True, num_lookahead=3, draft_form="as_given")
    assert plain[0].index(eos) + 2 < len(plain[0]) and plain[0].count(PAD) > plain[1].count(PAD), "rows end apart"
    addresses: list[tuple[list[int], list[int]]] = []
    original = row_ops.select_rows

    def select_rows(cache, index):
        before = [layer.keys.data_ptr() for layer in row_ops.attention_layers(cache)]
        original(cache, index)
        addresses.append((before, [layer.keys.data_ptr() for layer in row_ops.attention_layers(cache)]))

    monkeypatch.setattr(row_ops, "select_rows", select_rows)
    spare = []  # per run: (runner width, whether it ran fewer rows than its runner holds)
    original_run = ForwardRunner.run

    def run(self, cache, input_ids, *args):
        spare.append((self.width, input_ids.shape[0] < self.rows))
        return original_run(self, cache, input_ids, *args)

    monkeypatch.setattr(ForwardRunner, "run", run)
    taken = []
    original_take = static_addresses.POOL.take
    monkeypatch.setattr(static_addresses.POOL, "take", lambda *args: taken.append(original_take(*args)) or taken[-1])
    assert target.generate(prompt, draft_model=draft, speculative_config=config, **kwargs).tolist() == plain
    compiled = counters["stats"]["unique_graphs"]
    assert compiled > 0, "the runners compiled before the first row finished"
    assert target.generate(prompt, draft_model=draft, speculative_config=config, **kwargs).tolist() == plain
    assert counters["stats"]["unique_graphs"] == compiled, "the second call compiled a graph"
    assert addresses and all(before == after for before, after in addresses), "a dropped row moved a cache"
    assert len(taken) == 4 and None not in taken[2:], "the second call runs on both caches of the first"
    widths = {width for width, fewer in spare if fewer}  # the draft's steps (1) and the target's verification (> 2)
    assert 1 in widths and max(widths) > 2, "the rows left ran on both models' full runners"
    assert not all(fewer for _, fewer in spare)


def test_selected_rows_keep_the_storage_and_come_back_for_the_next_call(model):
    cache = prefilled(model)
    layer = row_ops.attention_layers(cache)[0]
    pointer, second_row = layer.keys.data_ptr(), layer.keys[1].clone()
    row_ops.select_rows(cache, torch.tensor([1]))
    assert layer.keys.shape[0] == layer.batch_size == 1 and layer.keys.data_ptr() == pointer
    assert torch.equal(layer.keys[0], second_row)
    row_ops.restore_rows(cache)
    assert layer.keys.shape[0] == layer.batch_size == 2 and layer.keys.data_ptr() == pointer


@torch.no_grad()
def test_spare_rows_sample_exactly_as_rows_stop_apart(monkeypatch, light):
    """8,000 sampled rows in one call on both models' compiled runners, rows stopping at EOS in different rounds:
    the rows left run with spare rows in the finished rows' slots and follow the exact law (the spare rows' logits
    handed out instead of the rows left's fail it too). The power check: rows that finished leaving their slots
    where they were (the layers narrowed to the leading rows without moving the rows left there) read other rows'
    caches, and the same test fails."""
    target = tiny_arch("llama", seed=0, vocab_size=12)
    draft = arch_draft(target, seed=1, scale=0.6)
    graphs = GraphChoice(RunnerBackend.COMPILED, "as CUDA chooses under compile=True")
    monkeypatch.setattr(plan, "choose_graphs", lambda device, compile_asked: graphs)
    spare = []
    original_run = ForwardRunner.run

    def run(self, cache, input_ids, *args):
        spare.append(input_ids.shape[0] < self.rows)
        return original_run(self, cache, input_ids, *args)

    monkeypatch.setattr(ForwardRunner, "run", run)
    eos, settings = 7, dict(temperature=0.8, top_k=4, eos_token_id=7)
    config = SpeculativeConfig(compile=True, num_lookahead=2, draft_form="as_given")
    kwargs = dict(seed=3, settings=settings, eos_token_ids=(eos,), draft_model=draft, speculative_config=config)
    assert sampled_pvalue(target, PROMPT[:1], 3, 8000, **kwargs) > 1e-3
    assert any(spare), "rows that stopped early left spare rows"

    def unmoved(cache, index):  # narrowed to the leading rows, the rows left not moved there
        for layer in row_ops.attention_layers(cache):
            keys, values = row_ops._allocated(layer.keys), row_ops._allocated(layer.values)
            layer.keys, layer.values, layer.batch_size = keys[: len(index)], values[: len(index)], len(index)

    monkeypatch.setattr(row_ops, "select_rows", unmoved)
    assert sampled_pvalue(target, PROMPT[:1], 3, 8000, **kwargs) < 1e-3
