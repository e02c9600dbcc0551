"""A user's own policies, loaded by the `py:custom_policy:<name>` specs in test_spec.py."""

from __future__ import annotations

from collections.abc import Sequence

from cgym.agents.base import Conversation, Turn
from cgym.agents.options import SamplingOptions
from cgym.agents.scripted import ScriptedPolicy


class OracleWithOptions:
    """Defers to the scripted oracle; keeps the sampling options it was built with."""

    def __init__(self, options: SamplingOptions) -> None:
        self.options = options
        self.inner = ScriptedPolicy("oracle")
        self.name = "custom-oracle"

    def act(self, batch: Sequence[Conversation]) -> list[Turn]:
        return self.inner.act(batch)


def make_policy(options: SamplingOptions) -> OracleWithOptions:
    return OracleWithOptions(options)


def takes_nothing() -> OracleWithOptions:
    return OracleWithOptions(SamplingOptions())


def not_a_policy(options: SamplingOptions) -> str:
    return "hello"


READY = OracleWithOptions(SamplingOptions(temperature=0.0))
NUMBER = 3
