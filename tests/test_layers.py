"""The layer order of docs/architecture.md, checked from the imports: no module of `omni_core` imports one of a
higher layer, `omni_core` never imports Prefect or the Prefect layer, and within the Prefect layer tasks import no
flow and flows no deployment (except the `omniflow` command, which serves and registers them).

Every import statement counts, at module level or inside a function: a deferred import still runs up the layers.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CORE = REPO / "omni_core"

# From the bottom. Each part of omni_core (a top-level module or package, named without `.py`) sits in one layer;
# a module may import its own layer and those below it.
LAYERS: list[tuple[str, set[str]]] = [
    (
        "config and records",
        {
            "config",
            "records",
            "quiet",
            "device",
            "data",
            "data_files",
            "resources",
            "faults",
            "sde_defaults",
            "cache_keys",
            "assets",
            "__init__",
        },
    ),
    ("models", {"models", "sde", "checkpoint", "export", "model_card", "reports", "trackers", "tracking"}),
    ("rollout", {"rollout", "tq"}),
    ("rewards", {"rewards"}),
    ("algorithms", {"algorithms"}),
    ("checks and evaluation", {"validation", "evaluation"}),
    ("distributed", {"distributed"}),
    ("workers", {"workers", "agent_loop"}),
    ("trainers", {"trainers"}),
    ("recipes", {"recipes"}),
]
LAYER_OF = {part: rank for rank, (_, parts) in enumerate(LAYERS) for part in parts}
PREFECT_LAYER = ("prefect", "prefect_ray", "omniflow")


def _imports(path: Path, root: Path = REPO) -> list[tuple[int, str]]:
    """(line, dotted name) of every import in a file: `from a.b import c` gives `a.b.c`; relative imports resolved."""
    package = path.relative_to(root).with_suffix("").parts[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def _part(module: str) -> str:
    """The part of omni_core a dotted name belongs to (`omni_core.models.loader` -> `models`)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def upward_imports(root: Path = REPO) -> list[str]:
    """Every import in omni_core of a part of a higher layer, as `file:line: part (layer) imports part (layer)`."""
    core = root / "omni_core"
    problems = []
    for path in sorted(core.rglob("*.py")):
        rel = path.relative_to(core).with_suffix("").parts
        own = rel[0]
        for line, module in _imports(path, root):
            if not module.startswith("omni_core."):
                continue
            target = _part(module)
            if target == own or target not in LAYER_OF:
                continue
            if LAYER_OF[target] > LAYER_OF[own]:
                problems.append(
                    f"{path.relative_to(root)}:{line}: {own} ({LAYERS[LAYER_OF[own]][0]}) imports {target} "
                    f"({LAYERS[LAYER_OF[target]][0]})"
                )
    return problems


def test_every_part_of_the_library_has_a_layer():
    parts = {p.stem for p in CORE.iterdir() if p.suffix == ".py"} | {
        p.name for p in CORE.iterdir() if p.is_dir() and p.name != "__pycache__"
    }
    assert parts - set(LAYER_OF) == set(), "add each new part of omni_core to LAYERS here and to docs/architecture.md"
    assert set(LAYER_OF) - parts == set(), "LAYERS names a part that is gone"


def test_no_module_imports_a_higher_layer():
    assert upward_imports() == []


def test_a_made_up_upward_import_is_seen(tmp_path):
    """The check itself: a copy of two real modules, one given an import of a higher layer, is reported."""
    core = tmp_path / "omni_core"
    (core / "models").mkdir(parents=True)
    (core / "__init__.py").write_text("")
    (core / "models" / "__init__.py").write_text("")
    (core / "models" / "loader.py").write_text("def f():\n    from omni_core.trainers.base import Trainer\n")
    (core / "trainers").mkdir()
    (core / "trainers" / "base.py").write_text("from omni_core.models.loader import f\n")
    assert upward_imports(tmp_path) == ["omni_core/models/loader.py:2: models (models) imports trainers (trainers)"]


def test_the_library_never_imports_prefect_or_the_prefect_layer():
    found = [
        f"{path.relative_to(REPO)}:{line}: {module}"
        for path in sorted(CORE.rglob("*.py"))
        for line, module in _imports(path)
        if module.split(".")[0] in PREFECT_LAYER
    ]
    assert found == []


def test_the_core_never_imports_a_recipe():
    found = [
        f"{path.relative_to(REPO)}:{line}: {module}"
        for path in sorted(CORE.rglob("*.py"))
        if path.relative_to(CORE).parts[0] != "recipes"
        for line, module in _imports(path)
        if module.startswith("omni_core.recipes")
    ]
    assert found == []


@pytest.mark.parametrize(
    ("folder", "refused", "allowed_files"),
    [("tasks", ("omniflow.flows", "omniflow.deployments"), set()), ("flows", ("omniflow.deployments",), {"cli.py"})],
)
def test_the_prefect_layer_keeps_its_own_order(folder, refused, allowed_files):
    found = [
        f"{path.relative_to(REPO)}:{line}: {module}"
        for path in sorted((REPO / folder).rglob("*.py"))
        if path.name not in allowed_files
        for line, module in _imports(path)
        if module.startswith(refused)
    ]
    assert found == []
