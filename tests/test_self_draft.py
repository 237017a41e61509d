"""Self-drafts: views of the target that share its weights."""

import copy

import pytest
import torch
from tiny import PAD, tiny_lm

from hf_specsample.prepare.self_draft import default_layers_to_keep, layer_skip_draft

PROMPT = torch.tensor([[1, 5, 6, 7, 8]])


@pytest.fixture()
def target():
    return tiny_lm(seed=0, vocab_size=64, layers=4, hidden=32, init_range=0.3)


def pruned_copy(model, keep):
    """Reference: a deep copy with the other layers deleted."""
    pruned = copy.deepcopy(model)
    pruned.model.layers = torch.nn.ModuleList(pruned.model.layers[i] for i in keep)
    for index, layer in enumerate(pruned.model.layers):
        layer.self_attn.layer_idx = index
    pruned.config.num_hidden_layers = len(keep)
    return pruned


def test_layer_skip_draft_equals_a_pruned_copy_and_shares_weights(target):
    before = target(PROMPT).logits
    draft = layer_skip_draft(target, [0, 1, 3])
    torch.testing.assert_close(draft(PROMPT).logits, pruned_copy(target, [0, 1, 3])(PROMPT).logits)
    assert draft.model.layers[2].mlp.up_proj.weight is target.model.layers[3].mlp.up_proj.weight
    assert sum(p.data_ptr() not in {q.data_ptr() for q in target.parameters()} for p in draft.parameters()) == 0
    # the target itself is untouched
    assert [layer.self_attn.layer_idx for layer in target.model.layers] == [0, 1, 2, 3]
    assert target.config.num_hidden_layers == 4
    torch.testing.assert_close(target(PROMPT).logits, before)


def test_layer_skip_draft_drafts_exactly(target):
    draft = layer_skip_draft(target, [0, 3])
    expected = target.generate(PROMPT, max_new_tokens=20, do_sample=False, pad_token_id=PAD)
    assert torch.equal(
        target.generate(PROMPT, max_new_tokens=20, do_sample=False, pad_token_id=PAD, draft_model=draft), expected
    )


def test_hooks_on_the_target_do_not_fire_for_the_draft(target):
    calls = []
    handle = target.register_forward_hook(lambda *args: calls.append(1))
    layer_handle = target.model.layers[0].register_forward_hook(lambda *args: calls.append(1))
    layer_skip_draft(target, [0, 2])(PROMPT)
    handle.remove(), layer_handle.remove()
    assert calls == []


@pytest.mark.parametrize("keep", [[], [4], [-1]])
def test_layer_skip_draft_rejects_bad_indices(target, keep):
    with pytest.raises(ValueError, match="keep must be"):
        layer_skip_draft(target, keep)


def test_default_layers_skip_the_middle_third():
    assert default_layers_to_keep(30) == [*range(12), *range(18, 30)]  # SmolLM2-135M: the best measured
    assert default_layers_to_keep(4) == [0, 2, 3]  # at least one layer skipped
    assert default_layers_to_keep(1) == [0]
