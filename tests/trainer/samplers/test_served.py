"""ServedPolicy against mocked servers: the request continues the ledger, the reply lands in it,
seeds differ within a group, and each engine's weight push calls its documented routes."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import respx
from cgym.agents.base import Conversation
from cgym.agents.options import SamplingOptions
from cgym.agents.remote.openai_client import PolicyError
from cgym.envs.errors import ConfigError
from cgym.trainer.samplers.served import ServedPolicy
from transformers import AutoModelForCausalLM, AutoTokenizer

BASE = "http://served.test/v1"


@pytest.fixture(scope="module")
def tokenizer(tiny_chat_model: Path):
    return AutoTokenizer.from_pretrained(tiny_chat_model)


def _conversation() -> Conversation:
    return Conversation(messages=[{"role": "system", "content": "Answer."}, {"role": "user", "content": "Report the order."}])


def _completion(text: str, finish: str = "stop", **extra) -> dict:
    return {"choices": [{"text": text, "finish_reason": finish, **extra}]}


def _pushed(policy: ServedPolicy, model_name: str = "/models/step-0") -> ServedPolicy:
    policy.model = policy.transport.model = model_name
    policy.weights_step = 0
    return policy


@respx.mock
def test_transformers_request_continues_the_ledger_and_the_reply_is_recorded(tokenizer) -> None:
    route = respx.post(f"{BASE}/completions").mock(return_value=httpx.Response(200, json=_completion('{"total": 3}')))
    policy = _pushed(ServedPolicy(tokenizer, BASE, sampling=SamplingOptions(temperature=0.7, max_new_tokens=16)))
    conv = _conversation()
    turn = policy.act([conv])[0]

    body = json.loads(route.calls[0].request.content)
    prompt_len = conv.prompt_len
    assert body["model"] == "/models/step-0"
    assert body["prompt"] == tokenizer.decode(conv.token_ids[:prompt_len], skip_special_tokens=False)
    generation = json.loads(body["generation_config"])
    assert generation == {"max_new_tokens": 16, "do_sample": True, "eos_token_id": policy.stop_ids, "top_k": 0}
    assert set(body) == {"model", "prompt", "max_tokens", "temperature", "top_p", "seed", "generation_config"}  # transformers serve rejects others

    sampled = policy.encoder.encode_text('{"total": 3}') + [policy.encoder.end_of_turn_id]
    assert conv.token_ids[prompt_len:] == sampled
    assert conv.loss_mask[prompt_len:] == [1] * len(sampled)
    assert turn.text == '{"total": 3}' and not turn.truncated


@respx.mock
def test_a_cut_reply_is_truncated_and_closed_unsampled(tokenizer) -> None:
    respx.post(f"{BASE}/completions").mock(return_value=httpx.Response(200, json=_completion("partial", "length")))
    policy = _pushed(ServedPolicy(tokenizer, BASE))
    conv = _conversation()
    turn = policy.act([conv])[0]
    assert turn.truncated
    assert conv.token_ids[-1] == policy.encoder.end_of_turn_id and conv.loss_mask[-1] == 0


@respx.mock
def test_group_requests_get_distinct_seeds_and_reseed_repeats_them(tokenizer) -> None:
    route = respx.post(f"{BASE}/completions").mock(return_value=httpx.Response(200, json=_completion("x")))
    policy = _pushed(ServedPolicy(tokenizer, BASE, concurrency=4))
    seeds = []
    for _ in range(2):
        policy.reseed(100)
        policy.act([_conversation() for _ in range(4)])
        seeds.append(sorted(json.loads(call.request.content)["seed"] for call in route.calls[-4:]))
    assert seeds[0] == seeds[1] == [100, 101, 102, 103]


@respx.mock
@pytest.mark.parametrize("form", ["token_ids", "named_tokens"])
def test_vllm_reply_token_ids_and_logprobs_go_into_the_ledger(tokenizer, form: str) -> None:
    policy = _pushed(ServedPolicy(tokenizer, BASE, engine="vllm"), "cgym-step-0")
    eot = policy.encoder.end_of_turn_id
    ids = policy.encoder.encode_text("ok") + [eot]
    logprobs = [-0.5 - i for i in range(len(ids))]
    if form == "token_ids":  # vLLM >= 0.10.2 with return_token_ids
        reply = _completion("ok", token_ids=ids, logprobs={"tokens": ["?"] * len(ids), "token_logprobs": logprobs})
    else:  # return_tokens_as_token_ids
        reply = _completion("ok", logprobs={"tokens": [f"token_id:{i}" for i in ids], "token_logprobs": logprobs})
    route = respx.post(f"{BASE}/completions").mock(return_value=httpx.Response(200, json=reply))
    conv = _conversation()
    turn = policy.act([conv])[0]

    body = json.loads(route.calls[0].request.content)
    assert body["prompt"] == conv.token_ids[: conv.prompt_len]  # token ids, not text
    assert body["model"] == "cgym-step-0" and body["return_tokens_as_token_ids"] and body["stop_token_ids"] == policy.stop_ids
    assert conv.token_ids[conv.prompt_len :] == ids
    assert conv.logprobs[conv.prompt_len :] == pytest.approx(logprobs)
    assert turn.text == "ok"


@respx.mock
def test_a_prompt_the_server_tokenized_differently_is_counted(tokenizer) -> None:
    respx.post(f"{BASE}/completions").mock(return_value=httpx.Response(200, json={"choices": [{"text": "a", "finish_reason": "stop"}], "usage": {"prompt_tokens": 1}}))
    policy = _pushed(ServedPolicy(tokenizer, BASE))
    policy.act([_conversation()])
    assert policy.prompt_mismatches == 1


@respx.mock
def test_push_saves_a_checkpoint_names_it_in_requests_and_resets_the_server(tokenizer, tiny_chat_model: Path, tmp_path: Path) -> None:
    reset = respx.post("http://served.test/reset").mock(return_value=httpx.Response(200, json={"status": "ok"}))
    route = respx.post(f"{BASE}/completions").mock(return_value=httpx.Response(200, json=_completion("x")))
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model)
    policy = ServedPolicy(tokenizer, BASE)
    with pytest.raises(PolicyError, match="no weights pushed"):
        policy.act([_conversation()])

    policy.push(model, 0, tmp_path)
    policy.push(model, 1, tmp_path)
    policy.act([_conversation()])

    assert reset.call_count == 2
    assert json.loads(route.calls[0].request.content)["model"] == str(tmp_path.resolve() / "step-1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]  # the older version is removed, no temp dir left
    assert (tmp_path / "step-1" / "config.json").exists() and policy.weights_step == 1


class _FakeLoraModel:
    peft_config: dict = {"default": None}

    def save_pretrained(self, path: Path) -> None:
        Path(path).mkdir(parents=True)
        (Path(path) / "adapter_config.json").write_text("{}")


@respx.mock
def test_vllm_push_hot_loads_the_adapter_and_unloads_the_previous_one(tokenizer, tmp_path: Path) -> None:
    load = respx.post(f"{BASE}/load_lora_adapter").mock(return_value=httpx.Response(200, text="Success"))
    unload = respx.post(f"{BASE}/unload_lora_adapter").mock(return_value=httpx.Response(200, text="Success"))
    policy = ServedPolicy(tokenizer, BASE, engine="vllm")
    policy.push(_FakeLoraModel(), 0, tmp_path)
    policy.push(_FakeLoraModel(), 1, tmp_path)

    assert [json.loads(c.request.content) for c in load.calls] == [
        {"lora_name": "cgym-step-0", "lora_path": str(tmp_path.resolve() / "step-0")},
        {"lora_name": "cgym-step-1", "lora_path": str(tmp_path.resolve() / "step-1")},
    ]
    assert [json.loads(c.request.content) for c in unload.calls] == [{"lora_name": "cgym-step-0"}]
    assert policy.model == "cgym-step-1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]  # the unloaded adapter's files are removed


def test_vllm_push_without_lora_is_a_config_error(tokenizer, tiny_chat_model: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="lora_r"):
        ServedPolicy(tokenizer, BASE, engine="vllm").push(AutoModelForCausalLM.from_pretrained(tiny_chat_model), 0, tmp_path)


@respx.mock
def test_a_refused_push_stops_with_the_servers_reason(tokenizer, tiny_chat_model: Path, tmp_path: Path) -> None:
    respx.post("http://served.test/reset").mock(return_value=httpx.Response(500, text="out of memory"))
    with pytest.raises(PolicyError, match="500: out of memory"):
        ServedPolicy(tokenizer, BASE).push(AutoModelForCausalLM.from_pretrained(tiny_chat_model), 0, tmp_path)
