"""VLLMPolicy: importable without vLLM, a clear error when it cannot run, and turn assembly."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from typing import Any

import pytest
from cgym.agents.base import Conversation, Turn
from cgym.agents.remote.openai_client import PolicyError

VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None


def test_module_imports_without_vllm() -> None:
    module = importlib.import_module("cgym.agents.remote.vllm_policy")
    assert hasattr(module, "VLLMPolicy")


@pytest.mark.skipif(VLLM_INSTALLED, reason="vLLM is installed: the missing-backend error cannot happen here")
def test_constructing_without_vllm_gives_install_hint() -> None:
    from cgym.agents.remote.vllm_policy import BackendUnavailableError, VLLMPolicy

    with pytest.raises(BackendUnavailableError, match=r"pip install 'critique-gym\[vllm\]'") as info:
        VLLMPolicy.from_spec("Qwen/Qwen2.5-0.5B-Instruct")
    assert isinstance(info.value, ImportError) and isinstance(info.value, PolicyError)
    assert "CUDA GPU" in str(info.value)


def test_empty_spec_is_a_value_error() -> None:
    from cgym.agents.remote.vllm_policy import VLLMPolicy

    with pytest.raises(ValueError, match="vllm:<name-or-path>"):
        VLLMPolicy.from_spec("  ")


# ---- act() with a stand-in for vllm.LLM (no GPU needed) ----


@dataclass
class FakeLogprob:
    logprob: float


@dataclass
class FakeCompletion:
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, FakeLogprob]] | None
    finish_reason: str


@dataclass
class FakeRequestOutput:
    outputs: list[FakeCompletion]


@dataclass
class FakeLLM:
    calls: list[dict[str, Any]] = field(default_factory=list)

    def chat(self, messages: list, sampling_params: Any, *, use_tqdm: bool, tools: list | None) -> list:
        self.calls.append({"messages": messages, "tools": tools})
        outputs = []
        for conversation in messages:
            prompt = conversation[-1]["content"]
            ids = [len(prompt), 7]
            steps = [{ids[0]: FakeLogprob(-0.5), 99: FakeLogprob(-3.0)}, {7: FakeLogprob(-0.25)}]
            finish = "length" if "long" in prompt else "stop"
            outputs.append(FakeRequestOutput([FakeCompletion(f"re: {prompt}", ids, steps, finish)]))
        return outputs


def fake_policy() -> tuple[Any, FakeLLM]:
    from cgym.agents.remote.vllm_policy import VLLMPolicy

    policy = object.__new__(VLLMPolicy)  # skip __init__: no vLLM, no GPU
    llm = FakeLLM()
    policy._llm, policy._sampling, policy.name = llm, None, "vllm:fake"
    return policy, llm


TOOL_A = {"type": "function", "function": {"name": "a", "parameters": {"type": "object", "properties": {}}}}


def test_act_returns_ids_logprobs_in_order_grouped_by_tools() -> None:
    policy, llm = fake_policy()
    batch = [
        Conversation(messages=[{"role": "user", "content": "one"}], tools=[TOOL_A]),
        Conversation(messages=[{"role": "user", "content": "two long"}]),
        Conversation(messages=[{"role": "tool", "name": "a", "content": "three"}], tools=[TOOL_A]),
    ]
    turns = policy.act(batch)
    assert [t.text for t in turns] == ["re: one", "re: two long", "re: three"]
    assert turns[0] == Turn("re: one", token_ids=(3, 7), logprobs=(-0.5, -0.25), truncated=False)
    assert turns[1].truncated
    assert [call["tools"] for call in llm.calls] == [[TOOL_A], None]
    assert llm.calls[0]["messages"][1] == [{"role": "tool", "name": "a", "content": "three"}]
