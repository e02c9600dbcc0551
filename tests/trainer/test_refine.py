from __future__ import annotations

import numpy as np
import pytest
from cgym.agents.base import Conversation
from cgym.agents.critics import parse_verdict, run_refinements
from cgym.agents.eval.episodes import EpisodeResult, run_episodes
from cgym.agents.scripted import ScriptedPolicy
from cgym.envs import make
from cgym.trainer.refine import rebase, select_refinements, should_refine
from cgym.trainer.rollout import Trajectory


def _result(prompt_len: int, messages: list[dict] | None = None, success: bool = False) -> EpisodeResult:
    conv = Conversation(messages or [{"role": "system", "content": "s"}, {"role": "user", "content": "task"}], prompt_len=prompt_len)
    return EpisodeResult(seed=1, success=success, reward=float(success), truncated=False, breakdown={}, passed={}, critiques=[], conversation=conv)


def _traj(success: bool, tag: int = 0) -> Trajectory:
    return Trajectory([tag], [1], [0.0], float(success), success, group=0, truncated=False, refined=True, result=_result(0, success=success))


def test_rebase_moves_the_response_onto_the_original_prompt() -> None:
    # refinement prompt: 5 ids (critique inside), then 3 sampled ids and 2 env ids
    refined = Trajectory([9, 9, 9, 9, 9, 1, 2, 3, 7, 7], [0, 0, 0, 0, 0, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, -0.1, -0.2, -0.3, 0, 0], 3.5, True, group=2, truncated=False, refined=True, result=_result(prompt_len=5))
    original_prompt = [4, 4, 4]
    out = rebase(refined, original_prompt)
    assert out.ids == [4, 4, 4, 1, 2, 3, 7, 7]
    assert out.mask == [0, 0, 0, 1, 1, 1, 0, 0]
    assert out.logprobs == [0, 0, 0, -0.1, -0.2, -0.3, 0, 0]
    assert 9 not in out.ids  # nothing of the critique prompt is trained on
    assert out.refined and out.reward == 3.5 and out.group == 2


def test_selection_prefers_correct_refinements() -> None:
    rng = np.random.default_rng(0)
    candidates = [_traj(False, 1), _traj(True, 2), _traj(False, 3), _traj(True, 4)]
    chosen = select_refinements(candidates, 2, rng)
    assert [t.success for t in chosen] == [True, True]
    chosen = select_refinements(candidates, 3, rng)
    assert [t.success for t in chosen] == [True, True, False]
    assert select_refinements([_traj(False)] * 5, 2, rng) and len(select_refinements([_traj(False)] * 5, 2, rng)) == 2
    assert select_refinements(candidates, 0, rng) == []


@pytest.mark.parametrize(("successes", "fraction", "expected"), [([0, 0, 0, 0], 1.0, True), ([0, 1, 0, 0], 1.0, False), ([0, 1, 0, 0], 0.75, True), ([1, 1, 1, 1], 0.5, False)], ids=["all-failed", "one-ok", "threshold", "all-ok"])
def test_trigger(successes: list[int], fraction: float, expected: bool) -> None:
    group = [_traj(bool(s)) for s in successes]
    assert should_refine(group, fraction) is expected


def test_refinement_is_verified_in_a_fresh_env_with_the_same_seed() -> None:
    """A refinement prompt carries attempt + critique; the env still scores the same task."""
    make_env = lambda: make("cgym/ApiReport-v0", difficulty="hard", split="train", faults=0.0)  # noqa: E731
    failures = run_episodes(make_env, ScriptedPolicy("skip_pagination"), [11, 12])
    attempts = [(failed, failed.critique("step")) for failed in failures]
    retries = run_refinements(make_env, ScriptedPolicy("oracle"), attempts, batch_size=1)
    assert [r.seed for r in retries] == [11, 12]  # in the order of the attempts
    for (failed, _), retry in zip(attempts, retries):
        prompt = retry.conversation.messages[1]["content"]
        assert "Previous attempt:" in prompt and "pagination_incomplete" in prompt and prompt.startswith(failed.conversation.messages[1]["content"])
        assert retry.success and retry.task_id == failed.task_id
    assert run_refinements(make_env, ScriptedPolicy("oracle"), []) == []


@pytest.mark.parametrize(
    ("text", "verdict"),
    [("Step 1 ok.\nConclusion: incorrect [END]", "incorrect"), ("conclusion: Correct [end]", "correct"), ("... **Conclusion:** incorrect [END]", "incorrect"), ("it is incorrect", None), ("Conclusion: correct [END] ... Conclusion: incorrect [END]", "incorrect"), ("", None)],
    ids=["plain", "case", "markdown", "no-end-marker", "last-wins", "empty"],
)
def test_parse_verdict(text: str, verdict: str | None) -> None:
    assert parse_verdict(text) == verdict


class _SelfCritic:
    """Scripted stand-in for a model: a skip-pagination agent that, asked to critique, says
    'incorrect' and, given a critique, behaves like the oracle."""

    name = "fake"

    def act(self, batch):
        from cgym.agents.base import Turn
        from cgym.agents.scripted.api_report import Oracle, SkipPagination

        out = []
        for conv in batch:
            task = conv.messages[1]["content"]
            if not conv.tools:
                out.append(Turn("Step 3 fetched page 1 only.\nConclusion: incorrect [END]"))
            elif "Critique:" in task:
                out.append(Turn(Oracle()(conv)))
            else:
                out.append(Turn(SkipPagination()(conv)))
        return out


def test_self_critique_refines_flagged_attempts() -> None:
    from cgym.agents.eval.evaluate import EvalConfig
    from cgym.agents.self_critique import evaluate_with_self_critique

    report = evaluate_with_self_critique(_SelfCritic(), EvalConfig("cgym/ApiReport-v0", {"difficulty": "hard", "faults": 0.0, "split": "test"}, episodes=4))
    assert report["without"]["success_rate"] == 0.0
    assert report["with_self_critique"]["success_rate"] == 1.0
    assert report["with_self_critique"]["refined_episodes"] == 4
