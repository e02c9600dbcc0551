"""Critiques from a model: prompt a critic to walk the steps, parse its verdict robustly.

A critique whose verdict cannot be read counts as no critique: it is never turned into a reward.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal

from agents.base import Conversation, Policy
from agents.episodes import EpisodeResult

Verdict = Literal["correct", "incorrect"]
_VERDICT = re.compile(r"(?:conclusion\W*)?\b(incorrect|correct)\b\W*\[\s*end\s*\]", re.IGNORECASE)

CRITIC_INSTRUCTION = (
    "Check the attempt below step by step. For each step, say whether it is right; name the first "
    "wrong step, what was expected and why. End with exactly 'Conclusion: correct [END]' or "
    "'Conclusion: incorrect [END]'."
)


def parse_verdict(text: str) -> Verdict | None:
    """The last `correct [END]` / `incorrect [END]` in `text` (any case, optional 'Conclusion:')."""
    found = _VERDICT.findall(text)
    return found[-1].lower() if found else None  # type: ignore[return-value]


def transcript(result: EpisodeResult) -> str:
    """The attempt as text: every assistant turn and tool reply after the task prompt."""
    lines = []
    for message in result.conversation.messages[2:]:
        who = "assistant" if message["role"] == "assistant" else f"tool {message.get('name', '')}".strip()
        lines.append(f"[{who}] {message['content']}")
    return "\n".join(lines)


class ModelCritic:
    """Critiques attempts with any policy (`model:<spec>` on the CLI)."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy

    def critique(self, results: Sequence[EpisodeResult]) -> list[str | None]:
        """One critique per attempt, or None where the verdict could not be read."""
        prompts = [self._prompt(r) for r in results]
        turns = self.policy.act(prompts)
        return [turn.text if parse_verdict(turn.text) else None for turn in turns]

    @staticmethod
    def _prompt(result: EpisodeResult) -> Conversation:
        task = result.conversation.messages[1]["content"]
        content = f"Task:\n{task}\n\nAttempt:\n{transcript(result)}\n\n{CRITIC_INSTRUCTION}"
        return Conversation([{"role": "system", "content": "You are a careful reviewer."}, {"role": "user", "content": content}])
