"""Rollouts from a served model, for training: the trainer pushes its weights, this keeps the ledger.

`ServedPolicy` samples each turn from an OpenAI-compatible server's `/v1/completions` and keeps
each conversation's token ledger here, laid out by the local chat template, so the trainer
learns from the tokens the server continued. Two engines, each with its documented routes:

- `transformers` (`transformers serve`): the prompt goes as the ledger's text (the server takes a
  string and tokenizes it again; `prompt_mismatches` counts replies whose prompt token count
  differs from the ledger's). A push saves a full checkpoint under `directory/step-N`, names it in
  every later request's `model` field (the server loads a model by path on first use) and calls
  `/reset` so the server drops the previous version. The reply is text only: its ids are the local
  tokenization of that text and its log-probs are 0.
- `vllm` (`vllm serve --enable-lora`, with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`): the prompt
  goes as token ids, and the reply's token ids and log-probs come back (`return_token_ids`, or
  `return_tokens_as_token_ids` before vLLM 0.10.2). A push saves the LoRA adapter and hot-loads it with
  `/v1/load_lora_adapter` under a new name, then unloads the previous one; so vLLM serving
  needs LoRA training (`lora_r` > 0).

Either way the trainer takes the old log-probs from its own training pass (as it does for a bf16
sampler), so a server's numerics never reach the clipped ratio.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import httpx
import torch
from cgym.agents.base import Conversation, Turn
from cgym.agents.ledger import ChatEncoder
from cgym.agents.options import DEFAULT_SAMPLING, SamplingOptions
from cgym.agents.remote.openai_client import OpenAIPolicy, PolicyError
from cgym.agents.spec import SERVED_ENGINES, ServedEngine
from cgym.envs.errors import ConfigError
from transformers import PreTrainedTokenizerBase

TOKEN_ID_PREFIX = "token_id:"  # how vLLM names a token with return_tokens_as_token_ids


class PushedSampler(Protocol):
    """What samples the trainer's rollouts when the weights it samples from live outside the
    trainer's model: a server (`ServedPolicy`) or an in-process vLLM engine
    (`trainer.samplers.vllm_sampler.VLLMSampler`). `push` hands it the current weights."""

    name: str
    weights_step: int | None
    prompt_mismatches: int
    returns_logprobs: bool

    def act(self, batch: Sequence[Conversation]) -> list[Turn]: ...

    def reseed(self, seed: int) -> None: ...

    def push(self, model: torch.nn.Module, step: int, directory: str | Path) -> float: ...

    def close(self) -> None: ...


class ServedPolicy:
    """Takes turns from a server that runs the trainer's latest pushed weights.

    `weights_step` is the step whose weights the server holds (None before the first `push`).
    Requests in a batch run concurrently; request i of a batch is seeded `seed + n`, n counting
    every request since the last `reseed`, so the G samples of one prompt differ and a run
    repeats on an engine that honours `seed`.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        base_url: str,
        *,
        engine: ServedEngine = "transformers",
        model: str = "",
        sampling: SamplingOptions = DEFAULT_SAMPLING,
        concurrency: int = 8,
        timeout_s: float = 300.0,
        client: httpx.Client | None = None,
    ) -> None:
        if engine not in SERVED_ENGINES:
            raise ConfigError(f"engine={engine!r}: choose one of {list(SERVED_ENGINES)}")
        self.tokenizer = tokenizer
        self.encoder = ChatEncoder(tokenizer)
        self.engine = engine
        self.model = model or "unpushed"
        self.transport = OpenAIPolicy(
            self.model, base_url, sampling=sampling,
            timeout_s=timeout_s, deadline_s=timeout_s * 2, concurrency=concurrency, native_tools=False, client=client,
        )  # fmt: skip
        self.base_url = self.transport.base_url
        self.name = f"served:{engine}@{self.base_url}"
        self.stop_ids = stop_ids(self.encoder)
        self.returns_logprobs = engine == "vllm"  # transformers serve's completions carry text only
        self.weights_step: int | None = None
        self.prompt_mismatches = 0
        self._weights_dir: Path | None = None
        self._seed = sampling.seed
        self._requests = 0

    def reseed(self, seed: int) -> None:
        """Seed the next requests from `seed` (the trainer calls this per rollout batch)."""
        self._seed, self._requests = seed, 0

    def close(self) -> None:
        self.transport.close()

    # -- taking turns ---------------------------------------------------------------------
    def act(self, batch: Sequence[Conversation]) -> list[Turn]:
        """Sync the ledgers, ask the server for one turn each (concurrently), record them."""
        if self.weights_step is None:
            raise PolicyError(f"{self.name}: no weights pushed yet; call push(model, step, directory) first")
        for conv in batch:
            self.encoder.sync(conv)
        bodies = [self.request_body(conv, seed=self._seed + self._requests + i) for i, conv in enumerate(batch)]
        self._requests += len(batch)
        replies = self.transport.post_many(bodies, "completions")
        return [self._record(conv, reply) for conv, reply in zip(batch, replies, strict=True)]

    def request_body(self, conv: Conversation, *, seed: int) -> dict[str, Any]:
        """The `/v1/completions` body that continues `conv`'s ledger, in this engine's dialect."""
        s = self.transport.sampling
        body: dict[str, Any] = {"model": self.model, "max_tokens": s.max_new_tokens, "temperature": s.temperature, "top_p": s.top_p, "seed": seed}
        if self.engine == "vllm":
            return body | {
                "prompt": list(conv.token_ids), "stop_token_ids": self.stop_ids, "logprobs": 1,
                "return_token_ids": True, "return_tokens_as_token_ids": True, "skip_special_tokens": False,
            }  # fmt: skip
        # transformers serve rejects unknown fields; its own `generation_config` field carries the
        # stop ids, and top_k 0 keeps it from cutting the distribution (the in-process sampler does not)
        generation = {"max_new_tokens": s.max_new_tokens, "do_sample": s.temperature > 0, "eos_token_id": self.stop_ids, "top_k": 0}
        return body | {"prompt": self.tokenizer.decode(conv.token_ids, skip_special_tokens=False), "generation_config": json.dumps(generation)}

    def _record(self, conv: Conversation, reply: dict[str, Any]) -> Turn:
        choice = _first_choice(reply)
        prompt_tokens = (reply.get("usage") or {}).get("prompt_tokens")
        if isinstance(prompt_tokens, int) and prompt_tokens != len(conv.token_ids):
            self.prompt_mismatches += 1
        ids, logprobs, text = self._sampled(choice)
        return record_turn(self.encoder, self.stop_ids, conv, ids, logprobs, text, choice.get("finish_reason"))

    def _sampled(self, choice: dict[str, Any]) -> tuple[list[int], list[float], str]:
        """The reply's token ids, log-probs and text (the text without the end-of-turn token)."""
        text = choice.get("text")
        if not isinstance(text, str):
            raise PolicyError(f"{self.name}: choices[0].text must be a string, got {type(text).__name__}")
        served = _served_tokens(choice)
        if served is None:
            ids = self.encoder.encode_text(text)
            return ids, [0.0] * len(ids), text
        ids, logprobs = served
        return ids, logprobs, reply_text(self.tokenizer, ids, self.stop_ids)

    # -- weights ----------------------------------------------------------------------------
    def push(self, model: torch.nn.Module, step: int, directory: str | Path) -> float:
        """Make the server sample from `model`'s current weights, saved under `directory`; seconds taken."""
        started = time.perf_counter()
        target = Path(directory).resolve() / f"step-{step}"
        target.parent.mkdir(parents=True, exist_ok=True)
        previous = self._weights_dir
        self.model = self._push_lora(model, step, target) if self.engine == "vllm" else self._push_checkpoint(model, target)
        self.transport.model = self.model
        if previous is not None and previous != target and previous.exists():
            shutil.rmtree(previous)  # only the version the server now serves is kept on disk
        self._weights_dir, self.weights_step = target, step
        return time.perf_counter() - started

    def _push_checkpoint(self, model: torch.nn.Module, target: Path) -> str:
        save_atomic(target, lambda path: (model.save_pretrained(path), self.tokenizer.save_pretrained(path)))
        self._control(f"{self.base_url.removesuffix('/v1')}/reset", {})  # unload the previous version
        return str(target)

    def _push_lora(self, model: torch.nn.Module, step: int, target: Path) -> str:
        if not hasattr(model, "peft_config"):
            raise ConfigError("engine 'vllm' hot-loads LoRA adapters: train with lora_r > 0 (the lora extra), or serve with transformers serve")
        save_atomic(target, model.save_pretrained)
        name = f"cgym-step-{step}"
        self._control(f"{self.base_url}/load_lora_adapter", {"lora_name": name, "lora_path": str(target)})
        if self.weights_step is not None and self.model != name:
            self._control(f"{self.base_url}/unload_lora_adapter", {"lora_name": self.model})
        return name

    def _control(self, url: str, body: dict[str, Any]) -> None:
        """One management call (no retries: a failed push must stop the run, not train on stale weights)."""
        try:
            response = self.transport._client.post(url, json=body, timeout=self.transport.timeout_s)
        except httpx.HTTPError as exc:
            raise PolicyError(f"{url} could not be reached to push the weights: {type(exc).__name__}: {exc}") from None
        if response.status_code >= 400:
            raise PolicyError(f"{url} refused the weight push with {response.status_code}: {response.text[:300]}")


def stop_ids(encoder: ChatEncoder) -> list[int]:
    """The ids that end a sampled turn: the template's end-of-turn token and the tokenizer's eos."""
    eos = encoder.tokenizer.eos_token_id
    return sorted({encoder.end_of_turn_id} | ({eos} if eos is not None else set()))


def reply_text(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], stop_ids: Sequence[int]) -> str:
    """The text of a sampled turn's ids, without the stop id it ended on."""
    shown = ids[:-1] if ids and ids[-1] in stop_ids else ids
    return tokenizer.decode(list(shown), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def record_turn(
    encoder: ChatEncoder, stop_ids: Sequence[int], conv: Conversation, ids: list[int], logprobs: list[float], text: str, finish_reason: str | None
) -> Turn:
    """Append a turn sampled elsewhere to `conv`'s ledger, closed as the in-process sampler closes it.

    A reply that ends on another stop id (an eos) loses that id and leaves the turn open; one
    that stopped without showing the end-of-turn token gets it back, with log-prob 0.
    """
    stopped = finish_reason == "stop"
    eot = encoder.end_of_turn_id
    if ids and ids[-1] in stop_ids and ids[-1] != eot:
        ids, logprobs = ids[:-1], logprobs[:-1]
        stopped = False
    elif stopped and (not ids or ids[-1] != eot):
        ids, logprobs = [*ids, eot], [*logprobs, 0.0]
    encoder.append_sampled(conv, ids, logprobs, ended=stopped and bool(ids) and ids[-1] == eot)
    return Turn(text=text, token_ids=tuple(ids), logprobs=tuple(logprobs), truncated=finish_reason == "length")


def _first_choice(reply: dict[str, Any]) -> dict[str, Any]:
    choices = reply.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise PolicyError(f"the server's completion has no choices[0] object: {str(reply)[:300]}")
    return choices[0]


def _served_tokens(choice: dict[str, Any]) -> tuple[list[int], list[float]] | None:
    """The reply's sampled token ids and log-probs, where the server sent ids: vLLM's
    `token_ids` (with `return_token_ids`, vLLM >= 0.10.2) or its `"token_id:N"` tokens (with
    `return_tokens_as_token_ids`); log-probs from `logprobs.token_logprobs` (0 where absent).
    None when the reply carries no token ids."""
    logprobs = choice.get("logprobs") if isinstance(choice.get("logprobs"), dict) else {}
    tokens, values = logprobs.get("tokens"), logprobs.get("token_logprobs")
    ids = choice.get("token_ids")
    if not (isinstance(ids, list) and all(isinstance(i, int) for i in ids)):
        named = isinstance(tokens, list) and all(isinstance(t, str) and t.startswith(TOKEN_ID_PREFIX) and t[len(TOKEN_ID_PREFIX) :].isdigit() for t in tokens)
        if not named:
            return None
        ids = [int(t[len(TOKEN_ID_PREFIX) :]) for t in tokens]
    if not isinstance(values, list) or len(values) != len(ids):
        values = [0.0] * len(ids)
    return list(ids), [float(v) if isinstance(v, (int, float)) else 0.0 for v in values]


def save_atomic(target: Path, write: Callable[[Path], object]) -> Path:
    """`write(tmp)`, then rename tmp to `target`, so the server never loads a half-written version."""
    tmp = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target
