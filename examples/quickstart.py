"""The README's main job: a HumanEval completion with and without a draft model, timed, on real checkpoints.

python examples/quickstart.py            # Qwen2.5-Coder 1.5B target, 0.5B draft (fetched on first use)
python examples/quickstart.py --pair smollm2 --max-new-tokens 48   # a quick run on a 135M model
"""

from hf_specsample_bench.demo import main

if __name__ == "__main__":
    main()
