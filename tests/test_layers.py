"""The layers import one way (pyproject.toml's import-linter contracts), and the contracts bite.

engine -> store -> commit -> session -> api -> front ends: each layer imports only those below it,
the front ends only the public API, and no package's modules import each other in a circle.
`lint-imports` checks the tree as it is, and a copy with one upward import added must fail it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
        "sys.exit(lint_imports_command())", "--no-cache"]


def lint(cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    return subprocess.run(LINT, cwd=cwd, capture_output=True, text=True, env=env, timeout=300)


def test_the_tree_keeps_every_import_contract():
    done = lint(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def test_an_upward_import_breaks_the_layers_contract(tmp_path):
    """The engine importing the store (the cycle this layout removed) is caught."""
    shutil.copytree(ROOT / "kvstore", tmp_path / "kvstore", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    cache = tmp_path / "kvstore" / "engine" / "cache.py"
    cache.write_text(cache.read_text() + "\nfrom ..store import records  # noqa: E402,F401\n")
    done = lint(tmp_path)
    assert done.returncode != 0
    assert "kvstore.engine.cache -> kvstore.store.records" in done.stdout


def test_the_version_is_said_once_more_in_pyproject_and_nowhere_else():
    import tomllib

    import kvstore
    from kvstore.defaults import VERSION

    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"] == VERSION == kvstore.__version__
