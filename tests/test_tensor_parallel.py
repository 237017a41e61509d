"""A tensor-parallel target (transformers' tp_plan="auto", torchrun, gloo on CPU) with a replicated draft."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from tiny import PAD, tiny_llama

WORKER = os.path.join(os.path.dirname(__file__), "tp_worker.py")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tp_ready_llama(seed: int, layers: int):
    """Heads (4) and KV heads (2) divisible by 2 ranks."""
    return tiny_llama(seed, vocab_size=64, layers=layers, hidden=64, heads=4, kv_heads=2, eos_token_id=None)


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="needs torchrun")
def test_two_ranks_accept_the_same_tokens(tmp_path):
    target, draft = tp_ready_llama(0, 2), tp_ready_llama(1, 1)
    target.save_pretrained(tmp_path / "target")
    draft.save_pretrained(tmp_path / "draft")
    out = tmp_path / "result"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", WORKER,
               str(tmp_path / "target"), str(tmp_path / "draft"), str(out)]  # fmt: skip
    # The workers import this checkout, installed or not.
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
    }
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert completed.returncode == 0, completed.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"result.{rank}").read_text()) for rank in (0, 1)]
    assert all(result["tp_size"] == 2 for result in ranks)
    assert ranks[0]["sampled"] == ranks[1]["sampled"]  # despite different global seeds per rank
    assert ranks[0]["greedy"] == ranks[1]["greedy"]
    # The draft's form is chosen without the clock (timings differ between processes), the same on every rank.
    assert ranks[0]["draft_form"] == ranks[1]["draft_form"]
    assert "chosen without the clock" in ranks[0]["draft_form"]
    assert ranks[0]["prepared_form"] == ranks[1]["prepared_form"]
    assert "chosen without the clock" in ranks[0]["prepared_form"]
    # Drafts prepared differently per rank: refused on every rank, with what to do.
    assert all("ranks run different drafts" in (result["refusal"] or "") for result in ranks)
    assert all("holds in shards" in (result["auto_refusal"] or "") for result in ranks)
    prompt = torch.tensor([[1, 5, 9, 17, 33], [1, 2, 3, 4, 5]])
    expected = target.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=PAD)
    assert ranks[0]["greedy"] == expected.tolist()  # the sharded target's greedy output is the model's own
