"""A two-turn chat, streamed, whose second turn reuses the first turn's KV cache.

    python examples/chat.py                                    # Qwen2.5-Coder 1.5B target, 0.5B draft (Hub)
    python examples/chat.py --target ./target --draft ./draft --greedy "Hi!" "And then?"

generate() runs in a thread and a TextIteratorStreamer hands its text to this one. With return_dict_in_generate=True
the output carries the cache: the next turn passes it back with the whole conversation as input, so only the new
turn's tokens are computed. transformers 5.24 renamed the cache argument and output field from `past_key_values` to
`cache`; `hf_specsample.CACHE` is the installed version's name, so this script runs on both. Streaming takes one row
at a time.
"""

import argparse
from threading import Thread

from transformers import AutoModelForCausalLM, AutoTokenizer, TextIteratorStreamer

import hf_specsample  # adds draft_model= to generate()

parser = argparse.ArgumentParser(description="A streamed two-turn chat with a draft model.")
parser.add_argument("questions", nargs="*", default=["Write a Python function that reverses a string.",
                                                     "Now add type hints and a docstring."])  # fmt: skip
parser.add_argument("--target", default="Qwen/Qwen2.5-Coder-1.5B-Instruct")
parser.add_argument("--draft", default="Qwen/Qwen2.5-Coder-0.5B-Instruct")
parser.add_argument("--max-new-tokens", type=int, default=128)
parser.add_argument("--greedy", action="store_true", help="greedy decoding (default: sampling, T=0.7, top_p=0.95)")
args = parser.parse_args()

tokenizer = AutoTokenizer.from_pretrained(args.target)
target = AutoModelForCausalLM.from_pretrained(args.target, dtype="auto")
draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype="auto")  # shares the target's tokenizer
sampling = dict(do_sample=False) if args.greedy else dict(do_sample=True, temperature=0.7, top_p=0.95)


def generate_into(result: dict, **kwargs) -> None:
    """Runs in a thread: generate() puts its text into the streamer while this thread reads it."""
    try:
        result["out"] = target.generate(**kwargs)
    finally:
        kwargs["streamer"].end()  # ends the reading loop even if generate() raised


messages, cache, held, reused = [], None, None, 0
for question in args.questions:
    messages.append({"role": "user", "content": question})
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    if cache is not None:  # the cache holds `held`: drop what the re-templated conversation does not start with
        start = inputs["input_ids"][0, : len(held)]
        reused = int((start == held[: len(start)]).cumprod(0).sum())
        cache.crop(reused - len(held))  # crop(-n) drops the last n
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    kwargs = dict(**inputs, draft_model=draft, streamer=streamer, max_new_tokens=args.max_new_tokens,
                  return_dict_in_generate=True, **sampling)  # fmt: skip
    kwargs[hf_specsample.CACHE] = cache  # cache= (transformers >= 5.24) or past_key_values= (5.23)
    result = {}
    thread = Thread(target=generate_into, args=(result,), kwargs=kwargs)
    thread.start()
    print(f"user: {question}\nassistant: ", end="", flush=True)
    for text in streamer:  # arrives while generate() runs
        print(text, end="", flush=True)
    thread.join()
    out = result["out"]
    cache = getattr(out, hf_specsample.CACHE)  # out.cache (5.24) / out.past_key_values: all but the last token
    held = out.sequences[0, : cache.get_seq_length()]
    answer = tokenizer.decode(out.sequences[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    messages.append({"role": "assistant", "content": answer})
    print(f"\nstats: {out.speculative_stats}; {reused} prompt tokens came from the cache\n")
