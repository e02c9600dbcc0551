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


SECOND_EXAMPLE_LINES = 120  # the function-calling example, counted without blank and comment lines


def docs_example(heading: str) -> str:
    """The first python block under `heading` in docs/writing-an-env.md."""
    section = REPO.joinpath("docs", "writing-an-env.md").read_text().split(heading, 1)[1]
    found = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert found, f"docs/writing-an-env.md: no python block under {heading!r}"
    return found.group(1)


def readme_example() -> str:
    return docs_example("# Write your own env")


def calls_example() -> str:
    return docs_example("## A second example: function calling in one response")


def install_plugin(root: Path, module: str, source: str) -> dict[str, str]:
    """`module` on PYTHONPATH with a `cgym.envs` entry point, as `pip install` would leave it."""
    (root / f"{module}.py").write_text(source)
    dist = root / f"{module}-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[cgym.envs]\n{module} = {module}\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(REPO)])}


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return install_plugin(tmp_path_factory.mktemp("plugin"), "weather_env", readme_example())


@pytest.fixture(scope="module")
def calls_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return install_plugin(tmp_path_factory.mktemp("calls"), "calls_env", calls_example())


def cgym(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cgym", *args], env=env, capture_output=True, text=True, timeout=120)


def test_the_example_is_short() -> None:
    assert len(readme_example().splitlines()) <= EXAMPLE_LINES


def python_in(env: dict[str, str], script: str) -> str:
    """Run `script` where the plugin is installed; its stdout (it must succeed)."""
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_plugin_passes_check_env(plugin_env: dict[str, str]) -> None:
    script = "import gymnasium as gym, envs\nfrom gymnasium.utils.env_checker import check_env\ncheck_env(gym.make('myorg/Weather-v0').unwrapped)\nprint('ok')"
    assert python_in(plugin_env, script).strip().endswith("ok")


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


def test_the_function_calling_example_fits_its_floor() -> None:
    code = [line for line in calls_example().splitlines() if line.strip() and not line.strip().startswith("#")]
    assert len(code) <= SECOND_EXAMPLE_LINES


def test_the_function_calling_example_passes_check_env_and_ends_after_one_turn(calls_env: dict[str, str]) -> None:
    script = (
        "import gymnasium as gym, envs\nfrom gymnasium.utils.env_checker import check_env\n"
        "env = gym.make('myorg/Calls-v0').unwrapped\ncheck_env(env)\n"
        "env.reset(options={'task_id': 'two-timers'})\n"
        "_, _, terminated, truncated, info = env.step('<tool_call>{\"name\": \"set_timer\", \"arguments\": {\"minutes\": 5}}</tool_call>')\n"
        "print(terminated, truncated, info['success'])"
    )
    assert python_in(calls_env, script).split()[-3:] == ["True", "False", "False"]  # one of two parallel calls: finished, failed


def test_the_function_calling_example_through_the_cli(calls_env: dict[str, str], tmp_path: Path) -> None:
    def run(*args: str) -> dict:
        out = tmp_path / "out.json"
        done = cgym(calls_env, *args, "--json", str(out))
        assert done.returncode == 0, done.stderr
        return json.loads(out.read_text())

    oracle = run("eval", "--env", "myorg/Calls-v0", "--policy", "scripted:oracle", "--tasks", "all")
    assert oracle["episodes"] == 5 and oracle["success_rate"] == 1.0 and oracle["mean_reward"] == 3.5
    audit = run("audit", "--env", "myorg/Calls-v0", "--episodes", "5")
    assert audit["passed"] and {"exploit_shotgun", "exploit_claim_done"} <= set(audit["exploits"])
    for flaw, reward in (("wrong_value", 1.0), ("wrong_function", 0.0)):
        flawed = run("eval", "--env", "myorg/Calls-v0", "--policy", f"scripted:{flaw}", "--tasks", "all")
        assert flawed["success_rate"] == 0.0 and flawed["mean_reward"] == reward and flawed["critique_codes"] == {flaw: 5}
    mine = run("eval", "--env", "myorg/Calls-v0", "--policy", "py:calls_env:FirstOffer", "--tasks", "all")
    assert mine["success_rate"] == 0.0 and mine["episodes"] == 5


def test_the_audit_fails_the_example_on_a_lenient_arguments_check(calls_env: dict[str, str]) -> None:
    """Judged on the needed calls alone, the shotgun outscores the honest wrong value: the audit says so."""
    script = (
        "import json, calls_env as m\nfrom cgym.envs import Check, CheckResult, Rubric\n"
        "from cgym.agents.eval.audit import audit\n"
        "def lenient(episode):\n"
        "    needed = [c for c in m.made(episode) if c.name in {n for n, _ in episode.task.data['calls']}]\n"
        "    ok = needed and all(any(m.fits(c, w) for w in episode.task.data['calls']) for c in needed)\n"
        "    return CheckResult.ok() if ok else CheckResult.fail([])\n"
        "m.CallsEnv.rubric = Rubric([Check('called', m.called), Check('arguments', lenient, weight=2.0)])\n"
        "print(json.dumps(audit('myorg/Calls-v0', {}, episodes=5)))"
    )
    report = json.loads(python_in(calls_env, script).splitlines()[-1])
    shotgun = report["exploits"]["exploit_shotgun"]
    assert not report["passed"] and not shotgun["passed"]
    assert shotgun["success_rate"] == 0.0 and shotgun["episodes_above_near_misses"]["wrong_value"] > 0
