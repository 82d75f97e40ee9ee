"""The house's floors (docs/architecture.md, "Floors"): every module of glm45v_fsdp/ and ds_compat/ imports only from
its own floor and the floors below, and no two packages or modules import each other round a loop.

The floors are read from the table in docs/architecture.md, the one place they are written; the imports are read from
the source with `ast`, so nothing is imported (no torch). Every import counts, wherever it stands: at module level,
inside a function (a lazy import defers the cost, not the dependency), under `if TYPE_CHECKING:` (the annotation
still names the module), and `importlib.import_module` with a literal name. An upward import is allowed only where
ALLOWED_UPWARD lists it with its reason.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ARCHITECTURE = REPO / "docs" / "architecture.md"
PACKAGES = ("glm45v_fsdp", "ds_compat")
NOT_READ = (REPO / "ds_compat" / "shim",)  # the stand-in `deepspeed` distribution: an import root of its own
RULE_FLOORS = "a module imports only from its own floor and the floors below (docs/architecture.md, Floors)"
RULE_CYCLE = "no import cycle between {what} (docs/architecture.md, Floors)"
RULE_DS_COMPAT = (
    "glm45v_fsdp never imports ds_compat, nor deepspeed (ds_compat under ds-fsdp); only its command lines do "
    "(docs/architecture.md, Floors)"
)
RULE_PRIVATE = "{unit} is imported by {allowed} only (docs/architecture.md, Floors)"

# (importing module, imported module) -> why it must reach up. Empty: every import points down or sideways.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}
# The glm45v_fsdp units above ds_compat, which may import it: the command lines.
COMMAND_LINES = ("glm45v_fsdp.train", "glm45v_fsdp.tools", "glm45v_fsdp.bench")
# Below the command lines, the library's imports of the real DeepSpeed -> why.
DEEPSPEED_IMPORTS = {
    "glm45v_fsdp.checkpoint.deepspeed_write": "DeepSpeed's own LossScaler class, pickled into the checkpoints written",
}
# Units only some may import: unit -> the units that may.
PRIVATE = {
    "glm45v_fsdp.tools": ("glm45v_fsdp.tools",),
    "glm45v_fsdp.bench": ("glm45v_fsdp.tools", "glm45v_fsdp.bench"),
}


@dataclass(frozen=True)
class Source:
    text: str
    is_package: bool  # an __init__.py


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int
    kind: str  # "module level", "lazy" (inside a function) or "type checking"

    def __str__(self) -> str:
        return f"{self.importer} imports {self.imported} (line {self.line}, {self.kind})"


@dataclass(frozen=True)
class Floors:
    """The table of docs/architecture.md: floor names bottom first, and each unit's floor (a package covers its
    modules; a module only itself)."""

    names: list[str]
    packages: dict[str, int]
    modules: dict[str, int]

    def unit_of(self, module: str) -> str | None:
        """The table's row a module belongs to: itself, or the innermost package row holding it."""
        if module in self.modules:
            return module
        parts = module.split(".")
        for cut in range(len(parts), 0, -1):
            if ".".join(parts[:cut]) in self.packages:
                return ".".join(parts[:cut])
        return None

    def level(self, unit: str) -> int:
        return self.packages[unit] if unit in self.packages else self.modules[unit]


def read_floors(markdown: str) -> Floors:
    """The "Floors" table: | floor | `path` | job |, top floor first; an empty floor cell continues the floor above.
    `glm45v_fsdp/x/` is a package row, `glm45v_fsdp/x.py` a module row."""
    section = markdown.split("\n## Floors\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]  # past the header and its rule
    top_first: list[tuple[str, str]] = []
    floor = ""
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        floor = cells[0].strip("*") or floor
        (path,) = re.findall(r"`([^`]+)`", cells[1])
        top_first.append((floor, path))
    names = list(dict.fromkeys(floor for floor, _ in reversed(top_first)))
    packages, modules = {}, {}
    for floor, path in top_first:
        if path.endswith("/"):
            packages[path.rstrip("/").replace("/", ".")] = names.index(floor)
        else:
            modules[path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")] = names.index(floor)
    return Floors(names, packages, modules)


def read_sources(root: Path = REPO) -> dict[str, Source]:
    """Every module of the project's packages by its dotted name."""
    sources = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            if any(path.is_relative_to(skipped) for skipped in NOT_READ):
                continue
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            is_package = path.name == "__init__.py"
            sources[name.removesuffix(".__init__")] = Source(path.read_text(), is_package)
    return sources


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _literal_import_module(node: ast.AST) -> str | None:
    """`importlib.import_module("a.b")` / `import_module("a.b")`: the literal name."""
    if not isinstance(node, ast.Call) or not node.args or not isinstance(node.args[0], ast.Constant):
        return None
    function = node.func
    name = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", None)
    return node.args[0].value if name == "import_module" and isinstance(node.args[0].value, str) else None


def imports_of(module: str, source: Source, known: set[str]) -> list[Import]:
    """The project modules `module` imports (with `from a import b`, a.b where that is a module, else a)."""
    found: list[Import] = []

    def resolve(name: str, line: int, kind: str) -> None:
        if name.split(".")[0] in PACKAGES or name == "deepspeed" or name.startswith("deepspeed."):
            found.append(Import(module, name, line, kind))

    def absolute(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        package = module.split(".") if source.is_package else module.split(".")[:-1]
        base = package[: len(package) - (node.level - 1)]
        return ".".join([*base, *([node.module] if node.module else [])])

    def visit(node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            child_kind = kind
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) and kind == "module level":
                child_kind = "lazy"
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for statement in child.body:
                    visit_statement(statement, "type checking")
                for statement in child.orelse:
                    visit_statement(statement, kind)
                continue
            visit_statement(child, child_kind)

    def visit_statement(node: ast.AST, kind: str) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                resolve(alias.name, node.lineno, kind)
        elif isinstance(node, ast.ImportFrom):
            base = absolute(node)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                resolve(full if full in known else base, node.lineno, kind)
        elif (name := _literal_import_module(node)) is not None:
            resolve(name, node.lineno, kind)
        visit(node, kind)

    visit(ast.parse(source.text, filename=module), "module level")
    return list(dict.fromkeys(found))  # `from a import b, c` imports a once


def read_imports(sources: dict[str, Source]) -> list[Import]:
    known = set(sources)
    return [found for module, source in sources.items() for found in imports_of(module, source, known)]


def _project(imports: Iterable[Import]) -> list[Import]:
    return [found for found in imports if found.imported.split(".")[0] in PACKAGES]


def unplaced(sources: Iterable[str], floors: Floors) -> list[str]:
    """Modules on no floor, and table rows that name no module."""
    modules = set(sources)
    problems = [f"{name} is on no floor: add it to the table" for name in sorted(modules) if not floors.unit_of(name)]
    for unit in [*floors.packages, *floors.modules]:
        if unit not in modules:
            problems.append(f"the table's row {unit} names no module of the source")
    return problems


def upward_imports(imports: Iterable[Import], floors: Floors) -> list[str]:
    problems = []
    for found in _project(imports):
        importer, imported = floors.unit_of(found.importer), floors.unit_of(found.imported)
        if importer is None or imported is None or importer == imported:
            continue
        if floors.level(imported) > floors.level(importer) and (found.importer, found.imported) not in ALLOWED_UPWARD:
            problems.append(
                f"{found}: upward, from floor '{floors.names[floors.level(importer)]}' to floor "
                f"'{floors.names[floors.level(imported)]}'. Rule: {RULE_FLOORS}"
            )
    return problems


def _within(module: str, units: Iterable[str]) -> bool:
    return any(module == unit or module.startswith(unit + ".") for unit in units)


def ds_compat_imports(imports: Iterable[Import]) -> list[str]:
    problems = []
    for found in imports:
        if found.importer.split(".")[0] != "glm45v_fsdp" or _within(found.importer, COMMAND_LINES):
            continue
        target = found.imported.split(".")[0]
        if target == "ds_compat" or (target == "deepspeed" and found.importer not in DEEPSPEED_IMPORTS):
            problems.append(f"{found}. Rule: {RULE_DS_COMPAT}")
    return problems


def private_imports(imports: Iterable[Import], floors: Floors) -> list[str]:
    problems = []
    for found in _project(imports):
        imported, importer = floors.unit_of(found.imported), floors.unit_of(found.importer)
        if imported in PRIVATE and importer not in PRIVATE[imported]:
            allowed = " and ".join(PRIVATE[imported])
            problems.append(f"{found}. Rule: {RULE_PRIVATE.format(unit=imported, allowed=allowed)}")
    return problems


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(edges.get(node, ())):
            if successor not in index:
                connect(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            connect(node)
    return found


def _describe_cycles(links: dict[tuple[str, str], Import], what: str) -> list[str]:
    edges: dict[str, set[str]] = {}
    for source, target in links:
        edges.setdefault(source, set()).add(target)
    problems = []
    for component in _cycles(edges):
        inside = [str(links[pair]) for pair in sorted(links) if pair[0] in component and pair[1] in component]
        rule = RULE_CYCLE.format(what=what)
        problems.append(f"import cycle between {', '.join(component)}: {'; '.join(inside)}. Rule: {rule}")
    return problems


def unit_cycles(imports: Iterable[Import], floors: Floors) -> list[str]:
    """Cycles between the table's rows (packages and top-level modules)."""
    links: dict[tuple[str, str], Import] = {}
    for found in _project(imports):
        pair = (floors.unit_of(found.importer), floors.unit_of(found.imported))
        if None not in pair and pair[0] != pair[1]:
            links.setdefault(pair, found)
    return _describe_cycles(links, "packages")


def module_cycles(imports: Iterable[Import]) -> list[str]:
    """Cycles between modules; a module importing one of its own packages does not count (Python loads a module's
    packages before the module)."""
    links: dict[tuple[str, str], Import] = {}
    for found in _project(imports):
        if found.importer == found.imported or found.importer.startswith(found.imported + "."):
            continue
        links.setdefault((found.importer, found.imported), found)
    return _describe_cycles(links, "modules")


# ---------------------------------------------------------------------------------------------------------------
# The house as it is
# ---------------------------------------------------------------------------------------------------------------

FLOORS = read_floors(ARCHITECTURE.read_text())
SOURCES = read_sources()
IMPORTS = read_imports(SOURCES)


def test_every_module_stands_on_a_floor_of_the_table():
    problems = unplaced(SOURCES, FLOORS)
    assert problems == [], "\n".join(problems)


def test_no_module_imports_a_floor_above_its_own():
    problems = upward_imports(IMPORTS, FLOORS)
    assert problems == [], "\n".join(problems)


def test_glm45v_fsdp_never_imports_ds_compat():
    problems = ds_compat_imports(IMPORTS)
    assert problems == [], "\n".join(problems)


def test_the_command_lines_parts_are_imported_by_them_alone():
    problems = private_imports(IMPORTS, FLOORS)
    assert problems == [], "\n".join(problems)


def test_no_import_cycle_between_packages_or_modules():
    problems = unit_cycles(IMPORTS, FLOORS) + module_cycles(IMPORTS)
    assert problems == [], "\n".join(problems)


# ---------------------------------------------------------------------------------------------------------------
# The checker itself
# ---------------------------------------------------------------------------------------------------------------


def planted(**texts: str) -> list[Import]:
    """The imports of made-up modules (name -> source; a name ending in `.__init__` is a package)."""
    sources = {name.removesuffix(".__init__"): Source(text, name.endswith(".__init__")) for name, text in texts.items()}
    return read_imports(sources)


def test_the_checker_reports_a_planted_upward_import_with_both_modules_and_the_rule():
    imports = planted(
        **{
            "glm45v_fsdp.config": "def check(setting):\n    from glm45v_fsdp.ops.registry import OPS\n",
            "glm45v_fsdp.ops.__init__": "",
            "glm45v_fsdp.ops.registry": "from glm45v_fsdp.config import Config\n",
        }
    )
    assert upward_imports(imports, FLOORS) == [
        "glm45v_fsdp.config imports glm45v_fsdp.ops.registry (line 2, lazy): upward, from floor 'settings' to floor "
        f"'features'. Rule: {RULE_FLOORS}"
    ]
    assert unit_cycles(imports, FLOORS) == [
        "import cycle between glm45v_fsdp.config, glm45v_fsdp.ops: glm45v_fsdp.config imports "
        "glm45v_fsdp.ops.registry (line 2, lazy); glm45v_fsdp.ops.registry imports glm45v_fsdp.config (line 1, "
        "module level). Rule: no import cycle between packages (docs/architecture.md, Floors)"
    ]


def test_the_checker_reads_relative_type_checking_and_import_module_imports():
    imports = planted(
        **{
            "glm45v_fsdp.data.__init__": "from .encode import ImageTextDataset\n",
            "glm45v_fsdp.data.encode": "import typing\nif typing.TYPE_CHECKING:\n    from .. import trainer\n",
            "glm45v_fsdp.trainer": "import importlib\nSTEP = importlib.import_module('glm45v_fsdp.step')\n",
            "glm45v_fsdp.step": "",
        }
    )
    assert [str(found) for found in imports] == [
        "glm45v_fsdp.data imports glm45v_fsdp.data.encode (line 1, module level)",
        "glm45v_fsdp.data.encode imports glm45v_fsdp.trainer (line 3, type checking)",
        "glm45v_fsdp.trainer imports glm45v_fsdp.step (line 2, module level)",
    ]
    assert upward_imports(imports, FLOORS) == [
        "glm45v_fsdp.data.encode imports glm45v_fsdp.trainer (line 3, type checking): upward, from floor 'data' to "
        f"floor 'core'. Rule: {RULE_FLOORS}"
    ]


def test_the_checker_reports_ds_compat_private_parts_and_module_cycles():
    imports = planted(
        **{
            "glm45v_fsdp.trainer": "from ds_compat.engine import DeepSpeedEngine\nimport glm45v_fsdp.tools.plan\n",
            "glm45v_fsdp.plans": "def save():\n    import deepspeed\n",
            "glm45v_fsdp.train": "from ds_compat.trainer_door import configure\n",
            "glm45v_fsdp.data.a": "from glm45v_fsdp.data import b\n",
            "glm45v_fsdp.data.b": "def f():\n    from glm45v_fsdp.data.a import g\n",
        }
    )
    assert ds_compat_imports(imports) == [
        f"glm45v_fsdp.trainer imports ds_compat.engine (line 1, module level). Rule: {RULE_DS_COMPAT}",
        f"glm45v_fsdp.plans imports deepspeed (line 2, lazy). Rule: {RULE_DS_COMPAT}",
    ]
    assert private_imports(imports, FLOORS) == [
        "glm45v_fsdp.trainer imports glm45v_fsdp.tools.plan (line 2, module level). Rule: glm45v_fsdp.tools is "
        "imported by glm45v_fsdp.tools only (docs/architecture.md, Floors)"
    ]
    assert module_cycles(imports) == [
        "import cycle between glm45v_fsdp.data.a, glm45v_fsdp.data.b: glm45v_fsdp.data.a imports glm45v_fsdp.data.b "
        "(line 1, module level); glm45v_fsdp.data.b imports glm45v_fsdp.data.a (line 2, lazy). Rule: no import "
        "cycle between modules (docs/architecture.md, Floors)"
    ]


def test_the_table_is_read_as_written():
    """A few rows of docs/architecture.md, so a table the reader misparses cannot pass as an empty house."""
    assert FLOORS.names[0] == "ground" and FLOORS.names[-1] == "command lines"
    assert FLOORS.unit_of("glm45v_fsdp.data.records") == "glm45v_fsdp.data"
    assert FLOORS.unit_of("glm45v_fsdp.config") == "glm45v_fsdp.config"
    assert FLOORS.unit_of("glm45v_fsdp.configs") is None
    assert FLOORS.level("glm45v_fsdp.model") < FLOORS.level("glm45v_fsdp.data") < FLOORS.level("ds_compat")
    assert len(IMPORTS) > 500 and len(SOURCES) > 150
