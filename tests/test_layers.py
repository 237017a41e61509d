"""The package's structure: layers that import one way, no import cycle, modules small enough to read in one sitting,
and a call's setup short enough to read in one breath. `docs/ARCHITECTURE.md` ("Layers") draws the same picture."""

import ast
import inspect
from pathlib import Path

import pytest

import hf_specsample.decoding as decoding

PACKAGE = Path(decoding.__file__).parent

# Bottom to top: a module imports only from its own layer or the layers below it (`docs/ARCHITECTURE.md`, "Layers").
LAYERS = [
    ("values", ["options", "devices", "transformers_api", "rows", "stats", "draft_tree", "cache_folder"]),
    ("model facts", ["model_facts"]),
    ("kernels", ["kernels.build", "kernels.small_rows", "kernels.quantized_linear", "kernels.routing"]),
    (
        "caches and buffers",
        [
            "sequences",
            "outputs",
            "cache.linear_states",
            "cache.row_ops",
            "cache.checkpoints",
            "cache.static_addresses",
            "cache.compiled",
            "cache.runner",
            "cache.forwards",
            "cache.step_warm_up",
            "cache.output_head",
            "cache.cached_model",
            "cache.tree_forward",
        ],
    ),  # fmt: skip
    (
        "drafters and verification",
        [
            "verify.fast_processors",
            "verify.processing",
            "verify.rejection",
            "verify.round_verifier",
            "verify.keyed_draws",
            "verify.tree_rule",
            "verify.tree_verifier",
            "verify.tree_round",
            "verify.stopping",
            "proposers.base",
            "proposers.cross_tokenizer",
            "proposers.tree_drafting",
            "proposers.dynamic_tree",
            "proposers.draft_model",
            "proposers.prompt_lookup",
            "distributed",
        ],
    ),  # fmt: skip
    (
        "choosing K and refusing",
        [
            "tree_design",
            "round_costs",
            "shape_policy",
            "lookahead",
            "round_timer",
            "graph_choice",
            "shape_choice",
            "validation",
        ],
    ),
    (
        "prepared drafts",
        [
            "prepare.vocabulary",
            "prepare.self_draft",
            "prepare.surgery",
            "prepare.draft_timing",
            "prepare.auto",
            "prepare.prepared_draft",
            "prepare.implicit",
        ],
    ),  # fmt: skip
    ("the plan", ["call_inputs", "plan"]),
    ("the loop", ["decoding"]),
    ("registration", ["registration", "__init__"]),
]


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
    return {module: index for index, (_, members) in enumerate(LAYERS) for module in members}


def test_every_module_has_a_layer():
    placed = layer_of()
    assert sorted(set(modules()) - set(placed)) == [], "a new module: give it a layer here and in ARCHITECTURE.md"
    assert sorted(set(placed) - set(modules())) == []


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
        "import typing\nif typing.TYPE_CHECKING:\n    from .plan import CallPlan\n\n"
        "def f():\n    from . import decoding\n"
    )
    hidden = PACKAGE / "lookahead.py"
    path = tmp_path / "lookahead.py"
    path.write_text(source)
    assert {"plan", "decoding"} <= imports_of("lookahead", path)
    assert "plan" not in imports_of("lookahead", hidden)
