"""accelerate-dispatched targets: layers spread by device_map, CPU and disk offload, drafts on other devices.

CPU and disk offload run here and exercise the same code paths as multi-GPU maps (accelerate hooks, weights on the
meta device, logits and caches on the layers' devices). The CUDA variants skip without GPUs.
"""

import pytest
import torch
from tiny import PAD, perturbed_copy, tiny_lm
from transformers import AutoModelForCausalLM

from hf_specsample.core.model_facts import input_device
from hf_specsample.prepare.self_draft import layer_skip_draft

PROMPTS = torch.tensor([[0, 0, 1, 5, 9, 17], [1, 2, 3, 4, 5, 6]])
MASK = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
SPREAD = {  # every other module offloaded to disk, the rest on the CPU
    "model.embed_tokens": "disk", "model.rotary_emb": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
    "model.layers.2": "cpu", "model.layers.3": "disk", "model.norm": "cpu", "lm_head": "disk",
}  # fmt: skip


@pytest.fixture(scope="module")
def reference():
    return tiny_lm(seed=0, vocab_size=64, layers=4, hidden=64, init_range=0.3)


@pytest.fixture(scope="module")
def folder(reference, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    reference.save_pretrained(path)
    return path


def dispatched(folder, tmp_path, device_map, **kwargs):
    return AutoModelForCausalLM.from_pretrained(
        folder, device_map=device_map, offload_folder=str(tmp_path / "offload"), dtype=torch.float32, **kwargs
    ).eval()


def greedy(model, **kwargs):
    return model.generate(PROMPTS, attention_mask=MASK, do_sample=False, max_new_tokens=16, pad_token_id=PAD, **kwargs)


@pytest.mark.parametrize(
    "device_map, extra",
    [(SPREAD, {}), ("auto", {"max_memory": {"cpu": "60KB"}})],  # auto with too little memory: offloads to disk
    ids=["explicit-cpu-disk", "auto-max-memory"],
)
def test_offloaded_target_greedy_and_sampling(reference, folder, tmp_path, device_map, extra):
    target = dispatched(folder, tmp_path, device_map, **extra)
    assert "disk" in target.hf_device_map.values()
    assert target.get_input_embeddings().weight.device.type == "meta" or device_map != SPREAD
    assert input_device(target).type == "cpu"
    draft = perturbed_copy(reference, seed=1, scale=0.1)  # on the CPU, not dispatched
    expected = greedy(reference)
    assert torch.equal(greedy(target, draft_model=draft, num_lookahead=3), expected)
    sampled = target.generate(
        PROMPTS, attention_mask=MASK, do_sample=True, max_new_tokens=16, pad_token_id=PAD, draft_model=draft,
        return_dict_in_generate=True,
    )  # fmt: skip
    assert sampled.sequences.shape == (2, PROMPTS.shape[1] + 16)


def test_layer_skip_draft_of_an_offloaded_target(reference, folder, tmp_path):
    target = dispatched(folder, tmp_path, SPREAD)
    draft = layer_skip_draft(target, [0, 1, 3])
    torch.testing.assert_close(draft(PROMPTS).logits, layer_skip_draft(reference, [0, 1, 3])(PROMPTS).logits)
    torch.testing.assert_close(target(PROMPTS).logits, reference(PROMPTS).logits)  # the target still runs all layers
    assert torch.equal(greedy(target, draft_model=draft), greedy(reference))


def test_offloaded_draft(reference, folder, tmp_path):
    draft = dispatched(folder, tmp_path, SPREAD)
    assert torch.equal(greedy(reference, draft_model=draft, num_lookahead=4), greedy(reference))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_target_on_gpu_draft_on_cpu_inputs_on_cpu(reference, folder, tmp_path):
    target = dispatched(folder, tmp_path, "cuda:0")
    draft = perturbed_copy(reference, seed=1, scale=0.1)
    assert torch.equal(greedy(target, draft_model=draft).cpu(), greedy(target).cpu())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("draft_device", ["cuda:0", "cuda:1"])
def test_target_split_over_two_gpus(reference, folder, tmp_path, draft_device):
    split = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 0,
             "model.layers.2": 1, "model.layers.3": 1, "model.norm": 1, "lm_head": 1}  # fmt: skip
    target = dispatched(folder, tmp_path, split)
    draft = perturbed_copy(reference, seed=1, scale=0.1).to(draft_device)
    assert torch.equal(greedy(target, draft_model=draft).cpu(), greedy(target).cpu())
