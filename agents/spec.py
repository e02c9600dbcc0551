"""Policy specs, as the CLI takes them: `scripted:oracle`, `hf:DIR`, `openai:M@URL`, `vllm:M`, `py:module:Callable`.

Heavy backends (torch, transformers, vLLM) are imported only when their spec is used.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from typing import Any, Literal, get_args

from cgym.agents.base import Policy
from cgym.agents.options import PolicySpecError, SamplingOptions
from cgym.envs.errors import did_you_mean

SPEC_FORMS = (
    "scripted:<agent> (e.g. scripted:oracle)",
    "hf:<hub-name-or-local-dir> (e.g. hf:runs/tiny)",
    "openai:<model>@<base_url>[?timeout_s=60&max_retries=4&deadline_s=120&max_reply_bytes=1048576] (e.g. openai:Qwen/Qwen2.5-0.5B-Instruct@http://127.0.0.1:8000/v1)",
    "vllm:<hub-name-or-local-dir>",
    "guarded:<spec> (runtime validation + retries around any policy)",
    "prompted:<spec> (the prompt-only baseline: the article's rules in the system prompt)",
    "py:<module>:<callable> (your own policy: the callable is called with the SamplingOptions and returns a Policy;"
    " a Policy object is used as it is; the module is imported from the current directory or sys.path)",
)
KINDS = ("scripted", "hf", "openai", "vllm", "guarded", "prompted", "py")
ServedEngine = Literal["transformers", "vllm"]
"""The servers that training rollouts can come from, with a weight push each (see `trainer.samplers.served`)."""
SERVED_ENGINES: tuple[str, ...] = get_args(ServedEngine)


def parse_spec(spec: str) -> tuple[str, str]:
    """Split `kind:rest`, with a message listing every valid form when it fails."""
    kind, sep, rest = spec.partition(":")
    if not sep or not rest.strip() or kind not in KINDS:
        raise PolicySpecError(f"cannot read the policy spec {spec!r}.{did_you_mean(kind, KINDS)} Valid forms: {'; '.join(SPEC_FORMS)}")
    return kind, rest


def load_policy(spec: str, options: SamplingOptions | None = None, *, env_id: str | None = None) -> Policy:
    """Build the policy a spec names; `env_id`, when known, is the env it will play. The policy
    only samples: an `hf:` policy's model is packed for it (`HFPolicy.from_pretrained`'s
    `inference_only`); to train a model, load it with `HFPolicy.from_pretrained`."""
    kind, rest = parse_spec(spec)
    opts = options or SamplingOptions()
    if kind == "guarded":
        from cgym.agents.guard import GuardedPolicy

        return GuardedPolicy(load_policy(rest, opts, env_id=env_id))
    if kind == "prompted":
        from cgym.agents.prompting import PromptedPolicy

        return PromptedPolicy(load_policy(rest, opts, env_id=env_id))
    if kind == "scripted":
        from cgym.agents.scripted import ScriptedPolicy

        return ScriptedPolicy(rest, env_id=env_id)
    if kind == "py":
        return _user_policy(rest, opts)
    if kind == "hf":
        from cgym.agents.local.hf import HFPolicy

        return HFPolicy.from_pretrained(rest, sampling=opts, inference_only=True)
    if kind == "openai":
        from cgym.agents.remote.openai_client import OpenAIPolicy

        return OpenAIPolicy.from_spec(rest, sampling=opts)
    from cgym.agents.remote.vllm_policy import VLLMPolicy

    return VLLMPolicy.from_spec(rest, sampling=opts)


def _user_policy(rest: str, options: SamplingOptions) -> Policy:
    """`py:<module>:<callable>`: import the module, call the callable with `options` (or take a Policy as is)."""
    module_name, _, attr = rest.partition(":")
    spec = f"py:{rest}"
    if not module_name or not attr:
        raise PolicySpecError(f"cannot read the policy spec {spec!r}: expected py:<module>:<callable>, e.g. py:mypolicies:make_policy")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does, so a module next to the user's files imports
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise PolicySpecError(f"{spec}: cannot import {module_name!r}: {exc}") from None
    for part in attr.split("."):
        if not hasattr(target, part):
            names = [n for n in dir(target) if not n.startswith("_")]
            raise PolicySpecError(f"{spec}: {module_name} has no attribute {part!r}.{did_you_mean(part, names)}")
        target = getattr(target, part)
    policy = target if isinstance(target, Policy) and not isinstance(target, type) else _call_factory(spec, target, options)
    if not isinstance(policy, Policy) or isinstance(policy, type):
        raise PolicySpecError(f"{spec} gave {type(policy).__name__}, not a policy: a Policy has a `name` and an `act(batch)` method")
    return policy


def _call_factory(spec: str, factory: Any, options: SamplingOptions) -> Any:
    if not callable(factory):
        raise PolicySpecError(f"{spec} names a {type(factory).__name__}, neither a policy nor a callable that returns one")
    try:
        inspect.signature(factory).bind(options)
    except TypeError:
        raise PolicySpecError(f"{spec} must take one argument, the SamplingOptions (def make_policy(options) -> Policy)") from None
    except ValueError:  # a builtin without a signature: just call it
        pass
    return factory(options)
