"""A bitsandbytes 4-bit (nf4) target with a bfloat16 draft.

    pip install "hf-specsample[bnb]"
    python examples/quantized_target.py                        # Qwen2.5-Coder 1.5B target, 0.5B draft (Hub)
    python examples/quantized_target.py --target ./target --draft ./draft --greedy --compute-dtype float32

Runs on CUDA and, with bitsandbytes >= 0.45, on the CPU too (tested there on SmolLM2-135M and tiny models). Sampling
is exact with respect to the quantized target. Greedy output is the quantized target's own greedy output token for
token when its logits do not depend on how many positions a forward computes: 4-bit does that in float32
(--compute-dtype float32, what CI runs); in bfloat16 a near-tie may resolve differently, as it does for plain
generate() with another prompt chunking.
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

import hf_specsample  # noqa: F401  (adds draft_model= to generate())

parser = argparse.ArgumentParser(description="A 4-bit target with a bfloat16 draft.")
parser.add_argument("prompt", nargs="?", default="def quicksort(items):")
parser.add_argument("--target", default="Qwen/Qwen2.5-Coder-1.5B-Instruct")
parser.add_argument("--draft", default="Qwen/Qwen2.5-Coder-0.5B-Instruct")
parser.add_argument("--compute-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
parser.add_argument("--max-new-tokens", type=int, default=64)
parser.add_argument("--greedy", action="store_true", help="greedy decoding (default: sampling, T=0.7, top_p=0.95)")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

torch.manual_seed(args.seed)
tokenizer = AutoTokenizer.from_pretrained(args.target)
nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                         bnb_4bit_compute_dtype=getattr(torch, args.compute_dtype))  # fmt: skip
target = AutoModelForCausalLM.from_pretrained(args.target, quantization_config=nf4, device_map="auto")
draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=torch.bfloat16, device_map="auto")
sampling = dict(do_sample=False) if args.greedy else dict(do_sample=True, temperature=0.7, top_p=0.95)

inputs = tokenizer(args.prompt, return_tensors="pt").to(target.device)
out = target.generate(
    **inputs, draft_model=draft, max_new_tokens=args.max_new_tokens, return_dict_in_generate=True, **sampling
)
print(tokenizer.decode(out.sequences[0], skip_special_tokens=True))
print(f"stats: {out.speculative_stats}")
