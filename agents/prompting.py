"""The prompt-only baseline: the article's rule list as a system prompt, for any policy.

"Prompt-only vs trained" compares like with like: the same model and env, with these rules
prepended to the env's system prompt, against the same model after training.
"""

from __future__ import annotations

from collections.abc import Sequence

from cgym.agents.base import Conversation, Policy, Turn

RULES = (
    "Rules:\n"
    "1. Call the API (the tools) before you summarise; never guess values you have not fetched.\n"
    "2. If a call fails with a transient error (429, 5xx, timeout, malformed JSON), retry it.\n"
    "3. Fetch every page of paginated results.\n"
    "4. Output strict JSON with exactly the required fields; no explanations beyond one short line.\n"
    "5. Check your answer against the tool results before you reply."
)


class PromptedPolicy:
    """Adds `rules` to the system message of every conversation, then defers to `inner`."""

    def __init__(self, inner: Policy, rules: str = RULES) -> None:
        self.inner = inner
        self.rules = rules
        self.name = f"prompted:{inner.name}"

    def act(self, batch: Sequence[Conversation]) -> list[Turn]:
        for conv in batch:
            first = conv.messages[0] if conv.messages else None
            if first is not None and first["role"] == "system" and self.rules not in first["content"]:
                conv.messages[0] = {**first, "content": f"{first['content']}\n\n{self.rules}"}
        return self.inner.act(batch)
