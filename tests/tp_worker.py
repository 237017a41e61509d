"""Run by tests/test_tensor_parallel.py under torchrun: a tensor-parallel tiny target with a replicated draft."""

import json
import os
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, DistributedConfig

import hf_specsample  # noqa: F401

target_dir, draft_dir, out_path = sys.argv[1:4]
torch.set_num_threads(1)
target = AutoModelForCausalLM.from_pretrained(
    target_dir, distributed_config=DistributedConfig(tp_plan="auto"), dtype=torch.float32
)
draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32)  # replicated on every rank
rank = dist.get_rank()
torch.manual_seed(1000 + rank)  # different global RNG per rank: the loop must share draws itself
prompt = torch.tensor([[1, 5, 9, 17, 33], [1, 2, 3, 4, 5]])
greedy = target.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=0, draft_model=draft, num_lookahead=3)
sampled = target.generate(
    prompt,
    max_new_tokens=16,
    do_sample=True,
    top_k=20,
    pad_token_id=0,
    draft_model=draft,
    num_lookahead=3,
    return_dict_in_generate=True,
)
# Each rank prepares a different draft form: every rank must refuse before any round (not abort in a collective).
mismatched = hf_specsample.prepare_draft(draft, target, form="as_given" if rank == 0 else "dynamic_int8")
try:
    target.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0, draft_model=mismatched)
    refusal = None
except ValueError as error:
    refusal = str(error)
prepared = hf_specsample.prepare_draft(draft, target)  # AUTO: chosen without the clock for a sharded target
try:  # a draft made from the target's weights, which each rank holds in shards: refused on every rank alike
    target.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0, draft_model="auto")
    auto_refusal = None
except ValueError as error:
    auto_refusal = str(error)
result = {
    "rank": rank,
    "draft_form": sampled.speculative_stats.draft_form,
    "prepared_form": prepared.description,
    "refusal": refusal,
    "auto_refusal": auto_refusal,
    "tp_size": target.tp_size,
    "greedy": greedy.tolist(),
    "sampled": sampled.sequences.tolist(),
    "accepted": sampled.speculative_stats.accepted_tokens,
}
with open(f"{out_path}.{rank}", "w") as handle:
    json.dump(result, handle)
dist.barrier()  # no rank tears gloo down while a peer still uses it (see examples/tensor_parallel.py)
dist.destroy_process_group()
os._exit(0)  # no interpreter teardown for gloo's threads to abort (see examples/tensor_parallel.py)
