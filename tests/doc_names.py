"""The code names the documentation cites in backticks, and whether each exists in the code (`test_doc_names.py`).

What counts as a code name (outside fenced blocks, which `test_docs.py` runs):
- a dotted name, `a.b` or `a.b.c` (a call's parentheses and arguments after it dropped: `KernelRouting.for_model(...)`),
  whose first part is one of ours: `hf_specsample` / `hf_specsample_bench`, the last part of one of their modules or
  sub-packages (`lookahead`, `round_costs`, `prepare`, `cached_model`, ...), or a public class they define
  (`RoundLookahead`, `SpeculativeConfig`, ...). It exists when it resolves: modules import, attributes are found by
  `getattr`, and a class member may also be a dataclass field, an annotated or `__slots__` name, or an attribute
  its methods assign to `self` (in its class or a base of ours). A first part that names something else
  (`torch.argmax`, `out.cache`, `Cache.crop`) is not ours to check.
- a file path ending in `.py` or `.cpp` (`decoding.py`, `prepare/surgery.py`, `examples/chat.py`): it exists relative to
  the repository's root, the library, the tooling, `tests/` or `examples/`, unless it is prefixed with another
  project's folder (`transformers/...`, `generation/...`), which is not ours.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import importlib
import inspect
import pkgutil
import re
import textwrap
from pathlib import Path

PACKAGES = ("hf_specsample", "hf_specsample_bench")
SKIPPED_MODULES = {"hf_specsample_bench.__main__"}  # importing it runs the command line
SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
DOTTED = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(.*\))?$")
PATH = re.compile(r"^[\w./-]+\.(?:py|cpp)$")
FENCE = re.compile(r"^\s*```")
# Folders of other projects that the documentation cites files of (transformers' `generation/utils.py`, ...).
FOREIGN_FOLDERS = ("transformers/", "generation/", "vllm/", "models/", "torch/", "src/")


@functools.cache
def modules() -> dict[str, object]:
    """Every module of our packages, by full name, imported."""
    found = {}
    for package in PACKAGES:
        root = importlib.import_module(package)
        found[package] = root
        for info in pkgutil.walk_packages(root.__path__, prefix=f"{package}."):
            if info.name not in SKIPPED_MODULES:
                found[info.name] = importlib.import_module(info.name)
    return found


@functools.cache
def short_names() -> dict[str, list[str]]:
    """The last part of each module's name -> the full names with it (`plan` is `hf_specsample.plan.call_plan` and
    `hf_specsample.kernels.routing`)."""
    names: dict[str, list[str]] = {}
    for full in modules():
        names.setdefault(full.rsplit(".", 1)[-1], []).append(full)
    return names


@functools.cache
def classes() -> dict[str, list[type]]:
    """Public classes our modules define, by name."""
    found: dict[str, list[type]] = {}
    for name, module in modules().items():
        for attribute, value in vars(module).items():
            if inspect.isclass(value) and value.__module__ == name and not attribute.startswith("_"):
                found.setdefault(attribute, []).append(value)
    return found


def _ours(klass: type) -> bool:
    return klass.__module__.split(".")[0] in PACKAGES


@functools.cache
def assigned_to_self(klass: type) -> frozenset[str]:
    """Attribute names the methods of `klass` (and of its bases of ours) assign to `self`."""
    names = set()
    for base in klass.__mro__:
        if not _ours(base):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(base)))
        except (OSError, TypeError):
            continue
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for target in (part for whole in targets if whole is not None for part in ast.walk(whole)):
                on_self = isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                if on_self and target.value.id == "self":
                    names.add(target.attr)
    return frozenset(names)


def has_member(klass: type, name: str) -> bool:
    """Whether `klass.name` names something its instances have."""
    if hasattr(klass, name):
        return True
    if dataclasses.is_dataclass(klass) and name in {field.name for field in dataclasses.fields(klass)}:
        return True
    if isinstance(klass, enum.EnumMeta) and name in klass.__members__:
        return True
    for base in klass.__mro__:
        if name in getattr(base, "__annotations__", {}) or name in getattr(base, "__slots__", ()):
            return True
    return name in assigned_to_self(klass)


def resolves(start: object, parts: list[str], module_name: str | None) -> bool:
    """Whether `parts` lead somewhere from `start` (a module, whose full name is `module_name`, or a class)."""
    current, name = start, module_name
    for part in parts:
        if name is not None and f"{name}.{part}" in modules():
            name = f"{name}.{part}"
            current = modules()[name]
            continue
        if inspect.isclass(current):
            if not has_member(current, part):
                return False
            current, name = getattr(current, part, None), None
            if current is None:  # a field or an instance attribute: nothing further to follow
                return parts[-1] == part
            continue
        if current is None or not hasattr(current, part):
            return False
        current, name = getattr(current, part), None
    return True


def is_ours(dotted: str) -> bool:
    first = dotted.split(".")[0]
    return first in PACKAGES or first in short_names() or first in classes()


def exists(dotted: str) -> bool:
    """Whether a dotted code name of ours resolves (see the module's docstring)."""
    first, *rest = dotted.split(".")
    starts: list[tuple[object, str | None]] = []
    for full in short_names().get(first, []):
        starts.append((modules()[full], full))
    for klass in classes().get(first, []):
        starts.append((klass, None))
    return any(resolves(start, rest, name) for start, name in starts)


REPO = Path(__file__).resolve().parent.parent
PATH_ROOTS = ("hf_specsample", "hf_specsample_bench", "tests", "tools", "examples", "custom_generate")


@functools.cache
def repository_files() -> tuple[str, ...]:
    """Every file of ours, relative to the repository's root."""
    files = [path for root in PATH_ROOTS for path in (REPO / root).rglob("*") if path.is_file()]
    return tuple(path.relative_to(REPO).as_posix() for path in files + list(REPO.glob("*.*")))


def path_exists(path: str) -> bool:
    """Whether a cited file is one of ours: the path itself, or the end of one (`prepare/surgery.py`,
    `small_rows.cpp`)."""
    if path.startswith(FOREIGN_FOLDERS):
        return True
    return any(file == path or file.endswith(f"/{path}") for file in repository_files())


def code_spans(text: str) -> list[tuple[int, str]]:
    """(line, text) of every inline code span outside fenced blocks."""
    spans, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            spans += [(number, match.group(1).strip()) for match in SPAN.finditer(line)]
    return spans


def stale_names(text: str) -> list[tuple[int, str]]:
    """(line, name) of every code name in a markdown text that does not exist in the code."""
    stale = []
    for number, span in code_spans(text):
        if PATH.match(span):
            if not path_exists(span):
                stale.append((number, span))
            continue
        dotted = DOTTED.match(span)
        if dotted and is_ours(dotted.group(1)) and not exists(dotted.group(1)):
            stale.append((number, span))
    return stale
