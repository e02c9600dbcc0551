"""Commands end to end: a user's `py:` policy on the CLI, and `split` only for envs that take one."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import gymnasium as gym
import pytest

from cgym.cli import main
from cgym.commands import _with_split

AGENTS_TESTS = Path(__file__).parents[1] / "agents"


class NoSplitEnv(gym.Env):
    """An env whose constructor takes no `split`."""

    def __init__(self, difficulty: str = "easy") -> None:
        self.difficulty = difficulty


class AnyKwargsEnv(gym.Env):
    def __init__(self, **kwargs: object) -> None:
        self.kwargs = kwargs


@pytest.fixture(scope="module", autouse=True)
def toy_envs() -> Iterator[None]:
    ids = {"cgymtest/NoSplit-v0": NoSplitEnv, "cgymtest/AnyKwargs-v0": AnyKwargsEnv}
    for env_id, env in ids.items():
        gym.register(env_id, entry_point=f"{__name__}:{env.__name__}")
    yield
    for env_id in ids:
        gym.registry.pop(env_id)


@pytest.mark.parametrize(
    ("env_id", "kwargs", "expected"),
    [
        pytest.param("cgym/ApiReport-v0", {"difficulty": "hard"}, {"split": "test", "difficulty": "hard"}, id="takes-split"),
        pytest.param("cgym/ApiReport-v0", {"split": "train"}, {"split": "train"}, id="user-split-wins"),
        pytest.param("cgymtest/NoSplit-v0", {"difficulty": "hard"}, {"difficulty": "hard"}, id="no-split-kwarg"),
        pytest.param("cgymtest/AnyKwargs-v0", {}, {"split": "test"}, id="var-kwargs"),
    ],
)
def test_split_is_passed_only_to_envs_that_take_it(env_id: str, kwargs: dict[str, object], expected: dict[str, object]) -> None:
    assert _with_split(env_id, kwargs, "test") == expected


@pytest.mark.parametrize(("split", "expected"), [("none", {"difficulty": "hard"}), ("all", {"split": "all", "difficulty": "hard"})], ids=["none", "any-value"])
def test_the_eval_split_takes_any_value_or_none(split: str, expected: dict[str, object]) -> None:
    """An env whose splits are not train/test gets what the user names; 'none' leaves its default."""
    assert _with_split("cgym/ApiReport-v0", {"difficulty": "hard"}, split) == expected


def test_eval_runs_a_py_policy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.syspath_prepend(str(AGENTS_TESTS))
    out = tmp_path / "eval.json"
    code = main(["eval", "--env", "cgym/ApiReport-v0", "--policy", "py:custom_policy:make_policy", "--episodes", "3", "--temperature", "0", "--json", str(out)])
    summary = json.loads(out.read_text())
    assert code == 0 and summary["policy"] == "custom-oracle" and summary["success_rate"] == 1.0
    assert summary["env_kwargs"]["split"] == "test" and summary["sampling"]["temperature"] == 0
    assert "temperature 0 (greedy)" in " ".join(capsys.readouterr().out.split())


def test_python_dash_m_cgym_runs_the_cli() -> None:
    done = subprocess.run([sys.executable, "-m", "cgym", "envs"], capture_output=True, text=True, cwd=Path(__file__).parents[2])
    assert done.returncode == 0 and "cgym/ApiReport-v0" in done.stdout


@pytest.mark.parametrize("cuts", [0, 3])
def test_the_eval_table_says_when_the_context_cut_turns(cuts: int, capsys: pytest.CaptureFixture[str]) -> None:
    from cgym.commands import _print_summary

    summary = {
        "policy": "hf:x", "env": "cgym/ApiReport-v0", "env_kwargs": {}, "sampling": {"temperature": 0.0},
        "episodes": 2, "success_rate": 0.0, "mean_reward": -1.0, "truncated_rate": 0.0, "mean_turns": 1.0, "wall_s": 0.1,
        "check_pass_rates": {}, "reward_breakdown": {}, "critique_codes": {}, "context_cuts": cuts,
    }  # fmt: skip
    _print_summary(summary)
    printed = " ".join(capsys.readouterr().out.split())
    assert ("3 turns not sampled" in printed) == bool(cuts)


def test_bench_trainer_passes_the_lora_rank_and_micro_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import cgym.benchmarks.trainer_vs_trl

    seen: dict[str, object] = {}

    def fake_run(**kw: object) -> dict[str, object]:
        seen.update(kw)
        return {"ratio": 0.25}

    monkeypatch.setattr(cgym.benchmarks.trainer_vs_trl, "run", fake_run)
    assert main(["bench", "trainer", "--lora-r", "16", "--micro-batch", "4", "--steps", "2", "--json", str(tmp_path / "out.json")]) == 0
    assert seen["lora_r"] == 16 and seen["micro_batch"] == 4 and seen["steps"] == 2
    assert json.loads((tmp_path / "out.json").read_text()) == {"ratio": 0.25}
