"""The repository's `custom_generate/` folder, loaded by transformers from this checkout's path as it loads a Hub
repository's: `model.generate(..., custom_generate=<path>, trust_remote_code=True, draft_model=...)`."""

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny import PAD
from transformers import GenerationMixin

from hf_specsample import SpeculativeDecoderOnlyOutput

REPO = Path(__file__).resolve().parent.parent
PROMPT = torch.tensor([[1, 5, 9, 17, 33], [1, 2, 3, 4, 5]])

try:  # transformers checks custom_generate/requirements.txt against the installed distributions
    importlib.metadata.version("hf-specsample")
except importlib.metadata.PackageNotFoundError:
    pytest.skip(
        "custom_generate/requirements.txt needs hf-specsample installed (pip install -e .)", allow_module_level=True
    )


@pytest.fixture
def loads(monkeypatch):
    """The repositories transformers loads a `custom_generate` method from, in call order."""
    loaded, original = [], GenerationMixin.load_custom_generate

    def spy(self, repository, *args, **kwargs):
        loaded.append(repository)
        return original(self, repository, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "load_custom_generate", spy)
    return loaded


def from_folder(model, *args, **kwargs):
    return model.generate(*args, custom_generate=str(REPO), trust_remote_code=True, **kwargs)


def test_greedy_equals_plain_generate(target, draft, loads):
    expected = target.generate(PROMPT, do_sample=False, max_new_tokens=20, pad_token_id=PAD)
    for lookahead in (1, 4):
        got = from_folder(target, PROMPT, draft_model=draft, num_lookahead=lookahead, do_sample=False,
                          max_new_tokens=20, pad_token_id=PAD)  # fmt: skip
        assert torch.equal(got, expected)
    # Each call ran the folder's method: hf_specsample's registered generate() (imported here) leaves a call that
    # names another custom_generate alone.
    assert loads == [str(REPO), str(REPO)]


def test_sampling_returns_speculative_statistics_and_repeats_with_a_generator(target, draft, loads):
    def sample():
        return from_folder(target, PROMPT, draft_model=draft, num_lookahead=3, do_sample=True, top_k=20,
                           max_new_tokens=16, pad_token_id=PAD, return_dict_in_generate=True,
                           generator=torch.Generator().manual_seed(7))  # fmt: skip

    first, second = sample(), sample()
    assert isinstance(first, SpeculativeDecoderOnlyOutput)
    stats = first.speculative_stats
    assert stats.row_new_tokens == [16, 16]  # one entry per row
    assert stats.draft_tokens > 0 and stats.target_forward_passes < 16
    assert torch.equal(first.sequences, second.sequences)
    assert len(loads) == 2


def test_without_a_draft_model_the_error_says_what_to_pass(target):
    with pytest.raises(ValueError, match="pass `draft_model=`"):
        from_folder(target, PROMPT, do_sample=True, max_new_tokens=4, pad_token_id=PAD)


def test_arguments_are_still_validated(target, draft):
    with pytest.raises(ValueError, match="num_lookahed"):  # a typo is not swallowed by the folder's **kwargs
        from_folder(target, PROMPT, draft_model=draft, num_lookahed=3, max_new_tokens=4, pad_token_id=PAD)
    with pytest.raises(ValueError, match="num_lookahead"):
        from_folder(target, PROMPT, draft_model=draft, num_lookahead=0, max_new_tokens=4, pad_token_id=PAD)


def test_another_custom_generate_callable_gets_draft_model(target, draft):
    """Was: the registered generate() replaced any `custom_generate=` by its own loop when `draft_model=` was given,
    so a caller's own method (or a repository's, this one's included after its first load) was silently skipped."""
    received = {}

    def own_method(model, input_ids, logits_processor, stopping_criteria, generation_config, draft_model=None, **kw):
        received["draft_model"] = draft_model
        return input_ids

    out = target.generate(PROMPT, custom_generate=own_method, draft_model=draft, max_new_tokens=4, pad_token_id=PAD)
    assert received["draft_model"] is draft
    assert torch.equal(out, PROMPT)


def test_works_without_importing_hf_specsample(tmp_path):
    """What a Hub user runs: no `import hf_specsample` anywhere in their code."""
    from tiny import perturbed_copy, tiny_lm

    target = tiny_lm(seed=0, vocab_size=64, layers=2, hidden=32, init_range=0.3)
    target.save_pretrained(tmp_path / "target")
    perturbed_copy(target, seed=1, scale=0.1).save_pretrained(tmp_path / "draft")
    expected = target.generate(PROMPT, do_sample=False, max_new_tokens=12, pad_token_id=PAD)
    script = f"""
import sys, torch
from transformers import AutoModelForCausalLM
target = AutoModelForCausalLM.from_pretrained({str(tmp_path / "target")!r})
draft = AutoModelForCausalLM.from_pretrained({str(tmp_path / "draft")!r})
assert "hf_specsample" not in sys.modules
prompt = torch.tensor({PROMPT.tolist()})
out = target.generate(prompt, custom_generate={str(REPO)!r}, trust_remote_code=True, draft_model=draft,
                      num_lookahead=2, do_sample=False, max_new_tokens=12, pad_token_id={PAD},
                      return_dict_in_generate=True)
print(out.sequences.tolist(), out.speculative_stats.row_new_tokens)
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert completed.stdout.strip() == f"{expected.tolist()} [12, 12]"
