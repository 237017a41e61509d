"""pipeline("text-generation") with a draft model: draft_model= goes through the call like any generate() argument.

    python examples/pipeline.py                                # Qwen2.5-Coder 1.5B target, 0.5B draft (Hub)
    python examples/pipeline.py --target ./target --draft ./draft --greedy "Write a haiku about caches."

The pipeline returns text only, so the speculative statistics (out.speculative_stats of a direct generate() call)
do not reach you; this script counts the target's forward passes with a hook instead, with and without the draft
(plain decoding takes one per token; with --greedy both calls give the same text).
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

import hf_specsample  # noqa: F401  (adds draft_model= to generate())

parser = argparse.ArgumentParser(description="A text-generation pipeline with draft_model=.")
parser.add_argument("question", nargs="?", default="Write a Python function that checks whether a number is prime.")
parser.add_argument("--target", default="Qwen/Qwen2.5-Coder-1.5B-Instruct")
parser.add_argument("--draft", default="Qwen/Qwen2.5-Coder-0.5B-Instruct")
parser.add_argument("--max-new-tokens", type=int, default=128)
parser.add_argument("--num-lookahead", type=int, default=None, help="draft tokens per round (default: adaptive)")
parser.add_argument("--greedy", action="store_true", help="greedy decoding (default: sampling, T=0.7, top_p=0.95)")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

torch.manual_seed(args.seed)
tokenizer = AutoTokenizer.from_pretrained(args.target)
target = AutoModelForCausalLM.from_pretrained(args.target, dtype="auto")
draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype="auto")  # shares the target's tokenizer
generator = pipeline("text-generation", model=target, tokenizer=tokenizer)
sampling = dict(do_sample=False) if args.greedy else dict(do_sample=True, temperature=0.7, top_p=0.95)
passes = []
target.register_forward_pre_hook(lambda module, inputs: passes.append(1))  # counts the target's forward passes

chat = [{"role": "user", "content": args.question}]
result = generator(chat, draft_model=draft, num_lookahead=args.num_lookahead, max_new_tokens=args.max_new_tokens,
                   **sampling)  # fmt: skip
with_draft = len(passes)
plain = generator(chat, max_new_tokens=args.max_new_tokens, **sampling)  # the same call without a draft
answer = result[0]["generated_text"][-1]["content"]
same = "the same text" if answer == plain[0]["generated_text"][-1]["content"] else "another sample"
print(answer)
print(f"stats: {with_draft} target forward passes with draft_model=, {len(passes) - with_draft} without ({same})")
