"""The choice between graphs and eager forwards (`graph_choice.choose_graphs`): the device, then the caller's ask."""

import torch
from tiny import PAD, perturbed_copy, tiny_lm

from hf_specsample import SpeculativeConfig
from hf_specsample.cache.runner import RunnerBackend
from hf_specsample.policy.graph_choice import choose_graphs

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def test_the_device_and_the_callers_ask_come_first():
    cpu = choose_graphs(CPU, True)
    assert cpu.backend is None and "CUDA device" in cpu.reason and "cpu" in cpu.reason
    asked = choose_graphs(CUDA, True)
    assert asked.backend is RunnerBackend.COMPILED and "compile=True" in asked.reason
    not_asked = choose_graphs(CUDA, False)
    assert not_asked.backend is None and "compile=True" in not_asked.reason


@torch.no_grad()
def test_the_choice_and_its_reason_are_in_the_stats():
    target = tiny_lm(seed=0, vocab_size=16, layers=1, hidden=32)
    draft = perturbed_copy(target, seed=1, scale=0.3)
    out = target.generate(torch.tensor([[1, 5, 2]]), max_new_tokens=4, pad_token_id=PAD, do_sample=False,
                          draft_model=draft, speculative_config=SpeculativeConfig(num_lookahead=2),
                          return_dict_in_generate=True)  # fmt: skip
    assert out.speculative_stats.graphs == "eager: CUDA graphs need a CUDA device (this call runs on cpu)"
