"""DeepSpeed's ds_config schema, read from DeepSpeed's source: every key path, the versions that have it, defaults.

The table (`ds_compat/ds_schema.json`) is generated, never edited: `tests/test_ds_schema.py` feeds every key it lists
through the translation and checks that each is taken, mapped or refused. The generator parses DeepSpeed's source
with `ast` (no version is imported, so any checkout, sdist or installed copy reads the same way):

- the pydantic sections (`SECTION_MODELS`: the model class each section is validated with), field by field, with
  aliases, and nested models followed (`zero_optimization.offload_param.device`, `zero_optimization.zenflow.*`);
- the keys DeepSpeed reads one by one (`READERS`: the files that read the top level and the dict-valued sections,
  and which dict expression holds which key path): `get_scalar_param(d, KEY, DEFAULT)`, `d.get(KEY, DEFAULT)`,
  `d[KEY]`, `KEY in d`;
- the optimizer names `runtime/config.py` knows (`DEEPSPEED_OPTIMIZERS`).

Key names resolve through the module constants the reading file imports (`from .constants import *`); a default that
is not a literal is kept as its source text, prefixed `expr:`.

CLI: python -m ds_compat.schema_table SOURCE... [--out ds_compat/ds_schema.json]; a SOURCE is VERSION=PATH, PATH a
directory holding the `deepspeed` package (a checkout, an unpacked sdist, site-packages), an sdist `.tar.gz`, or
`GITDIR@REV` (a tag or commit of a DeepSpeed git repository).
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import subprocess
import sys
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

SCHEMA_PATH = Path(__file__).with_name("ds_schema.json")

# Section -> the pydantic model DeepSpeed validates it with (runtime/config.py and the getters it calls).
SECTION_MODELS: dict[str, str] = {
    "zero_optimization": "DeepSpeedZeroConfig",
    "fp16": "DeepSpeedFP16Config",
    "bf16": "DeepSpeedBF16Config",
    "bfloat16": "DeepSpeedBF16Config",
    "tensorboard": "TensorBoardConfig",
    "wandb": "WandbConfig",
    "csv_monitor": "CSVConfig",
    "comet": "CometConfig",
    "comms_logger": "CommsLoggerConfig",
    "hybrid_engine": "HybridEngineConfig",
    "compile": "CompileConfig",
    "tensor_parallel": "TPTrainingConfig",
    "weight_quantization": "WeightQuantConfig",
    "timers.throughput": "DeepSpeedThroughputTimerConfig",
}
# The files that hold those models (and the models they nest).
MODEL_FILES = (
    "runtime/zero/config.py",
    "runtime/zero/offload_config.py",
    "runtime/zero/leaf_module_config.py",
    "runtime/zenflow/zenflow_config.py",
    "runtime/precision_config.py",
    "monitor/config.py",
    "comm/config.py",
    "runtime/config.py",
    "compile/config.py",
    "runtime/tensor_parallel/config.py",
    "inference/config.py",
    "utils/config.py",
)
# The files that read the config key by key, and which dict expression in each holds which key path ("": the top
# level; "function:expression" where one name holds different dicts in different functions). Reads:
# `get_scalar_param(d, KEY, DEFAULT)` (and helpers of that shape), `d.get(KEY[, DEFAULT])`, `d[KEY]`, `KEY in d`.
READERS: dict[str, dict[str, str]] = {
    "runtime/config.py": {
        "param_dict": "",
        "config": "",
        "self._param_dict": "",
        "checkpoint_params": "checkpoint",
        "data_types_params": "data_types",
        "get_sparse_attention_mode:param_dict": "sparse_attention",  # up to 0.19.6
        "get_sparse_attention_type:param_dict": "sparse_attention",
    },
    "runtime/model_checkpointing/config.py": {"param_dict": "checkpoint", "writer_dict": "checkpoint.writer"},
    "runtime/activation_checkpointing/config.py": {
        "param_dict": "",
        "act_chkpt_config_dict": "activation_checkpointing",
    },
    "profiling/config.py": {"param_dict": "", "flops_profiler_dict": "flops_profiler"},
    "autotuning/config.py": {
        "param_dict": "",
        "autotuning_dict": "autotuning",
        "get_model_info_config:param_dict": "autotuning",
    },
    "runtime/swap_tensor/aio_config.py": {"param_dict": "", "aio_dict": "aio"},
    "module_inject/auto_ep_config.py": {"param_dict": "expert_parallel"},
    "monitor/config.py": {"param_dict": ""},
    "utils/config.py": {"param_dict": ""},
    "datastates/config.py": {"param_dict": ""},
    "runtime/data_pipeline/config.py": {
        "get_data_efficiency_enabled:param_dict": "",
        "get_data_efficiency_config:param_dict": "",
        "get_data_efficiency_seed:param_dict": "",
    },
    "runtime/tensor_parallel/config.py": {"ds_config": ""},
}
MODEL_BASE = "DeepSpeedConfigModel"
# runtime/config.py's tables of keys DeepSpeed rejects (removed features) -> the section they sit in.
REJECTED_TABLES = {"_REMOVED_TOP_LEVEL_CONFIG_KEYS": "", "_REMOVED_ZERO_CONFIG_KEYS": "zero_optimization"}


# --------------------------------------------------------------------------------------------------------------
# Reading a DeepSpeed source tree
# --------------------------------------------------------------------------------------------------------------

Reader = Callable[[str], "str | None"]  # a path under deepspeed/ -> its text, None when absent


def directory_reader(root: Path) -> Reader:
    package = root if (root / "runtime" / "config.py").is_file() else root / "deepspeed"
    if not (package / "runtime" / "config.py").is_file():
        raise ValueError(f"'{root}' holds no deepspeed package (no deepspeed/runtime/config.py). Pass its directory.")

    def read(path: str) -> str | None:
        file = package / path
        return file.read_text(encoding="utf-8") if file.is_file() else None

    return read


def _python_files(tar: tarfile.TarFile, depth: int) -> dict[str, str]:
    """The .py files of the `deepspeed` package in `tar`, whose members name it at path part `depth` - 1, by their
    path under it."""
    return {
        str(PurePosixPath(*PurePosixPath(m.name).parts[depth:])): tar.extractfile(m).read().decode("utf-8")
        for m in tar.getmembers()
        if m.isfile() and m.name.endswith(".py") and PurePosixPath(m.name).parts[depth - 1 : depth] == ("deepspeed",)
    }


def sdist_reader(archive: Path) -> Reader:
    with tarfile.open(archive) as tar:
        files = _python_files(tar, depth=2)  # <name>/deepspeed/...
    if "runtime/config.py" not in files:
        raise ValueError(f"'{archive}' is not a DeepSpeed sdist (no <name>/deepspeed/runtime/config.py).")
    return files.get


def git_reader(git_dir: Path, rev: str) -> Reader:
    listing = subprocess.run(
        ["git", "-C", str(git_dir), "archive", "--format=tar", rev, "deepspeed"], capture_output=True, check=False
    )
    if listing.returncode:
        raise ValueError(f"git archive of '{rev}' in '{git_dir}' failed: {listing.stderr.decode().strip()}")
    with tarfile.open(fileobj=io.BytesIO(listing.stdout)) as tar:
        return _python_files(tar, depth=1).get  # deepspeed/...


def reader_for(path: str) -> Reader:
    """A reader for a directory, an sdist .tar.gz or GITDIR@REV."""
    if "@" in path and not Path(path).exists():
        git_dir, _, rev = path.rpartition("@")
        return git_reader(Path(git_dir), rev)
    if path.endswith((".tar.gz", ".tgz")):
        return sdist_reader(Path(path))
    return directory_reader(Path(path))


# --------------------------------------------------------------------------------------------------------------
# Module constants and literal values
# --------------------------------------------------------------------------------------------------------------


@dataclass
class Source:
    """A DeepSpeed source tree: parsed modules and the constants each one sees (its own and those it imports)."""

    read: Reader
    _trees: dict[str, ast.Module | None] = field(default_factory=dict)
    _scopes: dict[str, dict[str, Any]] = field(default_factory=dict)

    def tree(self, path: str) -> ast.Module | None:
        if path not in self._trees:
            text = self.read(path)
            self._trees[path] = None if text is None else ast.parse(text)
        return self._trees[path]

    def scope(self, path: str) -> dict[str, Any]:
        """The literal constants visible in module `path` (imports from other deepspeed modules followed)."""
        if path in self._scopes:
            return self._scopes[path]
        scope: dict[str, Any] = {}
        self._scopes[path] = scope  # an import cycle sees what is known so far
        tree = self.tree(path)
        for node in tree.body if tree else ():
            if isinstance(node, ast.ImportFrom) and (imported := self._module_path(path, node)):
                names = self.scope(imported)
                if any(alias.name == "*" for alias in node.names):
                    scope.update(names)
                else:
                    scope.update({a.asname or a.name: names[a.name] for a in node.names if a.name in names})
            elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                value = evaluate(node.value, scope)
                if not (isinstance(value, str) and value.startswith("expr:")):
                    scope[node.targets[0].id] = value
        return scope

    def _module_path(self, importer: str, node: ast.ImportFrom) -> str | None:
        if node.level:
            base = PurePosixPath(importer).parts[: -node.level]
        elif node.module and node.module.split(".")[0] == "deepspeed":
            base = ()
        else:
            return None
        parts = [*base, *(node.module.split(".") if node.module else [])]
        if parts[:1] == ["deepspeed"]:
            parts = parts[1:]
        for candidate in ("/".join(parts) + ".py", "/".join([*parts, "__init__.py"])):
            if self.read(candidate) is not None:
                return candidate
        return None


def evaluate(node: ast.expr, scope: dict[str, Any]) -> Any:
    """A default's value: literals, constants, arithmetic, pp_int(x), Field(default); else 'expr:<source>'."""
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        pass
    if isinstance(node, ast.Name) and node.id in scope:
        return scope[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        values = [evaluate(item, scope) for item in node.elts]
        if not any(isinstance(v, str) and v.startswith("expr:") for v in values):
            return values
    if isinstance(node, ast.BinOp):
        left, right = evaluate(node.left, scope), evaluate(node.right, scope)
        ops = {ast.Mult: lambda a, b: a * b, ast.Add: lambda a, b: a + b, ast.Pow: lambda a, b: a**b}
        if type(node.op) in ops and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (left, right)):
            return ops[type(node.op)](left, right)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "pp_int" and node.args:
        value = evaluate(node.args[0], scope)
        if isinstance(value, (int, float)):
            return int(value)
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id.endswith("Enum"):
        return node.attr  # OffloadDeviceEnum.none -> "none": the enum's values are their names here
    return f"expr:{ast.unparse(node)}"


# --------------------------------------------------------------------------------------------------------------
# Extraction
# --------------------------------------------------------------------------------------------------------------

_NO_DEFAULT = "required"


def _field_call(node: ast.expr | None) -> ast.Call | None:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Field":
        return node
    return None


def _model_classes(source: Source) -> dict[str, tuple[str, ast.ClassDef]]:
    """Every class in MODEL_FILES: name -> (file, class)."""
    classes: dict[str, tuple[str, ast.ClassDef]] = {}
    for path in MODEL_FILES:
        tree = source.tree(path)
        for node in tree.body if tree else ():
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, (path, node))
    return classes


def _is_model(name: str, classes: dict[str, tuple[str, ast.ClassDef]]) -> bool:
    if name == MODEL_BASE:
        return True
    if name not in classes:
        return False
    return any(isinstance(b, ast.Name) and _is_model(b.id, classes) for b in classes[name][1].bases)


def _model_keys(
    name: str, prefix: str, source: Source, classes: dict[str, tuple[str, ast.ClassDef]]
) -> Iterator[tuple[str, Any]]:
    path, cls = classes[name]
    scope = source.scope(path)
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id != MODEL_BASE and _is_model(base.id, classes):
            yield from _model_keys(base.id, prefix, source, classes)
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        key = node.target.id
        if key.startswith("_") or "ClassVar" in ast.unparse(node.annotation):
            continue
        call = _field_call(node.value)
        aliases = []
        if call is not None:
            default: Any = _NO_DEFAULT
            if call.args:
                default = evaluate(call.args[0], scope)
            for keyword in call.keywords:
                if keyword.arg == "default":
                    default = evaluate(keyword.value, scope)
                elif keyword.arg == "default_factory":
                    default = f"expr:{ast.unparse(keyword.value)}()"
                elif keyword.arg == "alias":
                    aliases.append(evaluate(keyword.value, scope))
        else:
            default = _NO_DEFAULT if node.value is None else evaluate(node.value, scope)
        nested = [n.id for n in ast.walk(node.annotation) if isinstance(n, ast.Name) and n.id != name]
        nested = [n for n in nested if n != MODEL_BASE and _is_model(n, classes)]
        for spelling in (key, *aliases):
            yield f"{prefix}{spelling}", default
            if nested:
                yield from _model_keys(nested[0], f"{prefix}{spelling}.", source, classes)


def _constant(node: ast.expr, scope: dict[str, Any]) -> str | None:
    value = evaluate(node, scope)
    return value if isinstance(value, str) and not value.startswith("expr:") else None


def _dict_path(node: ast.expr, scope: dict[str, Any], dicts: dict[str, str]) -> list[str] | None:
    """The key path a dict expression holds: `d[A][B]` -> d's path + [A, B], `d.keys()` -> d's; None: not a config
    dict this file is known to read."""
    keys: list[str] = []
    while isinstance(node, ast.Subscript):
        key = _constant(node.slice, scope)
        if key is None:
            return None
        keys.insert(0, key)
        node = node.value
    if not keys and isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "keys":
        return _dict_path(node.func.value, scope, dicts)
    base = dicts.get(ast.unparse(node))
    if base is None:
        return None
    return [*(base.split(".") if base else []), *keys]


def _function_scopes(tree: ast.Module, scope: dict[str, Any]) -> Iterator[tuple[ast.AST, dict[str, Any]]]:
    """Each function with the constants it sees: the module's, and its parameters' constant defaults
    (`def get_communication_data_type(param_dict, comm_type=COMMUNICATION_DATA_TYPE)`)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            arguments = node.args
            positional = [*arguments.posonlyargs, *arguments.args]
            pairs = [*zip(positional[len(positional) - len(arguments.defaults) :], arguments.defaults)]
            pairs += [(a, d) for a, d in zip(arguments.kwonlyargs, arguments.kw_defaults) if d is not None]
            yield node, {**scope, **{a.arg: evaluate(d, scope) for a, d in pairs}}


def _reads(tree: ast.Module, scope: dict[str, Any], dicts: dict[str, str]) -> Iterator[tuple[str, Any]]:
    """(key path, default) of every read of a config dict in `tree` (`dicts`: which expression holds which path)."""
    for function, local in _function_scopes(tree, scope):
        named = {**dicts, **{k.partition(":")[2]: v for k, v in dicts.items() if k.startswith(f"{function.name}:")}}
        for node in ast.walk(function):
            target = key_node = default_node = None
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
                if node.args:
                    target, key_node = node.func.value, node.args[0]
                    default_node = node.args[1] if len(node.args) > 1 else None
            elif isinstance(node, ast.Call) and len(node.args) >= 2 and isinstance(node.args[1], ast.Name):
                # get_scalar_param(d, KEY, DEFAULT), and helpers of the same shape (d, KEY constant, ...)
                target, key_node = node.args[0], node.args[1]
                default_node = node.args[2] if len(node.args) > 2 else None
            elif isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.In) and len(node.comparators) == 1:
                target, key_node = node.comparators[0], node.left
            elif isinstance(node, ast.Subscript):
                target, key_node = node.value, node.slice
            key = None if target is None else _constant(key_node, local)
            base = None if key is None or not key.isidentifier() else _dict_path(target, local, named)
            if base is None or base[-1:] == [key]:  # a section reading its own name looks the section up
                continue
            yield ".".join([*base, key]), (None if default_node is None else evaluate(default_node, local))


def extract(source: Source) -> dict[str, Any]:
    """{'keys': {path: default}, 'optimizers': [names]} of one DeepSpeed version."""
    keys: dict[str, Any] = {}

    def add(path: str, default: Any) -> None:
        if path not in keys or keys[path] is None:
            keys[path] = default

    classes = _model_classes(source)
    for section, model in SECTION_MODELS.items():
        if model in classes:
            add(section, None)
            for path, default in _model_keys(model, f"{section}.", source, classes):
                add(path, default)
    for path, dicts in READERS.items():
        tree = source.tree(path)
        for key, default in _reads(tree, source.scope(path), dicts) if tree else ():
            add(key, default)
    for key in list(keys):  # every section a key lives in is a key too
        parts = key.split(".")
        for end in range(1, len(parts)):
            add(".".join(parts[:end]), None)
    optimizers = source.scope("runtime/config.py").get("DEEPSPEED_OPTIMIZERS", [])
    return {"keys": dict(sorted(keys.items())), "optimizers": sorted(optimizers), "rejected": _rejected(source)}


def _rejected(source: Source) -> list[str]:
    """The key paths DeepSpeed rejects with a message (removed features)."""
    found = []
    for node in source.tree("runtime/config.py").body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) and len(node.targets) == 1:
            section = REJECTED_TABLES.get(getattr(node.targets[0], "id", ""))
            if section is not None:
                keys = (k.value for k in node.value.keys if isinstance(k, ast.Constant))
                found += [f"{section}.{key}" if section else key for key in keys]
    return sorted(found)


# --------------------------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------------------------

ABOUT = (
    "Generated by `python -m ds_compat.schema_table` from DeepSpeed's source (parsed with ast, nothing imported); do "
    "not edit. keys: every ds_config key path DeepSpeed reads, with the versions that have it and its default (one "
    "value when all versions agree, else per version; 'required': no default; 'expr:...': a default that is not a "
    "literal, as written; null: read without a default, or a section). rejected: keys DeepSpeed refuses (removed "
    "features). optimizers: the optimizer.type names DeepSpeed knows. Versions: 'all' or a list."
)


def build_table(sources: dict[str, Source]) -> dict[str, Any]:
    """The table of several versions (in the order given)."""
    per_version = {version: extract(source) for version, source in sources.items()}
    versions = list(per_version)
    keys: dict[str, dict[str, Any]] = {}
    for path in sorted({path for found in per_version.values() for path in found["keys"]}):
        having = [v for v in versions if path in per_version[v]["keys"]]
        defaults = {v: per_version[v]["keys"][path] for v in having}
        entry: dict[str, Any] = {"versions": having if having != versions else "all"}
        if len({json.dumps(d, sort_keys=True) for d in defaults.values()}) == 1:
            entry["default"] = defaults[having[0]]
        else:
            entry["default_by_version"] = defaults
        keys[path] = entry

    def by_version(kind: str) -> dict[str, list[str] | str]:
        names = sorted({name for found in per_version.values() for name in found[kind]})
        having = {name: [v for v in versions if name in per_version[v][kind]] for name in names}
        return {name: "all" if versions_of == versions else versions_of for name, versions_of in having.items()}

    return {
        "about": ABOUT,
        "versions": versions,
        "sources": {},
        "keys": keys,
        "rejected": by_version("rejected"),
        "optimizers": by_version("optimizers"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ds_compat.schema_table", description=__doc__.split("\n")[0])
    parser.add_argument("sources", nargs="+", help="VERSION=PATH: a directory, an sdist .tar.gz, or GITDIR@REV")
    parser.add_argument("--describe", action="append", default=[], help="VERSION=text: where that version came from")
    parser.add_argument("--out", type=Path, default=SCHEMA_PATH, help=f"the table to write (default {SCHEMA_PATH})")
    args = parser.parse_args(argv)
    sources: dict[str, Source] = {}
    for spec in args.sources:
        version, sep, path = spec.partition("=")
        if not sep:
            parser.error(f"source {spec!r} is not VERSION=PATH")
        try:
            sources[version] = Source(reader_for(path))
        except ValueError as error:
            print(f"schema_table: error: {error}", file=sys.stderr)
            return 2
    table = build_table(sources)
    table["sources"] = dict(item.partition("=")[::2] for item in args.describe)
    args.out.write_text(json.dumps(table, indent=1) + "\n", encoding="utf-8")
    print(f"{args.out}: {len(table['keys'])} keys over {', '.join(table['versions'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
