"""Critiques: what went wrong at which step, as data, and its three renderings.

The renderings follow the Critique-GRPO paper (arXiv 2506.03106): *indicative* (right or
wrong), *indicative with ground truth*, and *step-level* (a walk through the trajectory that
names the first wrong step and ends with a verdict, ``Conclusion: incorrect [END]``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from cgym.envs.episode import Episode

CritiqueStyle = Literal["indicative", "ground_truth", "step"]
CRITIQUE_STYLES: tuple[CritiqueStyle, ...] = ("indicative", "ground_truth", "step")


@dataclass(frozen=True)
class Critique:
    """One error: the 1-based assistant turn it concerns, a stable code and the cause."""

    step: int
    code: str
    message: str
    expected: Any = None
    got: Any = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "code": self.code,
            "message": self.message,
            "expected": self.expected,
            "got": self.got,
        }

    def line(self) -> str:
        """A one-line human rendering: message plus expected / got when known."""
        text = self.message
        if self.expected is not None:
            text += f" Expected: {_short(self.expected)}."
        if self.got is not None:
            text += f" Got: {_short(self.got)}."
        return text



def new_mistakes(known: list[Critique], found: tuple[Critique, ...] | list[Critique]) -> list[Critique]:
    """The critiques of `found` that name a mistake `known` does not: one critique per mistake.

    A mistake is a code at a step: a rubric check that reports the `missing_argument` a tool's
    schema already reported at that turn adds nothing, so it is dropped; the known one (which names
    the argument's JSON path) stays.
    """
    seen = {(c.step, c.code) for c in known}
    return [c for c in found if (c.step, c.code) not in seen]

def _short(value: Any, limit: int = 160) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def render_indicative(success: bool) -> str:
    return "The answer is correct." if success else "The answer is incorrect."


def render_ground_truth(success: bool, ground_truth: str) -> str:
    if success:
        return render_indicative(True)
    return f"The answer is incorrect. The correct answer is: {ground_truth}"


def render_step(episode: Episode, critiques: list[Critique], success: bool) -> str:
    """Walk the trajectory turn by turn, mark the first wrong step, end with the verdict."""
    by_step: dict[int, list[Critique]] = {}
    for critique in critiques:
        by_step.setdefault(critique.step, []).append(critique)
    lines = ["Let me check the attempt step by step."]
    first_wrong = min(by_step) if by_step and not success else None
    for record in episode.steps:
        lines.append(f"Step {record.index}: {record.summary()}")
        found = by_step.pop(record.index, [])
        for n, critique in enumerate(found):
            marker = " (first error)" if record.index == first_wrong and n == 0 else ""
            lines.append(f"  - incorrect{marker} [{critique.code}]: {critique.line()}")
        if not found:
            lines.append("  - ok")
    for _, rest in sorted(by_step.items()):  # critiques about turns that never happened
        for critique in rest:
            lines.append(f"After the last step [{critique.code}]: {critique.line()}")
    verdict = "correct" if success else "incorrect"
    lines.append(f"Conclusion: {verdict} [END]")
    return "\n".join(lines)


def render(style: CritiqueStyle, episode: Episode, critiques: list[Critique], success: bool) -> str:
    """Render an episode's critiques in one of the three styles."""
    if style == "indicative":
        return render_indicative(success)
    if style == "ground_truth":
        return render_ground_truth(success, getattr(episode.task, "ground_truth", ""))
    return render_step(episode, critiques, success)
