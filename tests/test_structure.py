"""How many places a reader visits to follow one call (`tools/count_calls.py`): issue 53's goals, a chain call
entering at most 20 library files and 170 functions, a tree call at most 2 files and 25 functions more.

Measured on tiny models, 8 new tokens, in a fresh process (comprehensions counted with their function): a chain call 36
files and 241 functions greedy, 37 / 270 sampling (not met; 35 / 251 greedy when the issue was filed; the drafter's
`observe` / `finished` hooks added 5); a tree call 38 / 261 greedy and 39 / 279 sampling (met: at most +2 files and
+20 functions). The goal not met is marked
`xfail(strict=True)`, so the day it is met its test fails until the mark comes off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TOOLS = Path(__file__).resolve().parents[1] / "tools"
sys.path.insert(0, str(TOOLS))

import count_calls  # noqa: E402 (tools/ is not a package)

from hf_specsample.prepare import self_draft  # noqa: E402

CHAIN_FILES, CHAIN_FUNCTIONS = 20, 170  # the goals for a chain call
TREE_EXTRA_FILES, TREE_EXTRA_FUNCTIONS = 2, 25  # what a tree call may enter beyond a chain call


@pytest.fixture(scope="module")
def pair():
    return count_calls.tiny_pair()


@pytest.fixture(scope="module")
def counts() -> dict[str, tuple[int, int]]:
    """`tools/count_calls.py`'s table, from a fresh process (what a call enters depends on what ran before it)."""
    done = subprocess.run(
        [sys.executable, str(TOOLS / "count_calls.py"), "--json"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(TOOLS.parent)},
    )
    return {key: (files, functions) for key, (files, functions) in json.loads(done.stdout.splitlines()[-1]).items()}


@pytest.mark.xfail(strict=True, reason="36-37 files and 241-270 functions today (issue 53's goal: 20 and 170)")
@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampling"])
def test_a_chain_call_enters_few_places(counts, do_sample):
    files, functions = counts[f"{'sampling' if do_sample else 'greedy'} chain"]
    assert files <= CHAIN_FILES and functions <= CHAIN_FUNCTIONS, (files, functions)


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampling"])
def test_a_tree_call_enters_little_more_than_a_chain_call(counts, do_sample):
    mode = "sampling" if do_sample else "greedy"
    chain, tree = counts[f"{mode} chain"], counts[f"{mode} tree"]
    assert tree[0] - chain[0] <= TREE_EXTRA_FILES and tree[1] - chain[1] <= TREE_EXTRA_FUNCTIONS, (chain, tree)


def test_the_counter_counts_what_a_call_enters(pair):
    """The power check: a call that also enters one library function of a file the call does not enter counts one
    file and one function more; a call that enters nothing of the library counts nothing."""
    call = count_calls.call_of(*pair, False, "chain")
    files, functions = count_calls.count_calls(call)
    assert files > 10 and functions > 100

    def call_and_one_more():
        call()
        self_draft.default_layers_to_keep(12)  # prepare/self_draft.py: a layer-skipping draft's, not this call's

    assert count_calls.count_calls(call_and_one_more) == (files + 1, functions + 1)
    assert count_calls.count_calls(lambda: torch.zeros(3).sum()) == (0, 0)
