"""A tensor-parallel target (tp_plan="auto"), with the draft replicated on every rank; launched by torchrun:

    torchrun --nproc_per_node 2 examples/tensor_parallel.py                 # Qwen2.5-Coder 1.5B / 0.5B (Hub)
    torchrun --nproc_per_node 2 examples/tensor_parallel.py --target ./target --draft ./draft --greedy

transformers starts the process group itself (NCCL on GPUs, gloo on the CPU). Every rank must accept the same
tokens: the loop shares rank 0's random draws and verdicts, so each rank returns the same sequences. The target's
attention heads and key/value heads must divide by the number of ranks.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer, DistributedConfig

import hf_specsample  # noqa: F401  (adds draft_model= to generate())

parser = argparse.ArgumentParser(description="A tensor-parallel target under torchrun.")
parser.add_argument("prompt", nargs="?", default="def binary_search(items, value):")
parser.add_argument("--target", default="Qwen/Qwen2.5-Coder-1.5B-Instruct")
parser.add_argument("--draft", default="Qwen/Qwen2.5-Coder-0.5B-Instruct")
parser.add_argument("--max-new-tokens", type=int, default=64)
parser.add_argument("--greedy", action="store_true", help="greedy decoding (default: sampling, T=0.7, top_p=0.95)")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

torch.manual_seed(args.seed)
tokenizer = AutoTokenizer.from_pretrained(args.target)
sharded = DistributedConfig(tp_plan="auto")  # the model's own tensor-parallel plan, over all torchrun ranks
target = AutoModelForCausalLM.from_pretrained(args.target, dtype="auto", distributed_config=sharded)
draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype="auto").to(target.device)  # a full copy per rank
sampling = dict(do_sample=False) if args.greedy else dict(do_sample=True, temperature=0.7, top_p=0.95)

inputs = tokenizer(args.prompt, return_tensors="pt").to(target.device)
out = target.generate(
    **inputs, draft_model=draft, max_new_tokens=args.max_new_tokens, return_dict_in_generate=True, **sampling
)
if dist.get_rank() == 0:  # every rank holds the same output
    print(tokenizer.decode(out.sequences[0], skip_special_tokens=True))
    print(f"stats (target sharded over {target.tp_size} ranks): {out.speculative_stats}")
dist.barrier()  # no rank tears gloo down while a peer still uses it
dist.destroy_process_group()
# Leave without the interpreter's teardown: a gloo worker thread still releasing a finished collective's tensors then
# can abort the process ("terminate called without an active exception", about one run in 10-40 on a loaded CPU;
# the mechanism: pytorch/pytorch#179291, an unmerged fix that only destroys the groups at exit, as done above).
# Everything is printed and every group destroyed by now.
sys.stdout.flush()
os._exit(0)
