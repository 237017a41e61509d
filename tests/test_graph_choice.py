"""The choice between graphs and eager forwards (`graph_choice.choose_graphs`), with injected timings: no clock."""

import torch
from tiny import PAD, perturbed_copy, tiny_lm

from hf_specsample import SpeculativeConfig
from hf_specsample.cache.runner import RunnerBackend
from hf_specsample.graph_choice import GraphTimings, choose_graphs

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def timings(capture: float, rounds: int, eager_ms: float = 20.0, graph_ms: float = 5.0) -> GraphTimings:
    return GraphTimings(capture, eager_ms / 1e3, graph_ms / 1e3, rounds)


def test_graphs_where_the_rounds_pay_for_the_capture():
    long_call = choose_graphs(CUDA, False, timings(capture=10.0, rounds=1000))  # 15 s saved against 10 s
    assert long_call.backend is RunnerBackend.COMPILED and long_call.reason.startswith("graphs: 1000 rounds")
    short_call = choose_graphs(CUDA, False, timings(capture=10.0, rounds=100))  # 1.5 s saved against 10 s
    assert short_call.backend is None and short_call.reason.startswith("eager: 100 rounds")
    assert "1.50 s saved against 10.00 s of capture" in short_call.reason


def test_kept_runners_cost_nothing_to_capture():
    """A later call served by the runners kept with a pooled cache: any saving pays."""
    assert choose_graphs(CUDA, False, timings(capture=0.0, rounds=3)).backend is RunnerBackend.COMPILED
    assert choose_graphs(CUDA, False, timings(capture=0.0, rounds=3, graph_ms=25.0)).backend is None, "slower graphs"


def test_the_device_and_the_callers_ask_come_first():
    cpu = choose_graphs(CPU, True, timings(capture=0.0, rounds=10**6))
    assert cpu.backend is None and "CUDA device" in cpu.reason and "cpu" in cpu.reason
    asked = choose_graphs(CUDA, True, timings(capture=1e6, rounds=1))
    assert asked.backend is RunnerBackend.COMPILED and "compile=True" in asked.reason
    untimed = choose_graphs(CUDA, False, None)
    assert untimed.backend is None and untimed.reason.startswith("eager: no graph timing")


@torch.no_grad()
def test_the_choice_and_its_reason_are_in_the_stats():
    target = tiny_lm(seed=0, vocab_size=16, layers=1, hidden=32)
    draft = perturbed_copy(target, seed=1, scale=0.3)
    out = target.generate(torch.tensor([[1, 5, 2]]), max_new_tokens=4, pad_token_id=PAD, do_sample=False,
                          draft_model=draft, speculative_config=SpeculativeConfig(num_lookahead=2),
                          return_dict_in_generate=True)  # fmt: skip
    assert out.speculative_stats.graphs == "eager: CUDA graphs need a CUDA device (this call runs on cpu)"
