"""Critiques from a model and refinement prompts, shared by training and inference.

A critic is prompted to walk the steps and end with a verdict; a critique whose verdict cannot
be read counts as no critique (it is never turned into a reward). A refinement prompt gives the
policy its previous attempt and a critique and asks it to fix the errors, not restyle.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Literal

import gymnasium as gym
from cgym.agents.base import Conversation, Policy
from cgym.agents.eval.episodes import EpisodeResult, run_episodes

Verdict = Literal["correct", "incorrect"]
_VERDICT = re.compile(r"(?:conclusion\W*)?\b(incorrect|correct)\b\W*\[\s*end\s*\]", re.IGNORECASE)

REFINE_INSTRUCTION = (
    "Your previous attempt at this task is below, followed by a critique of it. Fix the errors the "
    "critique points out (do not just restyle the answer) and solve the task again from the start, "
    "calling the tools you need."
)
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


def refinement_conversation(opening: Conversation, failed: EpisodeResult, critique: str) -> Conversation:
    """The env's opening conversation with the task prompt extended by attempt + critique."""
    system, task = opening.messages[0], opening.messages[1]
    content = f"{task['content']}\n\n{REFINE_INSTRUCTION}\n\nPrevious attempt:\n{transcript(failed)}\n\nCritique:\n{critique}"
    messages = [system, {"role": "user", "content": content}, *opening.messages[2:]]
    return Conversation(messages, opening.tools, task=opening.task, env_id=opening.env_id, env_seen=opening.env_seen)


def run_refinements(
    make_env: Callable[[], gym.Env],
    policy: Policy,
    attempts: Sequence[tuple[EpisodeResult, str]],
    *,
    batch_size: int | None = None,
    pool: list[gym.Env] | None = None,
) -> list[EpisodeResult]:
    """Replay each attempt's task (same seed, fresh env) opening with its refinement prompt;
    results in the order of `attempts`. `batch_size` defaults to all at once."""
    if not attempts:
        return []

    def opening(i: int, conversation: Conversation) -> Conversation:
        failed, critique = attempts[i]
        return refinement_conversation(conversation, failed, critique)

    seeds = [failed.seed for failed, _ in attempts]
    return run_episodes(make_env, policy, seeds, batch_size=batch_size or len(attempts), conversation_for=opening, pool=pool)
