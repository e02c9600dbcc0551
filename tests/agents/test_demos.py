"""Scripted demonstrations for SFT: plain transcripts and critique-taking refinements."""

from __future__ import annotations

import pytest
from cgym.agents.critics import REFINE_INSTRUCTION
from cgym.agents.demos import demonstrations, refinement_demos
from cgym.agents.eval.episodes import run_episodes
from cgym.agents.scripted import ScriptedPolicy
from cgym.agents.scripted.api_report import _slip
from cgym.envs.registration import make

ENV = "cgym/ApiReport-v0"


@pytest.mark.parametrize("value", [2822, 7, 1090.5, "2021-10-08", "felix.schmidt@mail.example.org", "Berlin"])
def test_a_slip_changes_exactly_one_character(value) -> None:
    for seed in range(12):
        slipped = _slip(value, seed)
        assert slipped != value and type(slipped) is type(value)
        if isinstance(value, str):
            assert len(slipped) == len(value) and sum(a != b for a, b in zip(slipped, value)) == 1


def test_demonstrations_are_seeded_and_mostly_successful() -> None:
    demos = demonstrations(ENV, {"difficulty": "easy"}, episodes=40, seed=3)
    assert demos == demonstrations(ENV, {"difficulty": "easy"}, episodes=40, seed=3)
    assert len(demos) == 40 and all(messages[-1]["role"] == "assistant" for messages, _ in demos)


@pytest.mark.parametrize("difficulty", ["easy", "hard"])
def test_refinement_demos_fix_the_critiqued_attempt_and_solve_the_task(difficulty) -> None:
    demos = refinement_demos(ENV, {"difficulty": difficulty}, episodes=30, seed=1)
    assert 10 <= len(demos) <= 30
    for messages, _ in demos:
        prompt = messages[1]["content"]
        assert REFINE_INSTRUCTION in prompt and "Previous attempt:" in prompt and "Conclusion: incorrect [END]" in prompt
        assert messages[2]["role"] == "assistant"
    # replaying the demo's assistant turns in a fresh env solves the task: the answer is verified
    kwargs = {"difficulty": difficulty, "split": "train"}
    seeds = [1_500_000 + i for i in range(30)]
    oracle = {r.conversation.messages[1]["content"]: r for r in run_episodes(lambda: make(ENV, **kwargs), ScriptedPolicy("oracle"), seeds)}
    for messages, _ in demos:
        task = messages[1]["content"].split("\n\n" + REFINE_INSTRUCTION)[0]
        solved = oracle[task]
        assert solved.success and messages[2:] == solved.conversation.messages[2:]


def test_cli_sft_mixes_in_refinement_demos(monkeypatch, tmp_path) -> None:
    import cgym.trainer.sft

    from cgym.cli import main

    seen: list = []

    def fake_sft(model, demos, out, **kwargs):
        seen.extend(demos)
        return {"steps": 0}

    monkeypatch.setattr(cgym.trainer.sft, "sft", fake_sft)
    args = ["sft", "--env", ENV, "--env-kwargs", '{"difficulty": "easy"}', "--model", "m", "--out", str(tmp_path), "--episodes", "4"]
    assert main([*args, "--refinements", "12"]) == 0
    refinements = [messages for messages, _ in seen if REFINE_INSTRUCTION in messages[1]["content"]]
    assert len(seen) - len(refinements) == 4 and 4 <= len(refinements) <= 12
    seen.clear()
    assert main(args) == 0
    assert len(seen) == 4 and not any(REFINE_INSTRUCTION in messages[1]["content"] for messages, _ in seen)
