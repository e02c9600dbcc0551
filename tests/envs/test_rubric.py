from __future__ import annotations

import pytest
from cgym.envs.critique import Critique
from cgym.envs.episode import Episode
from cgym.envs.rubric import Check, CheckResult, Rubric
from hypothesis import given
from hypothesis import strategies as st


def _fixed(result: CheckResult):
    return lambda episode: result


def test_bonus_counts_only_when_every_gate_passes() -> None:
    rubric = Rubric([Check("gate", _fixed(CheckResult.fail(None, 0.5)), 2.0), Check("bonus", _fixed(CheckResult.ok()), 0.5, gate=False)])
    score = rubric.score(Episode(task=None))
    assert not score.success
    assert score.breakdown == {"gate": 1.0, "bonus": 0.0}


def test_rejects_non_positive_weights_and_gate_less_rubrics() -> None:
    with pytest.raises(ValueError, match="weight"):
        Check("x", _fixed(CheckResult.ok()), 0.0)
    with pytest.raises(ValueError, match="gate"):
        Rubric([Check("x", _fixed(CheckResult.ok()), 1.0, gate=False)])


def test_failed_gate_reporting_full_score_still_ranks_below_success() -> None:
    liar = CheckResult(passed=False, score=1.0, critique=Critique(1, "x", "x"))
    rubric = Rubric([Check("gate", _fixed(liar), 1.0)])
    assert rubric.score(Episode(task=None)).reward < rubric.max_reward


scores = st.floats(min_value=-1.0, max_value=1.0, allow_nan=False)
weights = st.floats(min_value=0.01, max_value=10.0, allow_nan=False)


@given(
    gate_weights=st.lists(weights, min_size=1, max_size=4),
    bonus_weights=st.lists(weights, max_size=3),
    fail_scores=st.lists(scores, min_size=4, max_size=4),
    bonus_scores=st.lists(scores, min_size=3, max_size=3),
    failing=st.integers(min_value=0, max_value=3),
)
def test_every_success_outscores_every_failure(gate_weights, bonus_weights, fail_scores, bonus_scores, failing) -> None:
    """The ordering property holds for any weights, partial scores and bonuses."""
    failing %= len(gate_weights)

    def rubric(gate_results: list[CheckResult], bonus: list[CheckResult]) -> Rubric:
        checks = [Check(f"g{i}", _fixed(r), w) for i, (r, w) in enumerate(zip(gate_results, gate_weights))]
        checks += [Check(f"b{i}", _fixed(r), w, gate=False) for i, (r, w) in enumerate(zip(bonus, bonus_weights))]
        return Rubric(checks)

    worst_success = rubric([CheckResult.ok()] * len(gate_weights), [CheckResult.fail(None, s) for s in bonus_scores])
    gates = [CheckResult.ok()] * len(gate_weights)
    gates[failing] = CheckResult.fail(None, fail_scores[failing])
    best_failure = rubric(gates, [CheckResult.ok()] * len(bonus_weights))
    success, failure = worst_success.score(Episode(task=None)), best_failure.score(Episode(task=None))
    assert success.success and not failure.success
    assert success.reward > failure.reward


def _critique(code: str) -> Critique:
    return Critique(1, code, code)


def test_a_check_may_report_several_critiques() -> None:
    result = CheckResult.fail([_critique("a"), _critique("b")])
    score = Rubric([Check("gate", _fixed(result))]).score(Episode(task=None))
    assert [c.code for c in score.critiques] == ["a", "b"]
    assert result.critique == _critique("a")


def test_critique_is_the_shorthand_for_one() -> None:
    assert CheckResult(False, 0.0, critique=_critique("a")).critiques == (_critique("a"),)
    assert CheckResult.fail(_critique("a")) == CheckResult(False, 0.0, _critique("a"))
    assert CheckResult.fail(None).critiques == () and CheckResult.ok().critique is None


@pytest.mark.parametrize("gate_passes", [True, False], ids=["success", "failure"])
def test_bonus_critiques_reach_only_successful_episodes(gate_passes: bool) -> None:
    gate = CheckResult.ok() if gate_passes else CheckResult.fail(_critique("wrong"))
    rubric = Rubric([Check("gate", _fixed(gate)), Check("style", _fixed(CheckResult.fail(_critique("ugly"))), 0.1, gate=False)])
    codes = [c.code for c in rubric.score(Episode(task=None)).critiques]
    assert codes == (["ugly"] if gate_passes else ["wrong"])


@pytest.mark.parametrize(
    "fn",
    [lambda episode: 1 / 0, lambda episode: True],
    ids=["raises", "returns-a-bool"],
)
def test_a_crashing_check_becomes_a_critique_naming_it(fn) -> None:
    score = Rubric([Check("fragile", fn)]).score(Episode(task=None))
    assert not score.success and score.passed == {"fragile": False}
    assert [c.code for c in score.critiques] == ["check_crashed"] and "'fragile'" in score.critiques[0].message
