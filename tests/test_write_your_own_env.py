"""The docs' "Write your own env" example, run from the page itself as a user would run it.

The example module is cut out of docs/writing-an-env.md, installed as a plugin (a dist-info with a `cgym.envs`
entry point on PYTHONPATH), then checked with Gymnasium's `check_env` and driven through the real
`cgym` commands: the scripted oracle, the audit, and a `py:module:Callable` policy.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLE_LINES = 60  # the promise: a new env in at most this many lines


def readme_example() -> str:
    section = REPO.joinpath("docs", "writing-an-env.md").read_text().split("# Write your own env", 1)[1]
    found = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert found, "docs/writing-an-env.md: no python block under 'Write your own env'"
    return found.group(1)


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("plugin")
    (root / "weather_env.py").write_text(readme_example())
    dist = root / "weather_env-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: weather-env\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[cgym.envs]\nweather = weather_env\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(REPO)])}


def cgym(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cgym", *args], env=env, capture_output=True, text=True, timeout=120)


def test_the_example_is_short() -> None:
    assert len(readme_example().splitlines()) <= EXAMPLE_LINES


def test_the_plugin_passes_check_env(plugin_env: dict[str, str]) -> None:
    script = "import gymnasium as gym, envs\nfrom gymnasium.utils.env_checker import check_env\ncheck_env(gym.make('myorg/Weather-v0').unwrapped)\nprint('ok')"
    done = subprocess.run([sys.executable, "-c", script], env=plugin_env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr


def test_oracle_audit_and_own_policy_through_the_cli(plugin_env: dict[str, str], tmp_path: Path) -> None:
    done = cgym(plugin_env, "eval", "--env", "myorg/Weather-v0", "--policy", "scripted:oracle", "--episodes", "12", "--json", str(tmp_path / "oracle.json"))
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "oracle.json").read_text())["success_rate"] == 1.0

    done = cgym(plugin_env, "audit", "--env", "myorg/Weather-v0", "--episodes", "12", "--json", str(tmp_path / "audit.json"))
    assert done.returncode == 0, done.stderr
    audit = json.loads((tmp_path / "audit.json").read_text())
    assert audit["passed"] and audit["exploits"]["exploit_always_yes"]["success_rate"] == 0.0

    done = cgym(plugin_env, "eval", "--env", "myorg/Weather-v0", "--policy", "py:weather_env:AlwaysNo", "--episodes", "12", "--json", str(tmp_path / "mine.json"))
    assert done.returncode == 0, done.stderr
    mine = json.loads((tmp_path / "mine.json").read_text())
    assert mine["success_rate"] == 0.0 and mine["critique_codes"]["no_lookup"] == 12
