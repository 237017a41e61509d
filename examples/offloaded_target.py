"""A target too large for its devices: accelerate's device_map="auto" puts what max_memory allows on the GPUs, then
the CPU, and the rest on disk (offload_folder). The draft runs wherever it fits.

    python examples/offloaded_target.py                        # Qwen2.5-Coder 1.5B target, 0.5B draft (Hub)
    python examples/offloaded_target.py --target ./target --draft ./draft --cpu-memory 200MB --greedy

Offloaded weights are streamed in for every forward pass, so a target forward is expensive and scoring K+1 draft
tokens in one pass saves the most here.
"""

import argparse
import collections

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_specsample  # noqa: F401  (adds draft_model= to generate())

parser = argparse.ArgumentParser(description="A target offloaded to CPU and disk with device_map='auto'.")
parser.add_argument("prompt", nargs="?", default="def merge_sorted(a, b):")
parser.add_argument("--target", default="Qwen/Qwen2.5-Coder-1.5B-Instruct")
parser.add_argument("--draft", default="Qwen/Qwen2.5-Coder-0.5B-Instruct")
parser.add_argument("--gpu-memory", default="1GiB", help="per GPU, if any")
parser.add_argument("--cpu-memory", default="1GiB", help="what does not fit goes to --offload-folder")
parser.add_argument("--offload-folder", default="offload")
parser.add_argument("--max-new-tokens", type=int, default=64)
parser.add_argument("--greedy", action="store_true", help="greedy decoding (default: sampling, T=0.7, top_p=0.95)")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

torch.manual_seed(args.seed)
tokenizer = AutoTokenizer.from_pretrained(args.target)
max_memory = {gpu: args.gpu_memory for gpu in range(torch.cuda.device_count())} | {"cpu": args.cpu_memory}
target = AutoModelForCausalLM.from_pretrained(
    args.target, dtype="auto", device_map="auto", max_memory=max_memory, offload_folder=args.offload_folder
)
draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype="auto", device_map="auto")
placement = getattr(target, "hf_device_map", {"": str(target.device)})  # absent when it all fits on one device
print("target modules per device:", dict(collections.Counter(placement.values())))
sampling = dict(do_sample=False) if args.greedy else dict(do_sample=True, temperature=0.7, top_p=0.95)

inputs = tokenizer(args.prompt, return_tensors="pt")  # may stay on the CPU: accelerate moves them
out = target.generate(
    **inputs, draft_model=draft, max_new_tokens=args.max_new_tokens, return_dict_in_generate=True, **sampling
)
print(tokenizer.decode(out.sequences[0], skip_special_tokens=True))
print(f"stats: {out.speculative_stats}")
