"""A batch of prompts of different lengths (left-padded), several samples per prompt, statistics per row.

    python examples/batch.py                                   # Qwen2.5-Coder 1.5B target, 0.5B draft (Hub)
    python examples/batch.py --target ./target --draft ./draft --num-return-sequences 3 "def add(a, b):" "x ="
    python examples/batch.py --greedy                          # one sequence per prompt

Each row accepts its own number of draft tokens every round; rows that finish early are padded with pad_token_id,
as plain generate() pads them. Several sequences per prompt need sampling: greedy decoding gives one per prompt
(transformers refuses num_return_sequences > 1 without sampling or beams).
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_specsample  # noqa: F401  (adds draft_model= to generate())

PROMPTS = ["def fibonacci(n):", "class Stack:", "# Read a CSV file and print the sum of its second column\n"]
parser = argparse.ArgumentParser(description="Ragged prompts, several samples each, statistics per row.")
parser.add_argument("prompts", nargs="*", default=PROMPTS)
parser.add_argument("--target", default="Qwen/Qwen2.5-Coder-1.5B-Instruct")
parser.add_argument("--draft", default="Qwen/Qwen2.5-Coder-0.5B-Instruct")
parser.add_argument("--max-new-tokens", type=int, default=64)
parser.add_argument(
    "--num-return-sequences", type=int, default=None, help="samples per prompt (default: 2 when sampling, 1 greedy)"
)
parser.add_argument("--greedy", action="store_true", help="greedy decoding (default: sampling, T=0.7, top_p=0.95)")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()
if args.num_return_sequences is None:
    args.num_return_sequences = 1 if args.greedy else 2
elif args.greedy and args.num_return_sequences > 1:
    parser.error("--greedy gives one sequence per prompt: drop --num-return-sequences, or sample (no --greedy)")

torch.manual_seed(args.seed)
tokenizer = AutoTokenizer.from_pretrained(args.target, padding_side="left")  # new tokens go on the right
tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
target = AutoModelForCausalLM.from_pretrained(args.target, dtype="auto")
draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype="auto")  # shares the target's tokenizer
sampling = dict(do_sample=False) if args.greedy else dict(do_sample=True, temperature=0.7, top_p=0.95)

inputs = tokenizer(args.prompts, return_tensors="pt", padding=True)
out = target.generate(
    **inputs, draft_model=draft, max_new_tokens=args.max_new_tokens, num_return_sequences=args.num_return_sequences,
    pad_token_id=tokenizer.pad_token_id, return_dict_in_generate=True, **sampling,
)  # fmt: skip
stats = out.speculative_stats  # per-row lists are indexed like out.sequences' rows
texts = tokenizer.batch_decode(out.sequences[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
for row, text in enumerate(texts):
    prompt = args.prompts[row // args.num_return_sequences]  # rows: prompt 0's samples, then prompt 1's, ...
    print(f"--- row {row}: {stats.row_new_tokens[row]} new tokens, "
          f"{stats.row_accepted_tokens[row]} of {stats.row_draft_tokens[row]} draft tokens accepted")  # fmt: skip
    print(prompt + text)
print(f"stats: {stats}")
