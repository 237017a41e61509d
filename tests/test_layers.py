"""The package's structure: folders that are layers, imports that run one way between them, no import cycle.
`docs/ARCHITECTURE.md` ("Layers") draws the same picture."""

import ast
from pathlib import Path

import hf_specsample.decoding as decoding

PACKAGE = Path(decoding.__file__).parent

# Bottom to top: a module imports only from its own layer or the layers below it (`docs/ARCHITECTURE.md`, "Layers").
# A layer is a folder of the package (every module in it belongs to it), or a few modules at the top of the package.
LAYERS: list[tuple[str, list[str]]] = [
    ("values", ["options", "stats"]),
    ("core", ["core/"]),
    ("kernels", ["kernels/"]),
    ("sampling", ["sampling/"]),
    ("cache", ["cache/"]),
    ("proposers", ["proposers/"]),
    ("verify", ["verify/"]),
    ("policy", ["policy/"]),
    ("prepare", ["prepare/"]),
    ("plan", ["plan/"]),
    ("the loop", ["outputs", "stopping", "decoding"]),
    ("registration", ["registration", "__init__"]),
]
MAX_TOP_LEVEL_MODULES = 12  # the rest lives in the layers' folders


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts) if parts != ["__init__"] else "__init__"


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py")) if path.name != "__init__.py"} | {
        "__init__": PACKAGE / "__init__.py"
    }


def imports_of(name: str, path: Path) -> set[str]:
    """The package modules `path` imports anywhere in its text: at the top, inside functions, under TYPE_CHECKING."""
    package = name.split(".")[:-1] if name != "__init__" else []
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                stem = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("hf_specsample"):
                stem = node.module.removeprefix("hf_specsample").lstrip(".")
            else:
                continue
            for alias in node.names:
                candidate = f"{stem}.{alias.name}" if stem else alias.name
                found.add(candidate if candidate in modules() else stem or "__init__")
        elif isinstance(node, ast.Import):
            found |= {alias.name.removeprefix("hf_specsample.") for alias in node.names if alias.name.startswith("hf_")}
    return {module for module in found if module in modules() and module != name}


def layer_of() -> dict[str, int]:
    """Each module's layer: its folder's, or its own where it sits at the top of the package."""
    placed = {}
    for index, (_, members) in enumerate(LAYERS):
        for member in members:
            if member.endswith("/"):
                prefix = member[:-1].replace("/", ".") + "."
                placed |= {module: index for module in modules() if module.startswith(prefix)}
            else:
                placed[member] = index
    return placed


def test_every_module_has_a_layer():
    placed = layer_of()
    assert sorted(set(modules()) - set(placed)) == [], "a new module: put it in a layer's folder"
    assert sorted(set(placed) - set(modules())) == []
    folders = {member[:-1] for _, members in LAYERS for member in members if member.endswith("/")}
    on_disk = {path.name for path in PACKAGE.iterdir() if path.is_dir() and (path / "__init__.py").exists()}
    assert on_disk == folders, "every folder of the package is a layer"


def test_few_modules_sit_at_the_top_of_the_package():
    """Modules live in their layer's folder; the top holds the public values, the loop and registration."""
    top = [path.name for path in PACKAGE.glob("*.py")]
    assert len(top) <= MAX_TOP_LEVEL_MODULES, sorted(top)


def test_imports_flow_one_way():
    """No module imports from a layer above its own, wherever the import sits (function-local ones included)."""
    placed = layer_of()
    upward = [
        f"{module} ({LAYERS[placed[module]][0]}) imports {target} ({LAYERS[placed[target]][0]})"
        for module, path in modules().items()
        for target in imports_of(module, path)
        if placed[target] > placed[module]
    ]
    assert upward == []


def test_no_import_cycle():
    graph = {module: imports_of(module, path) for module, path in modules().items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                return path + [module, target]
            if target not in state and (cycle := visit(target, path + [module])):
                return cycle
        state[module] = 2
        return None

    cycles = [cycle for module in sorted(graph) if module not in state and (cycle := visit(module, []))]
    assert cycles == []


def test_the_walk_sees_function_local_and_type_checking_imports(tmp_path):
    """The power check: an import hidden in a function or under TYPE_CHECKING is still an import."""
    source = (
        "import typing\nif typing.TYPE_CHECKING:\n    from ..plan.call_plan import CallPlan\n\n"
        "def f():\n    from .. import decoding\n"
    )
    hidden = PACKAGE / "policy" / "lookahead.py"
    path = tmp_path / "lookahead.py"
    path.write_text(source)
    assert {"plan.call_plan", "decoding"} <= imports_of("policy.lookahead", path)
    assert "plan.call_plan" not in imports_of("policy.lookahead", hidden)
