"""Policy specs: one sampling-settings type reaches every backend, and `py:module:Callable` runs a user's policy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import cgym.agents.remote.vllm_policy
import pytest
from cgym.agents.options import PolicySpecError, SamplingOptions
from cgym.agents.spec import load_policy
from cgym.envs.errors import CgymError, ConfigError

HERE = Path(__file__).parent


@pytest.fixture
def user_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(HERE))


def test_py_spec_calls_the_factory_with_the_sampling_options(user_modules: None) -> None:
    options = SamplingOptions(temperature=0.3, max_new_tokens=12, seed=5)
    policy = load_policy("py:custom_policy:make_policy", options)
    assert policy.name == "custom-oracle" and policy.options == options  # type: ignore[attr-defined]


def test_py_spec_takes_a_policy_object_as_it_is(user_modules: None) -> None:
    import custom_policy

    assert load_policy("py:custom_policy:READY") is custom_policy.READY


def test_py_spec_wraps_like_any_spec(user_modules: None) -> None:
    assert load_policy("guarded:py:custom_policy:make_policy").name == "guarded:custom-oracle"


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        pytest.param("py:no_such_module_xyz:make", "cannot import 'no_such_module_xyz'", id="module-missing"),
        pytest.param("py:custom_policy:make_polcy", "has no attribute 'make_polcy'. Did you mean 'make_policy'?", id="attribute-missing"),
        pytest.param("py:custom_policy:not_a_policy", "gave str, not a policy", id="returns-a-non-policy"),
        pytest.param("py:custom_policy:NUMBER", "neither a policy nor a callable", id="not-callable"),
        pytest.param("py:custom_policy:takes_nothing", "must take one argument, the SamplingOptions", id="wrong-arity"),
        pytest.param("py:custom_policy", "expected py:<module>:<callable>", id="no-callable"),
    ],
)  # fmt: skip
def test_py_spec_errors_are_policy_spec_errors(spec: str, expected: str, user_modules: None) -> None:
    with pytest.raises(PolicySpecError) as info:
        load_policy(spec)
    assert expected in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("options", "field"),
    [
        pytest.param({"temperature": -0.1}, "temperature", id="temperature"),
        pytest.param({"top_p": 0.0}, "top_p", id="top-p"),
        pytest.param({"max_new_tokens": 0}, "max_new_tokens", id="max-new-tokens"),
        pytest.param({"seed": -1}, "seed", id="seed"),
    ],
)
def test_sampling_options_reject_out_of_range_values(options: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field) as info:
        SamplingOptions(**options)
    assert isinstance(info.value, CgymError) and isinstance(info.value, ValueError)


def test_sampling_options_reach_vllm_policies(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    class FakeVLLM:
        def LLM(self, **kwargs: Any) -> object:  # noqa: N802 - vllm's name
            seen["llm"] = kwargs
            return object()

        def SamplingParams(self, **kwargs: Any) -> object:  # noqa: N802
            seen["sampling"] = kwargs
            return object()

    monkeypatch.setattr(cgym.agents.remote.vllm_policy, "import_vllm", FakeVLLM)
    load_policy("vllm:some/model", SamplingOptions(temperature=0.2, top_p=0.9, max_new_tokens=64, seed=7))
    assert seen["sampling"] == {"temperature": 0.2, "top_p": 0.9, "max_tokens": 64, "seed": 7, "logprobs": 0}
    assert seen["llm"] == {"model": "some/model", "seed": 7}


def test_every_backend_takes_the_sampling_settings_as_one_object() -> None:
    """No backend restates a sampling field: each takes `sampling`, defaulting to SamplingOptions()."""
    import inspect

    from cgym.agents.local.hf import HFPolicy
    from cgym.agents.remote.openai_client import OpenAIPolicy
    from cgym.trainer.samplers.served import ServedPolicy
    from cgym.trainer.samplers.vllm_sampler import VLLMSampler

    fields = {"temperature", "top_p", "max_new_tokens", "max_tokens", "seed"}
    for backend in (HFPolicy, OpenAIPolicy, cgym.agents.remote.vllm_policy.VLLMPolicy, ServedPolicy, VLLMSampler):
        params = inspect.signature(backend).parameters
        assert params["sampling"].default == SamplingOptions() and not fields & set(params), backend.__name__
