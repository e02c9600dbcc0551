"""Checks and rubrics: verifiable rewards with correctness gating.

A `Check` scores a finished `Episode`. A `Rubric` adds the weighted scores of its checks, with
one rule that weights cannot break: *gate* checks (correctness) decide success, and non-gate
checks (format, length, style bonuses) count only when every gate passed. Since a failed gate
scores below 1 and gate weights are positive, every successful episode outscores every failed
one: pretty JSON with wrong fields, padding or tag spam can never buy success. A check may
report several critiques; a bonus check's critiques reach only successful episodes (a failed one
is about its gates). A check that raises fails at `CRASH_SCORE`, with a `check_crashed` critique
that names it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from cgym.envs.critique import Critique
from cgym.envs.episode import Episode

CRASH_SCORE = -1.0  # as low as any built-in check's failure: crashing a check never pays


Critiques = Critique | Sequence[Critique] | None


@dataclass(frozen=True)
class CheckResult:
    """`score` is 1.0 when passed; a failure scores lower (e.g. 0, a partial share, or -1).

    `critiques` holds everything the check found; `critique=` is the shorthand for one, and
    reads back as the first of `critiques`.
    """

    passed: bool
    score: float
    critique: Critique | None = None
    critiques: tuple[Critique, ...] = ()

    def __post_init__(self) -> None:
        found = tuple(self.critiques)
        if self.critique is not None and self.critique not in found:
            found = (self.critique, *found)
        object.__setattr__(self, "critiques", found)
        object.__setattr__(self, "critique", found[0] if found else None)

    @classmethod
    def ok(cls) -> CheckResult:
        return cls(True, 1.0)

    @classmethod
    def fail(cls, critiques: Critiques, score: float = 0.0) -> CheckResult:
        """A failure with one critique, several, or none; `score` is kept below a pass."""
        return cls(False, min(score, 0.999), critiques=_as_tuple(critiques))


def _as_tuple(critiques: Critiques) -> tuple[Critique, ...]:
    if critiques is None:
        return ()
    return (critiques,) if isinstance(critiques, Critique) else tuple(critiques)


@dataclass(frozen=True)
class Check:
    """A named, weighted scoring function of the finished episode."""

    name: str
    fn: Callable[[Episode], CheckResult]
    weight: float = 1.0
    gate: bool = True

    def __post_init__(self) -> None:
        if self.weight <= 0:
            raise ValueError(f"check {self.name!r}: weight must be > 0, got {self.weight}")


@dataclass(frozen=True)
class Score:
    reward: float
    success: bool
    breakdown: dict[str, float] = field(default_factory=dict)
    critiques: list[Critique] = field(default_factory=list)
    passed: dict[str, bool] = field(default_factory=dict)


@dataclass(frozen=True)
class Rubric:
    checks: Sequence[Check]

    def __post_init__(self) -> None:
        names = [c.name for c in self.checks]
        if len(set(names)) != len(names):
            raise ValueError(f"check names must be unique, got {names}")
        if not any(c.gate for c in self.checks):
            raise ValueError("a rubric needs at least one gate (correctness) check")

    @property
    def max_reward(self) -> float:
        return sum(c.weight for c in self.checks)

    def score(self, episode: Episode) -> Score:
        """Run every check; bonus terms are zeroed unless all gates passed."""
        results = {c.name: _run(c, episode) for c in self.checks}
        success = all(results[c.name].passed for c in self.checks if c.gate)
        breakdown: dict[str, float] = {}
        for check in self.checks:
            result = results[check.name]
            if check.gate:  # a failed gate stays strictly below a pass, whatever it reports
                score = result.score if result.passed else min(result.score, 0.999)
            else:  # bonuses are never negative and count only on success
                score = max(result.score, 0.0) if success else 0.0
            breakdown[check.name] = check.weight * score
        critiques = [c for check in self.checks if check.gate or success for c in results[check.name].critiques]
        passed = {name: r.passed for name, r in results.items()}
        return Score(sum(breakdown.values()), success, breakdown, critiques, passed)


def _run(check: Check, episode: Episode) -> CheckResult:
    try:
        result = check.fn(episode)
        if not isinstance(result, CheckResult):
            raise TypeError(f"a check returns a CheckResult, not {type(result).__name__}")
        return result
    except Exception as exc:  # noqa: BLE001 - checks read model-written answers; scoring must not raise
        detail = str(exc)
        detail = detail if len(detail) <= 200 else detail[:197] + "..."
        message = f"The check {check.name!r} crashed ({type(exc).__name__}: {detail}), so it counts as failed."
        return CheckResult.fail(Critique(episode.final_step, "check_crashed", message), CRASH_SCORE)
