"""The policy protocol: what every agent (scripted, local model, remote server) implements.

A policy takes a batch of conversations and returns one assistant turn for each. Local models
also keep the conversation's token ledger (`Conversation.token_ids` / `loss_mask` / `logprobs`)
so that a trainer learns from exactly the tokens that were sampled, never from a re-tokenization.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

Message = dict[str, Any]


@dataclass
class Conversation:
    """One episode's chat history plus, for local models, its token-exact ledger.

    `messages`, `tools` and `task` are what the env put in `info["messages"]` / `info["tools"]` /
    `info["task"]` (the task as typed data: scripted agents read its fields, never the prompt);
    `env_id` is the registered id of the env it is played in (scripted agents are found by it).
    The ledger is owned by the policy that samples: `token_ids` is the whole context so far,
    `loss_mask[i]` is 1 where token i was sampled by the policy, and `logprobs[i]` is the
    sampling log-probability of token i (0.0 where the mask is 0). `synced` counts how many
    of `messages` the ledger already covers; `prompt_len` is the length of the first prompt;
    `env_seen` counts the env messages already copied into `messages`.
    """

    messages: list[Message]
    tools: list[dict[str, Any]] = field(default_factory=list)
    task: Any = None
    env_id: str | None = None
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    synced: int = 0
    prompt_len: int = 0
    env_seen: int = 0

    def extend_from_env(self, env_messages: list[Message]) -> None:
        """Append the env's messages that this conversation has not seen yet.

        The conversation may have opened with another prompt than the env's (a refinement
        prompt, a guard's retry), so we track the env's list by count, not by copying it.
        """
        self.messages.extend(env_messages[self.env_seen :])
        self.env_seen = len(env_messages)


@dataclass(frozen=True)
class Turn:
    """One sampled assistant turn.

    `token_ids` / `logprobs` are set by local models only. `truncated` is True when the turn
    hit the max-new-tokens limit instead of the end-of-turn token.
    """

    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    truncated: bool = False


@runtime_checkable
class Policy(Protocol):
    """Anything that can take the next assistant turn for a batch of conversations."""

    name: str

    def act(self, batch: Sequence[Conversation]) -> list[Turn]:
        """Return one turn per conversation, in order."""
        ...
