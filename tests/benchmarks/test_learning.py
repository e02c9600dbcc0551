"""The learning protocol's benchmark: arms resolved, paired tables, a resumable end-to-end run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cgym.benchmarks import learning


def test_arms_are_built_in_names_or_overrides() -> None:
    assert learning.resolve_arms([]) == {"grpo": {}, "rft": {"algo": "rft"}}
    assert learning.resolve_arms([("rft", None), ("hot", {"learning_rate": 1e-3})]) == {"rft": {"algo": "rft"}, "hot": {"learning_rate": 1e-3}}
    with pytest.raises(SystemExit, match="unknown arm 'grop'"):
        learning.resolve_arms([("grop", None)])


def test_the_paired_table_compares_each_arm_with_the_start_and_with_each_other() -> None:
    start = [0, 0, 1, 1]
    runs = [
        {"arm": "grpo", "seed": 0, "outcomes": [1, 1, 1, 1]},
        {"arm": "grpo", "seed": 1, "outcomes": [1, 0, 1, 1]},
        {"arm": "rft", "seed": 0, "outcomes": [1, 0, 1, 0]},
    ]
    table = learning.paired_table(start, runs)
    assert set(table) == {"grpo - start", "rft - start", "grpo - rft"}
    assert table["grpo - start"]["mean"] == pytest.approx(3 / 8) and table["grpo - start"]["seeds"] == [0, 1]
    assert table["grpo - rft"]["seeds"] == [0] and table["grpo - rft"]["mean"] == pytest.approx(0.5)
    assert table["rft - start"]["gained"] == 1 and table["rft - start"]["lost"] == 1


@pytest.mark.slow
def test_a_run_writes_json_and_png_and_resumes_without_redoing_runs(tmp_path: Path, tiny_chat_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["--start", str(tiny_chat_model), "--arm", "grpo", "--arm", "rft", "--seeds", "0", "--steps", "1", "--eval-episodes", "2",
            "--train", '{"group_size": 2, "lora_r": 2, "max_new_tokens": 8}', "--out", str(tmp_path / "runs"),
            "--json", str(tmp_path / "l.json"), "--plot", str(tmp_path / "l.png")]  # fmt: skip
    learning.main(argv)
    result = json.loads((tmp_path / "l.json").read_text())
    assert [(r["arm"], r["steps"]) for r in result["runs"]] == [("grpo", 1), ("rft", 1)]
    assert len(result["start"]["outcomes"]) == 2 and set(result["paired"]) == {"grpo - start", "rft - start", "grpo - rft"}
    assert (tmp_path / "l.png").stat().st_size > 1000
    assert result["machines"] == [result["runs"][0]["machine"]] and result["start"]["machine"]["cores"] >= 1  # one machine, recorded
    for part in [result["start"], *result["runs"]]:  # where each failed episode first went wrong
        assert len(part["first_errors"]) == 2 and all((e is None) == bool(o) for e, o in zip(part["first_errors"], part["outcomes"]))
        assert sum(part["errors"]["first_error_turn"].values()) == 2 - sum(part["outcomes"])
    monkeypatch.setattr(learning, "run_arm", lambda *a, **k: pytest.fail("a finished run was trained again"))
    learning.main([*argv, "--resume"])
    del result["runs"][0]["errors"], result["runs"][0]["first_errors"]  # a run from before the error profile
    (tmp_path / "l.json").write_text(json.dumps(result))
    learning.main([*argv, "--resume", "--profile-errors"])
    again = json.loads((tmp_path / "l.json").read_text())["runs"][0]
    assert again["errors_outcomes_match"] and len(again["first_errors"]) == 2  # profiled from its final model

    monkeypatch.undo()  # stopped while it evaluated: the JSON lacks a run whose training finished
    import cgym.trainer.grpo

    monkeypatch.setattr(cgym.trainer.grpo, "train", lambda *a, **k: pytest.fail("a finished training was run again"))
    (tmp_path / "l.json").write_text(json.dumps({**result, "runs": result["runs"][:1]}))
    learning.main([*argv, "--resume"])
    recovered = json.loads((tmp_path / "l.json").read_text())["runs"][1]
    assert recovered["recovered"] and (recovered["arm"], recovered["steps"]) == ("rft", 1) and recovered["outcomes"] == result["runs"][1]["outcomes"]
    config = json.loads((tmp_path / "runs" / "rft-seed0" / "train_config.json").read_text())
    assert learning.trained_already(tmp_path / "runs" / "rft-seed0", {**config, "seed": 1}) is None  # another run's folder
    (tmp_path / "runs" / "rft-seed0" / "final" / "config.json").write_text("{}")
    assert learning.trained_already(tmp_path / "runs" / "rft-seed0", config) is None  # a damaged final model


def test_the_error_profile_counts_first_errors_by_turn_and_code() -> None:
    errors = [None, [2, "sql_syntax_error"], [2, "unknown_table"], [4, "no_submission"], None]
    assert learning.first_error([{"step": 2, "code": "a"}, {"step": 3, "code": "b"}]) == [2, "a"] and learning.first_error([]) is None
    assert learning.error_profile(errors) == {
        "first_error_turn": {"2": 2, "4": 1},
        "first_error_code": {"sql_syntax_error": 1, "unknown_table": 1, "no_submission": 1},
        "mean_first_error_turn": 2.67,
    }
    assert learning.error_profile([None])["mean_first_error_turn"] is None


def test_runs_from_two_kinds_of_machine_are_listed_and_warned_about(capsys: pytest.CaptureFixture[str]) -> None:
    fast, slow = {"cpu": "A", "bf16": True}, {"cpu": "B", "bf16": False}
    assert learning.machines_used([{"machine": fast}, {"machine": fast}]) == [fast] and capsys.readouterr().err == ""
    assert learning.machines_used([{"machine": fast}, {"machine": slow}, {}]) == [fast, slow, {"cpu": "unknown"}]
    assert "3 kinds of machine" in capsys.readouterr().err
