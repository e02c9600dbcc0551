"""What a policy spec can set: the sampling settings every model-backed policy receives, and the
error for a spec or option that does not parse. Backends import these from here, never from
`cgym.agents.spec` (which imports the backends)."""

from __future__ import annotations

from dataclasses import dataclass

from cgym.envs.errors import CgymError, ConfigError


class PolicySpecError(CgymError, ValueError):
    """A policy spec that does not parse, or an option of the policy outside its valid range."""


@dataclass(frozen=True)
class SamplingOptions:
    """How a model-backed policy samples a turn: the one definition of these settings and their defaults.

    `TrainConfig` carries the same fields (it trains at `max_new_tokens` 96, shorter turns being
    faster); `hf:`, `openai:`, `vllm:` and `py:` policies all receive an instance.
    """

    temperature: float = 1.0
    """Sampling temperature (0: greedy)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the most likely tokens up to this probability mass (1.0: off)."""
    max_new_tokens: int = 256
    """Tokens per assistant turn."""
    seed: int = 0
    """Seeds the sampler, so the same calls give the same turns."""

    def __post_init__(self) -> None:
        for ok, rule in (
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}"),
            (self.seed >= 0, f"seed must be >= 0, got {self.seed}"),
        ):
            if not ok:
                raise ConfigError(rule)


DEFAULT_SAMPLING = SamplingOptions()
"""The defaults every backend starts from (frozen, so one instance serves as every default argument)."""
