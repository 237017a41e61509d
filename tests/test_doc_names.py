"""Every code name README.md and docs/*.md cite in backticks exists in the code (the rule: `doc_names.py`)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from doc_names import code_spans, stale_names
from markdown_blocks import DOCUMENTS, REPO


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: path.relative_to(REPO).as_posix())
def test_every_code_name_in_the_document_exists(document):
    stale = [f"{document.name}:{line}: `{name}`" for line, name in stale_names(document.read_text())]
    assert stale == [], "names the code no longer has (rename them in the document):\n" + "\n".join(stale)


@pytest.mark.parametrize(
    "name",
    [
        "RoundLookahead.budget",  # a method
        "lookahead.RoundLookahead.for_call",  # a module's class's classmethod
        "hf_specsample.prepare_draft",  # the public API
        "round_costs.expected_speedup",  # a module by its last name
        "prepare.prepared_draft.resolve_draft",  # a sub-package's module
        "DraftForm.INT8_WEIGHTS",  # an enum member
        "Proposal.point_mass",  # a NamedTuple field
        "SpeculativeStats.alpha",  # a dataclass member
        "RowBook.active",  # an attribute assigned in __init__
        "CachedModel.step",  # one of a tuple assignment's targets
        "KernelRouting.for_model(ModelFacts.of(model), ...)",  # a call: its arguments are not checked
        "hf_specsample_bench.measure.cpu_name",
        "prepare/form_choice.py",
        "small_rows.cpp",
        "examples/chat.py",
    ],
)
def test_names_that_exist_pass(name):
    assert stale_names(f"see `{name}` here") == []


@pytest.mark.parametrize(
    "name",
    [
        "RoundLookahead.widths",  # a member that went
        "lookahead.expected_speedup",  # a function that moved to another module
        "hf_specsample.prepare.nowhere",
        "DraftForm.INT2_WEIGHTS",
        "Proposal.probabilities",
        "round_costs.RoundRecord.no_such_field",
        "prepare/nowhere.py",
    ],
)
def test_a_name_that_does_not_exist_fails(name):
    """The power check: the test above fails on a document naming any of these."""
    assert stale_names(f"a line\nsee `{name}` here") == [(2, name)]


def test_other_projects_names_and_fenced_code_are_not_checked():
    text = "`torch.argmax`, `out.cache`, `Cache.crop`, `F.linear`, `transformers/generation/utils.py`\n"
    text += "```python\n`lookahead.nowhere`\n```"
    assert stale_names(text) == []
    assert [span for _, span in code_spans(text)][-1] == "transformers/generation/utils.py"


def docstrings(path: Path) -> list[tuple[int, str]]:
    """(first line, text) of a module's docstrings: the module's, each class's and each function's."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            first = body[0] if body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                found.append((first.lineno, first.value.value))
    return found


LIBRARY_MODULES = sorted((REPO / "hf_specsample").rglob("*.py"))


@pytest.mark.parametrize("path", LIBRARY_MODULES, ids=lambda path: path.relative_to(REPO).as_posix())
def test_every_code_name_in_the_librarys_docstrings_exists(path):
    """The library's docstrings cite modules, members and files by the rule the documents follow: each exists."""
    stale = [
        f"{path.relative_to(REPO)}:{start + line - 1}: `{name}`"
        for start, text in docstrings(path)
        for line, name in stale_names(text)
    ]
    assert stale == [], "names the code no longer has (rename them in the docstring):\n" + "\n".join(stale)


def test_a_docstring_naming_a_missing_member_fails(tmp_path):
    """The power check: a docstring citing a member that does not exist is found, at its line."""
    module = tmp_path / "module.py"
    module.write_text('"""A module."""\n\n\ndef f():\n    """Calls\n    `RoundLookahead.widths` here."""\n')
    found = [(start + line - 1, name) for start, text in docstrings(module) for line, name in stale_names(text)]
    assert found == [(6, "RoundLookahead.widths")]


LIBRARY_TEXT = "\n".join(path.read_text() for path in LIBRARY_MODULES)


def words_table(text: str) -> list[tuple[str, list[str]]]:
    """(word, code names) of each row of a page's "Words" table."""
    section = text.split("\n## Words\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| ---")][1:]
    return [(row.split(" | ")[0].strip("| "), [span for _, span in code_spans(row.split(" | ")[-1])]) for row in rows]


def undotted_name_exists(name: str) -> bool:
    """Whether an undotted code name (`select_rows`, `num_lookahead=`) is defined or used in the library."""
    bare = name.removesuffix("=").removesuffix("()")
    return re.fullmatch(r"[A-Za-z_]\w*", bare) is not None and re.search(rf"\b{bare}\b", LIBRARY_TEXT) is not None


def stale_words(text: str) -> list[str]:
    """A "Words" table's problems: a word listed twice, a row citing no code, a cited name the code does not have."""
    table = words_table(text)
    words = [word for word, _ in table]
    problems = [f"listed twice: {word}" for word in sorted({word for word in words if words.count(word) > 1})]
    for word, names in table:
        if not names:
            problems.append(f"{word}: no code name")
        for name in names:
            missing = stale_names(f"`{name}`") if "." in name else ([] if undotted_name_exists(name) else [name])
            problems += [f"{word}: `{name}`" for _ in missing]
    return problems


def test_the_words_are_listed_once_and_name_what_exists():
    """docs/ARCHITECTURE.md's "Words": one row per word, each naming code that exists."""
    assert stale_words((REPO / "docs" / "ARCHITECTURE.md").read_text()) == []


def test_the_words_test_finds_a_twice_listed_word_and_a_missing_name():
    """The power check: a word listed twice, a dotted and an undotted name that do not exist are all found."""
    table = "\n## Words\n\n| word | meaning | in the code |\n| --- | --- | --- |\n"
    table += "| lookahead | K | `DraftBudget.lookahead`, `no_such_name` |\n| lookahead | again | `RowBook.widths` |\n"
    assert stale_words(table) == ["listed twice: lookahead", "lookahead: `no_such_name`", "lookahead: `RowBook.widths`"]
