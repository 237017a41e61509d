"""The fenced code blocks of the project's documentation (README.md and docs/*.md), and the shell commands in them.

Shared by `test_docs.py` (every block runs or names a command that exists) and `test_examples.py` (every example
command the documentation gives is run). A block preceded by an HTML comment `<!-- no-run: reason -->` (the last
non-blank line before its opening fence) is one that cannot run in the test suite; the reason is kept.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCUMENTS = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<language>[\w+-]*)\s*$")
NO_RUN = re.compile(r"^\s*<!--\s*no-run:\s*(?P<reason>.+?)\s*-->\s*$")
HEADING = re.compile(r"^#{1,6}\s+(?P<title>.+?)\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced block.

    Attributes:
        path: the markdown file.
        line: 1-based line of the opening fence.
        language: the fence's info string ("python", "bash", "" ...).
        code: the block's text, its indentation (inside a list item) removed.
        section: the title of the heading the block sits under ("" before the first heading).
        no_run: the reason given by a `<!-- no-run: ... -->` comment right before the fence, or None.
    """

    path: Path
    line: int
    language: str
    code: str
    section: str
    no_run: str | None

    @property
    def name(self) -> str:
        """`file:line`, relative to the repository: the test id."""
        return f"{self.path.relative_to(REPO).as_posix()}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """Every fenced block of a markdown file, in order."""
    lines = path.read_text().splitlines()
    found, section, index = [], "", 0
    while index < len(lines):
        heading, fence = HEADING.match(lines[index]), FENCE.match(lines[index])
        if heading and not lines[index].startswith(" "):
            section = heading.group("title")
        if not fence:
            index += 1
            continue
        indent, start = fence.group("indent"), index
        end = next(i for i in range(start + 1, len(lines)) if lines[i].strip() == "```")
        body = [line[len(indent) :] if line.startswith(indent) else line.lstrip() for line in lines[start + 1 : end]]
        previous = next((lines[i] for i in range(start - 1, -1, -1) if lines[i].strip()), "")
        marker = NO_RUN.match(previous)
        found.append(
            Block(path, start + 1, fence.group("language"), "\n".join(body) + "\n", section,
                  marker.group("reason") if marker else None)
        )  # fmt: skip
        index = end + 1
    return found


def all_blocks(language: str) -> list[Block]:
    """The blocks of one language in every document."""
    return [block for path in DOCUMENTS for block in blocks(path) if block.language == language]


def shell_lines(block: Block) -> list[str]:
    """A shell block's command lines: backslash continuations joined, blank lines and comments dropped."""
    joined = block.code.replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def commands(line: str) -> list[list[str]]:
    """The commands of one shell line (split at `&&`), each as its words, comments removed."""
    words = shlex.split(line, comments=True)
    found, current = [], []
    for word in words:
        if word == "&&":
            found.append(current)
            current = []
        else:
            current.append(word)
    return [command for command in [*found, current] if command]


@dataclass(frozen=True)
class ScriptCommand:
    """A command that runs one of the repository's scripts: `python SCRIPT ARGS` or `torchrun ... SCRIPT ARGS`."""

    script: str  # relative to the repository root, e.g. "examples/batch.py"
    args: tuple[str, ...]  # what follows the script
    torchrun: bool
    source: str  # `file:line` of the block that gives it


def script_commands(prefix: str) -> list[ScriptCommand]:
    """Every documented command that runs a script under `prefix` (e.g. "examples/"), in document order."""
    found = []
    for block in all_blocks("bash"):
        for line in shell_lines(block):
            for words in commands(line):
                launcher, rest = words[0], words[1:]
                if launcher not in ("python", "torchrun"):
                    continue
                scripts = [index for index, word in enumerate(rest) if word.endswith(".py")]
                if scripts and rest[scripts[0]].startswith(prefix):
                    at = scripts[0]
                    found.append(ScriptCommand(rest[at], tuple(rest[at + 1 :]), launcher == "torchrun", block.name))
    return found
