"""Policy specs, as the CLI takes them: `scripted:oracle`, `hf:DIR`, `openai:M@URL`, `vllm:M`.

Heavy backends (torch, transformers, vLLM) are imported only when their spec is used.
"""

from __future__ import annotations

from dataclasses import dataclass

from agents.base import Policy
from envs.errors import CgymError, did_you_mean

SPEC_FORMS = (
    "scripted:<agent> (e.g. scripted:oracle)",
    "hf:<hub-name-or-local-dir> (e.g. hf:runs/tiny)",
    "openai:<model>@<base_url>[?timeout_s=60&max_retries=4&deadline_s=120&max_reply_bytes=1048576] (e.g. openai:Qwen/Qwen2.5-0.5B-Instruct@http://127.0.0.1:8000/v1)",
    "vllm:<hub-name-or-local-dir>",
    "guarded:<spec> (runtime validation + retries around any policy)",
    "prompted:<spec> (the prompt-only baseline: the article's rules in the system prompt)",
)
KINDS = ("scripted", "hf", "openai", "vllm", "guarded", "prompted")


class PolicySpecError(CgymError, ValueError):
    """A policy spec that does not parse, or an option of the policy outside its valid range."""


@dataclass(frozen=True)
class SamplingOptions:
    """Sampling settings shared by every model-backed policy."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    seed: int = 0


def parse_spec(spec: str) -> tuple[str, str]:
    """Split `kind:rest`, with a message listing every valid form when it fails."""
    kind, sep, rest = spec.partition(":")
    if not sep or not rest.strip() or kind not in KINDS:
        raise PolicySpecError(f"cannot read the policy spec {spec!r}.{did_you_mean(kind, KINDS)} Valid forms: {'; '.join(SPEC_FORMS)}")
    return kind, rest


def load_policy(spec: str, options: SamplingOptions | None = None) -> Policy:
    """Build the policy a spec names."""
    kind, rest = parse_spec(spec)
    opts = options or SamplingOptions()
    if kind == "guarded":
        from agents.guard import GuardedPolicy

        return GuardedPolicy(load_policy(rest, opts))
    if kind == "prompted":
        from agents.prompting import PromptedPolicy

        return PromptedPolicy(load_policy(rest, opts))
    if kind == "scripted":
        from agents.scripted import ScriptedPolicy

        return ScriptedPolicy(rest)
    if kind == "hf":
        from agents.hf import HFPolicy

        return HFPolicy.from_pretrained(rest, temperature=opts.temperature, top_p=opts.top_p, max_new_tokens=opts.max_new_tokens, seed=opts.seed)
    if kind == "openai":
        from agents.openai_server import OpenAIPolicy

        return OpenAIPolicy.from_spec(rest, temperature=opts.temperature, top_p=opts.top_p, max_tokens=opts.max_new_tokens, seed=opts.seed)
    from agents.vllm_policy import VLLMPolicy

    return VLLMPolicy.from_spec(rest)
