"""What installs: one `cgym` namespace, no generic top-level package, beside the OpenAI Agents SDK."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel as `python -m build` makes it (no isolation: the build needs only setuptools, already here)."""
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(ROOT)], check=True, capture_output=True)
    return next(out.glob("critique_gym-*.whl"))


def test_the_wheel_holds_only_the_cgym_namespace(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert top == {"cgym", next(t for t in top if t.endswith(".dist-info"))}
    for folder in ("envs", "agents", "trainer", "mock_apis", "benchmarks"):  # every folder of the layout, inside the namespace
        assert f"cgym/{folder}/__init__.py" in names, folder
    assert "cgym/envs/sql/__init__.py" in names and "cgym/agents/scripted/__init__.py" in names


def test_it_installs_and_imports_beside_openai_agents(wheel: Path, tmp_path: Path) -> None:
    """openai-agents' top-level package is `agents`: both import in one environment."""
    if subprocess.run([sys.executable, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('agents') is None)"], cwd=tmp_path).returncode:
        pytest.skip("openai-agents is not installed (the test extra installs it)")
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)], check=True)
    code = (
        "import agents, cgym.envs, cgym.agents.base, cgym.trainer.losses, gymnasium;"
        "assert hasattr(agents, 'Agent') and hasattr(agents, 'Runner'), agents.__file__;"
        f"assert cgym.envs.__file__.startswith({str(site)!r}), cgym.envs.__file__;"
        "gymnasium.make('cgym/ApiReport-v0').close()"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
