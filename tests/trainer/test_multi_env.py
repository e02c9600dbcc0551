"""Several envs in one run: groups drawn by weight, metrics and evaluations per env."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from cgym.agents.options import SamplingOptions
from cgym.envs.errors import ConfigError
from cgym.trainer.config import TrainConfig
from cgym.trainer.grpo import _draw_envs, train

API, SQL = "cgym/ApiReport-v0", "cgym/SqlQuery-v0"


def test_groups_are_drawn_by_weight() -> None:
    config = TrainConfig(envs=(API, SQL), env_weights=(0.7, 0.3), model="tiny")
    drawn = _draw_envs(config, np.random.default_rng(0), 4000)
    assert drawn.count(API) / len(drawn) == pytest.approx(0.7, abs=0.03)
    assert _draw_envs(TrainConfig(model="tiny"), np.random.default_rng(0), 3) == [API] * 3


@pytest.mark.parametrize(
    ("env_kwargs", "sql"),
    [
        pytest.param({"difficulty": "easy"}, {"difficulty": "easy", "split": "train"}, id="shared"),
        pytest.param({API: {"faults": 0.1}, SQL: {"difficulty": "hard"}}, {"difficulty": "hard", "split": "train"}, id="keyed-by-env"),
    ],
)
def test_env_kwargs_are_shared_or_keyed_by_env(env_kwargs: dict, sql: dict) -> None:
    assert TrainConfig(envs=(API, SQL), env_kwargs=env_kwargs, model="tiny").kwargs_for(SQL, "train") == sql


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        pytest.param({"envs": (API, API)}, "listed twice", id="duplicate"),
        pytest.param({"envs": (API, SQL), "env_weights": (1.0,)}, "1 values for 2 envs", id="weights-count"),
        pytest.param({"envs": (API, SQL), "env_weights": (1.0, 0.0)}, "must all be > 0", id="zero-weight"),
        pytest.param({"envs": (API, SQL), "env_kwargs": {API: {}}}, "lacks 'cgym/SqlQuery-v0'", id="keyed-missing"),
    ],
)
def test_bad_env_mixes_are_config_errors(fields: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TrainConfig(model="tiny", **fields)


@pytest.mark.slow
def test_both_builtins_train_with_per_env_metrics_and_evals(tiny_chat_model: Path, tmp_path: Path) -> None:
    config = TrainConfig(
        envs=(API, SQL), env_kwargs={"difficulty": "easy"}, model=str(tiny_chat_model), out=str(tmp_path / "run"),
        steps=2, group_size=2, tasks_per_step=4, sampling=SamplingOptions(max_new_tokens=8), micro_batch_size=8, eval_episodes=2, progress=False, seed=1,
    )  # fmt: skip
    result = train(config)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    shares = {env: sum(r.get(f"env/{env}/share", 0.0) for r in steps) for env in (API, SQL)}
    assert all(share > 0 for share in shares.values()), shares  # seed 1 draws both envs over 2 steps
    for r in steps:
        assert sum(v for k, v in r.items() if k.endswith("/share")) == pytest.approx(1.0)
    for summary in (result["before"], result["after"]):
        assert set(summary["per_env"]) == {API, SQL}
        assert summary["success_rate"] == pytest.approx(np.mean([s["success_rate"] for s in summary["per_env"].values()]))
    assert {f"eval/{API}/success_rate", f"eval/{SQL}/success_rate"} <= set(rows[0])
