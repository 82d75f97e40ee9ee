"""The house's import directions (docs/architecture.md "Layers"), read from the source with `ast`: every import
statement counts, module-level or inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "glm45v_fsdp"


def imports_of(path: Path) -> set[str]:
    """The glm45v_fsdp modules a file imports (absolute names)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name == "glm45v_fsdp" or name.startswith("glm45v_fsdp.")}


def offenders(folder: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    """{file under `folder`: the forbidden modules it imports}."""
    found = {}
    for path in sorted((PACKAGE / folder).rglob("*.py") if (PACKAGE / folder).is_dir() else [PACKAGE / folder]):
        bad = sorted(name for name in imports_of(path) if name.startswith(forbidden))
        if bad:
            found[str(path.relative_to(PACKAGE.parent))] = bad
    return found


def test_the_model_reaches_no_plan_and_no_tool():
    """Plans reach down into the model (its two seams, module swaps on the meta model); the model never up."""
    above = tuple(f"glm45v_fsdp.{name}" for name in ("parallel", "memory", "tools", "planner", "plans", "builders"))
    assert offenders("model", above + ("glm45v_fsdp.trainer",)) == {}


def test_the_ground_floor_imports_nothing_above_it():
    """errors.py imports no module of the package; module_patterns.py only errors.py."""
    assert imports_of(PACKAGE / "errors.py") == set()
    assert imports_of(PACKAGE / "module_patterns.py") == {"glm45v_fsdp.errors"}
    assert offenders("runtime", ("glm45v_fsdp.tools", "glm45v_fsdp.plans", "glm45v_fsdp.trainer")) == {}


def importers_of(prefix: str, allowed: tuple[str, ...]) -> dict[str, list[str]]:
    """{file of glm45v_fsdp/ or ds_compat/ outside the `allowed` folders: its imports that start with `prefix`}."""
    found = {}
    for root in (PACKAGE, PACKAGE.parent / "ds_compat"):
        for path in sorted(root.rglob("*.py")):
            if any(path.is_relative_to(PACKAGE / folder) for folder in allowed):
                continue
            bad = sorted(name for name in imports_of(path) if name.startswith(prefix))
            if bad:
                found[str(path.relative_to(PACKAGE.parent))] = bad
    return found


def test_only_the_command_line_imports_the_tools_and_the_benchmarks():
    """tools/ holds the command-line entry points only; the benchmarks (bench/) are imported by them alone; the core
    (plans, planner, preflight, ...) and ds_compat import neither."""
    assert importers_of("glm45v_fsdp.tools", allowed=("tools",)) == {}
    assert importers_of("glm45v_fsdp.bench", allowed=("tools", "bench")) == {}
