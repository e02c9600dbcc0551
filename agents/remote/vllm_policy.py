"""A policy backed by in-process vLLM (`vllm.LLM`), for fast sampling on CUDA GPUs.

vLLM is an optional extra (`pip install 'critique-gym[vllm]'`); it is imported only when a
policy is built, so this module imports fine without it. Conversations go through the model's
own chat template (`LLM.chat`) with the env's tool schemas, and each turn comes back with its
sampled token ids and their log-probabilities.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from cgym.agents.base import Conversation, Message, Turn
from cgym.agents.options import DEFAULT_SAMPLING, SamplingOptions
from cgym.agents.remote.openai_client import PolicyError

INSTALL_HINT = "vLLM is not installed: pip install 'critique-gym[vllm]' (needs a CUDA GPU)"


class BackendUnavailableError(PolicyError, ImportError):
    """The optional inference backend (vLLM) or the hardware it needs is missing."""


class VLLMPolicy:
    """Samples one assistant turn per conversation with `vllm.LLM.chat`, batched in one call.

    `sampling` maps onto `vllm.SamplingParams` (its `max_new_tokens` is vLLM's `max_tokens`). Extra
    keyword arguments go to `vllm.LLM` (e.g. `gpu_memory_utilization`, `dtype`).
    """

    def __init__(
        self,
        model: str,
        *,
        sampling: SamplingOptions = DEFAULT_SAMPLING,
        **llm_kwargs: Any,
    ) -> None:
        vllm = import_vllm()
        self.model = model
        self.name = f"vllm:{model}"
        self._llm = vllm.LLM(model=model, seed=sampling.seed, **llm_kwargs)
        # logprobs=0: vLLM returns the sampled token's log-probability and no alternatives.
        self._sampling = vllm.SamplingParams(
            temperature=sampling.temperature, top_p=sampling.top_p, max_tokens=sampling.max_new_tokens, seed=sampling.seed, logprobs=0
        )

    @classmethod
    def from_spec(cls, rest: str, **options: Any) -> VLLMPolicy:
        """Build from the part of `vllm:<name-or-path>` after `vllm:`."""
        if not rest.strip():
            raise ValueError("bad vllm policy spec: expected vllm:<name-or-path>, e.g. vllm:Qwen/Qwen2.5-0.5B-Instruct")
        return cls(rest.strip(), **options)

    def act(self, batch: Sequence[Conversation]) -> list[Turn]:
        """Return one turn per conversation, in order (one batched vLLM call per distinct tool set)."""
        turns: list[Turn | None] = [None] * len(batch)
        for indices in _group_by_tools(batch):
            messages = [_chat_messages(batch[i].messages) for i in indices]
            tools = list(batch[indices[0]].tools) or None
            outputs = self._llm.chat(messages, self._sampling, use_tqdm=False, tools=tools)
            for i, output in zip(indices, outputs):
                turns[i] = _to_turn(output.outputs[0])
        assert all(turn is not None for turn in turns)
        return turns  # type: ignore[return-value]


def import_vllm() -> Any:
    try:
        import vllm
    except ImportError as exc:
        raise BackendUnavailableError(INSTALL_HINT) from exc
    import torch

    if not torch.cuda.is_available():
        raise PolicyError("vLLM needs a CUDA GPU, and torch.cuda.is_available() is False on this machine")
    return vllm


def _group_by_tools(batch: Sequence[Conversation]) -> list[list[int]]:
    """Indices of conversations sharing one tool list (`LLM.chat` takes one list per call)."""
    groups: dict[str, list[int]] = {}
    for i, conversation in enumerate(batch):
        groups.setdefault(json.dumps(conversation.tools, sort_keys=True), []).append(i)
    return list(groups.values())


def _chat_messages(messages: Sequence[Message]) -> list[Message]:
    """Messages for the chat template: the model's raw turns stay raw (its own Hermes text)."""
    keep = ("role", "content", "name")
    return [{key: m[key] for key in keep if key in m} for m in messages]


def _to_turn(completion: Any) -> Turn:
    token_ids = tuple(completion.token_ids)
    logprobs: tuple[float, ...] = ()
    if completion.logprobs:
        logprobs = tuple(step[token].logprob for step, token in zip(completion.logprobs, token_ids))
    return Turn(
        text=completion.text,
        token_ids=token_ids,
        logprobs=logprobs,
        truncated=completion.finish_reason == "length",
    )
