"""Every code block of README.md and docs/*.md runs as written (`markdown_blocks.py` finds them).

- A python block is executed on tiny models. `from_pretrained` of a model id the documentation uses loads a tiny
  random model saved under that id (bf16, as the real checkpoints; a character tokenizer with a chat template), so
  the block's own text runs unchanged; `hf_specsample_bench.models.load_model` loads the same tiny models for the
  checkpoints it knows. As the documentation says, a block may use the names the README's quick start defines
  (`tokenizer`, `target`, `draft`, `inputs`, `torch`, `hf_specsample`): each block runs after a fresh run of the
  quick start, in a folder of its own that holds a copy of `custom_generate/` (a checkout's root). Compiled
  verification skips inductor's max-autotune there (as in test_compiled.py).
  The code is compiled under the markdown file's name, so tracebacks point at the document's line, and a
  deprecation warning attributed to a block's line fails it (`past_key_values=` on transformers 5.24, say).
- A bash block names commands the project has: a script that exists and declares every flag given to it, a module
  that exists, pip extras that `pyproject.toml` declares, never the unpublished distribution from an index. The
  examples are run with the documented flags by `test_examples.py`.
- The README's two set-up commands are `.ci/run`'s.
- A block preceded by `<!-- no-run: reason -->` is skipped with that reason.
"""

from __future__ import annotations

import ast
import builtins
import importlib.metadata
import importlib.util
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from markdown_blocks import REPO, Block, all_blocks, blocks, commands, shell_lines
from tiny import char_tokenizer, perturbed_copy, tiny_llama
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_specsample
import hf_specsample.cache.compiled as compiled

CHAT_TEMPLATE = (  # one line per message, then the assistant's prefix
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
# The model ids the documentation loads. Each gets a tiny stand-in; a block that loads another id fails, saying so.
TARGET_ID = "Qwen/Qwen2.5-Coder-1.5B-Instruct"
DRAFT_ID = "Qwen/Qwen2.5-Coder-0.5B-Instruct"
OTHER_TOKENIZER_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # another vocabulary: drafts over the shared tokens
README = REPO / "README.md"
QUICK_START = "Quick start"  # the README section whose first python block every other block continues
DEMO_COMMAND = 'pip install torch==2.13.0 && pip install -e ".[bench]" && python examples/quickstart.py'
CI_TEST_COMMENT = "# The README's test command, verbatim:"
ALLOWED_PROGRAMS = {"pip", "python", "torchrun", "ruff", "mypy", "git", "cd"}


def quick_start() -> Block:
    return next(block for block in blocks(README) if block.language == "python" and block.section == QUICK_START)


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory) -> dict[str, Path]:
    """Folders of tiny models saved under the documentation's model ids."""
    root = tmp_path_factory.mktemp("hub")
    target = tiny_llama(0, vocab_size=96, layers=2, hidden=64, heads=4, kv_heads=2)
    other_family = tiny_llama(2, vocab_size=80, layers=1, hidden=32, heads=2, kv_heads=1)  # another vocabulary
    models = {
        TARGET_ID: (target, char_tokenizer(96)),
        DRAFT_ID: (perturbed_copy(target, seed=1, scale=0.05), char_tokenizer(96)),
        OTHER_TOKENIZER_ID: (other_family, char_tokenizer(80)),
    }
    folders = {}
    for model_id, (model, tokenizer) in models.items():
        folder = root / model_id.replace("/", "--")
        tokenizer.chat_template = CHAT_TEMPLATE
        model.to(torch.bfloat16).save_pretrained(folder)  # the real checkpoints are bf16 ("auto" loads bf16)
        tokenizer.save_pretrained(folder)
        folders[model_id] = folder
    return folders


@pytest.fixture
def tiny_hub(stand_ins, monkeypatch, tmp_path):
    """`from_pretrained(model id)` loads the id's stand-in; blocks run in a folder of their own (a checkout's root).
    `compile=True` freezes weights without max-autotune (the same compiled path; seconds instead of a minute)."""
    monkeypatch.setattr(compiled, "CPU_INDUCTOR_OPTIONS", (("freezing", True),))

    def redirect(original):
        def from_pretrained(name, *args, **kwargs):
            if str(name) in stand_ins:
                return original(stand_ins[str(name)], *args, **kwargs)
            if Path(name).exists():
                return original(name, *args, **kwargs)
            raise AssertionError(f"the docs load {name!r}: give it a tiny stand-in in tests/test_docs.py")

        return from_pretrained

    for auto_class in (AutoModelForCausalLM, AutoTokenizer):
        monkeypatch.setattr(auto_class, "from_pretrained", redirect(auto_class.from_pretrained))

    from hf_specsample_bench import models as bench_models

    known = bench_models.KnownModel
    ids = {known.QWEN_CODER_1_5B: TARGET_ID, known.QWEN_CODER_0_5B: DRAFT_ID, known.SMOLLM2_135M: OTHER_TOKENIZER_ID}

    def load_model(model, dtype=torch.bfloat16, *args, **kwargs):
        folder = stand_ins[ids[model]]
        return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval(), AutoTokenizer.from_pretrained(folder)

    monkeypatch.setattr(bench_models, "load_model", load_model)
    shutil.copytree(REPO / "custom_generate", tmp_path / "custom_generate")
    monkeypatch.chdir(tmp_path)
    yield
    if not hf_specsample.is_registered():  # a block that unregisters must not leave the suite without the patch
        hf_specsample.register()


DOCS_MODULE = "__docs__"  # the blocks' `__name__`: what a warning filter matches them by


def execute(block: Block, namespace: dict) -> None:
    """Run a block's code under its document's name and line numbers; a deprecation warning attributed to the block
    (transformers', or one hf_specsample raises for a name transformers renamed) fails it."""
    source = "\n" * (block.line) + block.code  # the first code line is the line after the fence
    with warnings.catch_warnings():
        for category in (DeprecationWarning, FutureWarning):
            warnings.filterwarnings("error", category=category, module=DOCS_MODULE)
        exec(compile(source, str(block.path), "exec"), namespace)


def needs(block: Block) -> str | None:
    """Why a runnable block cannot run in this environment (an optional package missing), or None."""
    if "BitsAndBytesConfig" in block.code and importlib.util.find_spec("bitsandbytes") is None:
        return "needs bitsandbytes (the bnb extra)"
    if "custom_generate=" in block.code and "speculative_generate" not in block.code:
        try:  # transformers checks custom_generate/requirements.txt against the installed distributions
            importlib.metadata.version("hf-specsample")
        except importlib.metadata.PackageNotFoundError:
            return "custom_generate/requirements.txt needs hf-specsample installed (pip install -e .)"
    return None


PYTHON_BLOCKS = all_blocks("python")


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[block.name for block in PYTHON_BLOCKS])
def test_python_block_runs(block, tiny_hub, capsys):
    if block.no_run is not None:
        pytest.skip(f"marked no-run: {block.no_run}")
    missing = needs(block)
    if missing is not None:
        pytest.skip(missing)
    namespace = {"__name__": DOCS_MODULE}
    start = quick_start()
    if block != start:
        execute(start, namespace)
    execute(block, namespace)


def test_only_a_few_blocks_are_marked_no_run():
    """No-run blocks are the exception (each needs what CI lacks); every python block the README has runs."""
    marked = [block for block in PYTHON_BLOCKS if block.no_run is not None]
    assert len(marked) <= 3, [f"{block.name}: {block.no_run}" for block in marked]
    assert all(block.path != README for block in marked)


def test_the_quick_start_defines_what_it_loads():
    """The quick start runs as written in a fresh interpreter: it imports what it uses and names real model ids."""
    code = quick_start().code
    assert TARGET_ID in code and DRAFT_ID in code
    names = {node.id for node in ast.walk(ast.parse(code)) if isinstance(node, ast.Name)}
    defined = {target.id for node in ast.walk(ast.parse(code)) if isinstance(node, ast.Assign)
               for target in node.targets if isinstance(target, ast.Name)}  # fmt: skip
    imported = {alias.asname or alias.name.split(".")[0] for node in ast.walk(ast.parse(code))
                if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}  # fmt: skip
    assert names - defined - imported - set(dir(builtins)) == set()


# --- shell blocks ------------------------------------------------------------------------------------------------


def declared_extras() -> set[str]:
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
    return set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def repo_module_file(module: str) -> Path | None:
    """The file of a module of this repository (a package's `__main__.py` for `-m package`), or None."""
    parts = module.split(".")
    for candidate in (REPO.joinpath(*parts, "__main__.py"), REPO.joinpath(*parts).with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def declared_flags(path: Path, seen: set[Path] | None = None) -> set[str]:
    """The `--flags` a script's argument parsers declare: its own `add_argument` calls and those of the modules of
    this repository's tooling it imports (a script may hand its command line to one: quickstart.py -> demo.py)."""
    seen = set() if seen is None else seen
    if path in seen:
        return set()
    seen.add(path)
    tree = ast.parse(path.read_text())
    flags = {
        argument.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"
        for argument in node.args
        if isinstance(argument, ast.Constant) and str(argument.value).startswith("--")
    }
    package = path.parent.relative_to(REPO).parts if path.is_relative_to(REPO) else ()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: within the script's package
                module = ".".join([*package[: len(package) - node.level + 1], module]).strip(".")
            if module.split(".")[0] in ("hf_specsample_bench", "benchmarks"):
                imported = repo_module_file(module)
                flags |= declared_flags(imported, seen) if imported is not None else set()
    return flags


def check_flags(script: Path, args: list[str], where: str) -> None:
    flags = declared_flags(script)
    given = [arg.split("=")[0] for arg in args if arg.startswith("--")]
    unknown = [flag for flag in given if flag not in flags and flag != "--help"]
    assert unknown == [], f"{where}: {script.relative_to(REPO)} declares no {unknown}"


def check_command(words: list[str], where: str) -> None:
    """One shell command of the documentation names something the project has."""
    program, args = words[0], words[1:]
    assert program in ALLOWED_PROGRAMS, f"{where}: unexpected program {program!r} (add it to ALLOWED_PROGRAMS?)"
    if program == "pip" and args[:1] == ["install"]:
        editable = [args[i + 1] for i, arg in enumerate(args) if arg == "-e"]
        for target in editable:
            extras = target.partition("[")[2].rstrip("]")
            assert set(filter(None, extras.split(","))) <= declared_extras(), f"{where}: extras of {target}"
        named = [arg for arg in args[1:] if not arg.startswith("-") and arg not in editable]
        assert not any(arg.split("[")[0].split("=")[0] == "hf-specsample" for arg in named), (
            f"{where}: hf-specsample is not published; install from a checkout (pip install -e .)"
        )
    elif program == "python" and args[:1] == ["-m"]:
        module = args[1]
        assert importlib.util.find_spec(module.split(".")[0]) is not None, f"{where}: no module {module}"
        file = repo_module_file(module)
        if file is not None:
            check_flags(file, args[2:], where)
    elif program in ("python", "torchrun"):
        scripts = [index for index, arg in enumerate(args) if arg.endswith(".py")]
        assert scripts, f"{where}: {' '.join(words)} runs no script"
        script = REPO / args[scripts[0]]
        assert script.is_file(), f"{where}: no {args[scripts[0]]} in the repository"
        check_flags(script, args[scripts[0] + 1 :], where)


SHELL_BLOCKS = all_blocks("bash")


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=[block.name for block in SHELL_BLOCKS])
def test_shell_block_names_commands_that_exist(block):
    for line in shell_lines(block):
        for words in commands(line):
            check_command(words, block.name)


def test_every_block_has_a_language():
    """A fence without a language would be neither run nor checked."""
    unnamed = [block.name for path in (README, *sorted((REPO / "docs").glob("*.md"))) for block in blocks(path)
               if not block.language]  # fmt: skip
    assert unnamed == []


LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a markdown file's headings: lowercase, punctuation dropped, spaces to hyphens."""
    titles = [line.lstrip("#").strip() for line in path.read_text().splitlines() if line.startswith("#")]
    return {re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-") for title in titles}


def test_every_relative_link_resolves():
    """Links between the README, docs/ and the repository's files point at files that exist, and at headings that
    exist there."""
    broken = []
    for path in (README, *sorted((REPO / "docs").glob("*.md")), REPO / "CHANGELOG.md"):
        for match in LINK.finditer(path.read_text()):
            target = match.group("target")
            if re.match(r"^[a-z]+:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            if not linked.exists() or (anchor and anchor not in anchors(linked)):
                broken.append(f"{path.relative_to(REPO)}: {target}")
    assert broken == []


def test_the_readme_set_up_commands_are_what_ci_runs():
    """The README's test command is the line `.ci/run` runs verbatim, and its demo command is the documented one;
    both appear as lines of the README's shell blocks."""
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    test_command = ci[ci.index(CI_TEST_COMMENT) + 1]
    readme_lines = {line for block in blocks(README) if block.language == "bash" for line in shell_lines(block)}
    assert test_command in readme_lines
    assert DEMO_COMMAND in readme_lines
