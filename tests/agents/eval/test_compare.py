from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from cgym.agents.eval.compare import compare
from cgym.agents.eval.evaluate import EvalConfig, evaluate, pass_at_k
from cgym.agents.eval.report import write_reports
from cgym.agents.scripted import ScriptedPolicy

from cgym import envs  # noqa: F401
from cgym.cli import main

CONFIG = EvalConfig("cgym/ApiReport-v0", {"difficulty": "hard", "split": "test", "faults": 0.0}, episodes=12, seed=3)


@pytest.fixture(scope="module")
def result() -> dict:
    return compare([("skip_pagination", ScriptedPolicy("skip_pagination")), ("oracle", ScriptedPolicy("oracle"))], CONFIG)


def test_eval_is_deterministic_and_has_the_design_shape() -> None:
    a, _ = evaluate(ScriptedPolicy("no_retry"), EvalConfig("cgym/ApiReport-v0", {"difficulty": "hard", "faults": 0.3}, episodes=10, seed=1))
    b, _ = evaluate(ScriptedPolicy("no_retry"), EvalConfig("cgym/ApiReport-v0", {"difficulty": "hard", "faults": 0.3}, episodes=10, seed=1))
    for key in ("success_rate", "mean_reward", "reward_breakdown", "critique_codes", "episodes", "check_pass_rates", "mean_turns"):
        assert key in a
        assert a[key] == b[key], key
    assert a["episodes"] == 10 and 0 < a["success_rate"] < 1


def test_pass_at_k() -> None:
    assert pass_at_k(4, 0, 2) == 0.0 and pass_at_k(4, 4, 2) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    summary, _ = evaluate(ScriptedPolicy("oracle"), EvalConfig("cgym/ApiReport-v0", {}, episodes=3, samples=2))
    assert summary["episodes"] == 6 and summary["pass@2"] == 1.0


def test_compare_shape_and_disagreements(result: dict) -> None:
    assert result["before"]["success_rate"] == 0.0 and result["after"]["success_rate"] == 1.0
    assert set(result["arms"]) == {"skip_pagination", "oracle"}
    assert len(result["disagreements"]) == 12
    row = result["disagreements"][0]
    assert row["skip_pagination"]["first_failing_step"] == 4
    assert row["oracle"]["first_failing_step"] is None


def test_reports_are_written(result: dict, tmp_path: Path) -> None:
    paths = write_reports(result, tmp_path, title="test")
    html = paths["html"].read_text()
    assert "data:image/png;base64," in html and "id='summary'" in html and "msg assistant failing" in html
    assert "http://" not in html and "https://" not in html.replace("https://shop.example.test", "")
    assert json.loads(paths["json"].read_text())["after"]["success_rate"] == 1.0
    assert paths["png"].stat().st_size > 5000


def test_cli_compare_writes_json_and_plot(tmp_path: Path) -> None:
    code = main(["compare", "--env", "cgym/ApiReport-v0", "--before", "scripted:wrong_field", "--after", "scripted:oracle", "--episodes", "4", "--json", str(tmp_path / "c.json"), "--plot", str(tmp_path / "c.png"), "--html", str(tmp_path / "r.html")])
    assert code == 0
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["before"]["success_rate"] == 0.0 and data["after"]["success_rate"] == 1.0
    assert (tmp_path / "c.png").exists() and (tmp_path / "r.html").exists()


def _chromium() -> str | None:
    return next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser"), shutil.which("google-chrome")) if p), None)


@pytest.mark.skipif(_chromium() is None, reason="no headless Chromium on this machine (Debian package 'chromium')")
def test_report_renders_in_headless_chromium(result: dict, tmp_path: Path) -> None:
    paths = write_reports(result, tmp_path, title="chromium check")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=3000"]
    dom = subprocess.run([_chromium(), *flags, "--dump-dom", paths["html"].as_uri()], capture_output=True, text=True, timeout=60).stdout
    assert 'data-plots-ok="yes"' in dom, dom[:500]
    assert 'data-failing-visible="yes"' in dom
    assert 'data-summary-rows="2"' in dom
    shot = tmp_path / "shot.png"
    subprocess.run([_chromium(), *flags, "--window-size=1300,1800", f"--screenshot={shot}", paths["html"].as_uri()], capture_output=True, timeout=60)
    assert shot.stat().st_size > 10_000


def test_pass_hat_k() -> None:
    from cgym.agents.eval.evaluate import pass_hat_k

    assert pass_hat_k(4, 4, 4) == 1.0 and pass_hat_k(4, 3, 4) == 0.0
    assert pass_hat_k(4, 2, 2) == pytest.approx(1 / 6)  # C(2,2) / C(4,2)
    assert pass_hat_k(8, 6, 1) == pytest.approx(0.75)  # pass^1 is the success rate


@pytest.mark.parametrize(("agent", "want"), [("oracle", 1.0), ("exploit_raw_dump", 0.0)], ids=["always", "never"])
def test_cli_eval_reports_pass_hat_k_beside_pass_at_k(agent: str, want: float, tmp_path: Path) -> None:
    from cgym.cli import main

    out = tmp_path / "eval.json"
    assert main(["eval", "--env", "cgym/ApiReport-v0", "--policy", f"scripted:{agent}", "--episodes", "3", "--samples", "4", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["pass^4"] == summary["pass@4"] == want
    assert summary["sampling"]["temperature"] == 1.0  # eval's default, recorded and printed


def test_pass_hat_k_of_mixed_outcomes() -> None:
    from cgym.agents.base import Conversation
    from cgym.agents.eval.episodes import EpisodeResult
    from cgym.agents.eval.evaluate import summarize

    def result(success: bool) -> EpisodeResult:
        return EpisodeResult(0, success, 1.0 if success else 0.0, False, {}, {}, [], Conversation([]))

    # task 1: 2 of 2 succeed; task 2: 1 of 2 -> pass^2 = (1 + 0) / 2, pass@2 = (1 + 1) / 2
    summary = summarize([result(True), result(True), result(True), result(False)], samples=2)
    assert summary["pass^2"] == 0.5 and summary["pass@2"] == 1.0
