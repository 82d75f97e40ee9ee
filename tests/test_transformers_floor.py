"""setup.py's transformers range is the one the code runs on: the installed transformers lies inside it. CI's
.ci/lowest-transformers runs this file and the model tests in a venv pinned to the range's lower bound, so a bound
that admits a release the code does not run on fails in CI rather than in a user's LLaMA-Factory environment."""

from __future__ import annotations

import ast
import importlib.metadata
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]


def setup_requirement(name: str) -> Requirement:
    """The install_requires entry of `name` in setup.py, as pip reads it."""
    tree = ast.parse((REPO / "setup.py").read_text())
    (requires,) = [
        keyword.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        for keyword in node.keywords
        if keyword.arg == "install_requires"
    ]
    entries = [Requirement(text) for text in ast.literal_eval(requires)]
    (requirement,) = [entry for entry in entries if entry.name == name]
    return requirement


def test_installed_transformers_is_inside_the_setup_py_range():
    requirement = setup_requirement("transformers")
    installed = importlib.metadata.version("transformers")
    assert requirement.specifier.contains(installed, prereleases=True), (
        f"transformers {installed} is installed, outside setup.py's {requirement}"
    )


def test_ci_runs_the_lowest_allowed_transformers():
    assert "bash .ci/lowest-transformers" in (REPO / ".ci" / "run").read_text()
