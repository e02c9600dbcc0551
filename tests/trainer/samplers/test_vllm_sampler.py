"""The in-process vLLM sampler for training, against a fake `vllm` module shaped like its API
(vLLM needs a CUDA GPU; `benchmarks/gpu_check.py` runs the real one where there is a GPU)."""

from __future__ import annotations

import json
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from cgym.agents.base import Conversation
from cgym.agents.ledger import ChatEncoder
from cgym.agents.options import SamplingOptions
from cgym.agents.remote.openai_client import PolicyError
from cgym.envs.errors import ConfigError
from cgym.trainer.config import TrainConfig
from cgym.trainer.distributed import training_device
from cgym.trainer.samplers.vllm_sampler import VLLMSampler, lora_rank_bound
from transformers import AutoModelForCausalLM, AutoTokenizer


@dataclass
class _Logprob:
    logprob: float


@dataclass
class _Completion:
    token_ids: list[int]
    logprobs: list[dict[int, _Logprob]]
    finish_reason: str


@dataclass
class _Output:
    outputs: list[_Completion]


class _SamplingParams:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs


@dataclass
class _LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str


@dataclass
class _Worker:
    loaded: list[list[str]] = field(default_factory=list)

    @property
    def model_runner(self) -> Any:
        return types.SimpleNamespace(model=types.SimpleNamespace(load_weights=lambda weights: self.loaded.append([n for n, _ in weights])))


class _LLM:
    """Replies with `reply` ids (their log-prob -0.5 each), the way `LLM.generate` returns them."""

    last: _LLM | None = None
    reply: tuple[list[int], str] = ([], "stop")

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.worker = _Worker()
        self.calls: list[dict[str, Any]] = []
        self.resets = 0
        _LLM.last = self

    def generate(self, prompts: list[dict], params: list[_SamplingParams], *, use_tqdm: bool, lora_request: Any) -> list[_Output]:
        self.calls.append({"prompts": prompts, "params": [p.kwargs for p in params], "lora": lora_request})
        ids, finish = _LLM.reply
        return [_Output([_Completion(list(ids), [{i: _Logprob(-0.5)} for i in ids], finish)]) for _ in prompts]

    def collective_rpc(self, method: Any, args: tuple = ()) -> list[Any]:
        return [method(self.worker, *args)]

    def reset_prefix_cache(self) -> None:
        self.resets += 1


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> type[_LLM]:
    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams = _LLM, _SamplingParams  # type: ignore[attr-defined]
    lora, request = types.ModuleType("vllm.lora"), types.ModuleType("vllm.lora.request")
    request.LoRARequest = _LoRARequest  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.lora", lora)
    monkeypatch.setitem(sys.modules, "vllm.lora.request", request)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    _LLM.reply = ([], "stop")
    return _LLM


def _conversation() -> Conversation:
    return Conversation(messages=[{"role": "system", "content": "Answer."}, {"role": "user", "content": "Say a word."}])


def test_turns_continue_the_ledger_with_vllms_tokens_and_logprobs(fake_vllm, tiny_chat_model: Path, tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model)
    eot = ChatEncoder(tokenizer).end_of_turn_id
    word = tokenizer.encode("alpha", add_special_tokens=False)
    sampler = VLLMSampler(tokenizer, str(tiny_chat_model), sampling=SamplingOptions(temperature=0.7, max_new_tokens=9, seed=5))
    conv = _conversation()
    with pytest.raises(PolicyError, match="no weights pushed"):
        sampler.act([conv])

    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model)
    sampler.push(model, 0, tmp_path)
    llm = fake_vllm.last
    assert llm is not None and llm.kwargs["enable_prefix_caching"] and llm.kwargs["gpu_memory_utilization"] == 0.3
    assert llm.worker.loaded == [list(model.state_dict())] and llm.resets == 1
    assert sampler.weights_step == 0

    fake_vllm.reply = ([*word, eot], "stop")
    before = len(conv.token_ids) if conv.token_ids else 0
    turns = sampler.act([conv, _conversation()])
    call = llm.calls[-1]
    assert call["prompts"][0]["prompt_token_ids"] == list(conv.token_ids[: len(call["prompts"][0]["prompt_token_ids"])])
    assert before == 0 and len(call["prompts"][0]["prompt_token_ids"]) > 0
    assert [p["seed"] for p in call["params"]] == [5, 6]
    assert call["params"][0] | {"seed": 0} == {
        "temperature": 0.7, "top_p": 1.0, "max_tokens": 9, "seed": 0, "logprobs": 0, "stop_token_ids": sampler.stop_ids, "skip_special_tokens": False,
    }  # fmt: skip
    assert turns[0].text == "alpha" and list(turns[0].token_ids) == [*word, eot]
    assert list(conv.logprobs[-len(word) - 1 :]) == [-0.5] * (len(word) + 1)
    assert list(conv.loss_mask[-len(word) - 1 :]) == [1] * (len(word) + 1)

    sampler.reseed(5)
    fake_vllm.reply = (word, "length")
    cut = sampler.act([_conversation()])[0]
    assert llm.calls[-1]["params"][0]["seed"] == 5 and cut.truncated


def test_a_lora_push_names_a_new_adapter_and_keeps_only_the_newest(fake_vllm, tiny_chat_model: Path, tmp_path: Path) -> None:
    class _Adapter(torch.nn.Module):  # what the sampler needs of a peft model: peft_config, save_pretrained
        peft_config: dict = {"default": None}

        def save_pretrained(self, path: Path) -> None:
            Path(path).mkdir(parents=True)
            (Path(path) / "adapter_config.json").write_text("{}")

    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model)
    sampler = VLLMSampler(tokenizer, str(tiny_chat_model), lora_r=4)
    llm = fake_vllm.last
    assert llm is not None and (llm.kwargs["enable_lora"], llm.kwargs["max_lora_rank"], llm.kwargs["max_loras"]) == (True, 8, 1)
    sampler.push(_Adapter(), 1, tmp_path)
    sampler.push(_Adapter(), 2, tmp_path)
    sampler.act([_conversation()])
    assert llm.calls[-1]["lora"] == _LoRARequest("cgym-step-2", 3, str((tmp_path / "step-2").resolve()))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2"] and llm.worker.loaded == []
    with pytest.raises(ValueError, match="no adapter"):
        sampler.push(torch.nn.Linear(1, 1), 3, tmp_path)


def test_lora_rank_bound_is_the_smallest_rank_vllm_takes() -> None:
    assert [lora_rank_bound(r) for r in (1, 2, 8, 9, 64, 512)] == [1, 8, 8, 16, 64, 512]
    with pytest.raises(ValueError, match="largest"):
        lora_rank_bound(513)


def test_training_samples_from_in_process_vllm_and_pushes_each_step(fake_vllm, tiny_chat_model: Path, tmp_path: Path) -> None:
    """`served='vllm:'`: the trainer builds the sampler on the starting model, pushes the
    full state dict before step 1 and after each step, and learns from vLLM's tokens."""
    from cgym.trainer.grpo import train

    from tests.agents.test_serve_integration import _OneWord

    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model)
    eot = ChatEncoder(tokenizer).end_of_turn_id
    fake_vllm.reply = ([*tokenizer.encode("banana", add_special_tokens=False), eot], "stop")
    out = tmp_path / "run"
    config = TrainConfig(
        env_id="one-word", model=str(tiny_chat_model), out=str(out), steps=2, group_size=2, tasks_per_step=1,
        sampling=SamplingOptions(max_new_tokens=6), eval_episodes=0, progress=False, served="vllm:", vllm_memory=0.5, lora_r=0,
    )  # fmt: skip
    train(config, make_env=lambda split: _OneWord())
    llm = fake_vllm.last
    assert llm is not None and llm.kwargs["model"] == str(tiny_chat_model) and llm.kwargs["gpu_memory_utilization"] == 0.5
    assert len(llm.worker.loaded) == 3 and llm.resets == 3  # the start, then after steps 1 and 2
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["served/weights_step"] for r in rows] == [0, 1]
    assert all(r["train_tokens"] > 0 for r in rows)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"served": "vllm"}, "in-process vLLM"),
        ({"served": "vllm:", "vllm_memory": 0.0}, "vllm_memory"),
        ({"device": "gpu"}, "device must be"),
        ({"device": "cuda:x"}, "device must be"),
    ],
)
def test_bad_in_process_settings_are_config_errors(fields: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        TrainConfig(model="tiny", **fields)


def test_a_cuda_device_without_a_gpu_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert training_device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match="no CUDA GPU"):
        training_device("cuda")
    assert TrainConfig(model="tiny", served="vllm:", device="cuda:1").device == "cuda:1"


def test_a_packed_batch_moves_to_the_training_device_whole() -> None:
    from cgym.trainer.rollout import Trajectory, pack

    trajs = [Trajectory([1, 2, 3], [0, 1, 1], [0.0, -0.1, -0.2], 1.0, True, 0, False), Trajectory([1, 2], [0, 1], [0.0, -0.3], 0.0, False, 0, False)]
    batch = pack(trajs, torch.tensor([0.5, -0.5]), pad_id=0)
    assert batch.to("cpu") is batch
    moved = batch.to("meta")
    assert all(t.device.type == "meta" for t in (moved.ids, moved.attention, moved.mask, moved.old_logp, moved.advantages, moved.shaped))
    assert moved.ids.shape == batch.ids.shape and moved.shaped.dtype == torch.bool


def test_a_bare_cuda_device_is_the_ranks_own_and_a_missing_one_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    chosen: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert training_device("cuda") == torch.device("cuda", 1) and chosen == [torch.device("cuda", 1)]
    assert training_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(ConfigError, match="does not exist"):
        training_device("cuda:2")
