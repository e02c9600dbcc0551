"""Dependencies point one way: mock_apis <- envs <- agents <- trainer <- {cgym, benchmarks} (DESIGN.md).

Every import counts, including those inside functions: a lazy import back up the layers is still
a cycle between packages. `cgym` may import `benchmarks` (the `bench` commands); `benchmarks`
must not import `cgym`. `envs` never imports torch.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYER = {"mock_apis": 0, "envs": 1, "agents": 2, "trainer": 3, "benchmarks": 4, "cgym": 5}
FORBIDDEN = {"envs": {"torch"}}  # third-party packages a layer must not import


def imported(source: str) -> set[str]:
    """The top-level package of every absolute import in `source`, wherever it is written."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def violations(package: str, source: str) -> list[str]:
    """Imports in a module of `package` that point up the layering or into a forbidden package."""
    bad = []
    for name in sorted(imported(source)):
        if name in LAYER and LAYER[name] > LAYER[package]:
            bad.append(f"{package} imports {name}")
        if name in FORBIDDEN.get(package, ()):
            bad.append(f"{package} imports {name}")
    return bad


def modules() -> list[tuple[str, Path]]:
    return [(package, path) for package in LAYER for path in sorted((ROOT / package).rglob("*.py"))]


@pytest.mark.parametrize(("package", "path"), modules(), ids=lambda v: str(v.relative_to(ROOT)) if isinstance(v, Path) else None)
def test_no_import_points_back_up_the_layers(package: str, path: Path) -> None:
    assert violations(package, path.read_text()) == []


@pytest.mark.parametrize(
    ("package", "source", "expected"),
    [
        pytest.param("agents", "def f():\n    from trainer.grpo import train\n", ["agents imports trainer"], id="lazy-import-up"),
        pytest.param("benchmarks", "import cgym.cli\n", ["benchmarks imports cgym"], id="benchmarks-imports-the-cli"),
        pytest.param("envs", "import torch.nn as nn\n", ["envs imports torch"], id="envs-imports-torch"),
        pytest.param("cgym", "from benchmarks.env_throughput import run\nfrom envs import make\n", [], id="cgym-may-import-benchmarks"),
        pytest.param("trainer", "from . import losses\nfrom agents.hf import HFPolicy\n", [], id="relative-and-downward"),
    ],
)  # fmt: skip
def test_the_checker_catches_a_violation(package: str, source: str, expected: list[str]) -> None:
    assert violations(package, source) == expected


def test_every_package_is_scanned() -> None:
    scanned = {package for package, _ in modules()}
    assert scanned == set(LAYER)


def test_importing_envs_loads_no_torch() -> None:
    """The static check above, confirmed at run time: `import envs` (every built-in env) stays torch-free."""
    code = "import sys, envs, envs.api_report, envs.sql; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0
