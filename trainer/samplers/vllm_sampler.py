"""Rollouts from an in-process vLLM engine on this machine's GPU, for training (`served="vllm:"`).

`VLLMSampler` is `ServedPolicy`'s in-process sibling: the ledger stays on the trainer's side,
laid out by the local chat template, and each turn continues it with `vllm.LLM.generate` on its
token ids, so the trainer learns from exactly the tokens vLLM sampled, with their log-probs.
A push hands vLLM the trainer's current weights, through vLLM's public entry points:

- LoRA training (`lora_r` > 0): the adapter is saved under `directory/step-N` and every later
  `generate` names it in a new `LoRARequest` (vLLM loads an adapter by path on first use);
- full fine-tuning: the state dict goes to every worker with `LLM.collective_rpc`, each worker's
  model takes it with `load_weights`, and the prefix cache is reset so no key or value computed
  by the old weights is reused.

vLLM is optional and needs a CUDA GPU; it is imported only when a sampler is built.
"""

from __future__ import annotations

import importlib
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from cgym.agents.base import Conversation, Turn
from cgym.agents.ledger import ChatEncoder
from cgym.agents.options import DEFAULT_SAMPLING, SamplingOptions
from cgym.agents.remote.openai_client import PolicyError
from cgym.agents.remote.vllm_policy import import_vllm
from cgym.trainer.samplers.served import record_turn, reply_text, save_atomic, stop_ids
from transformers import PreTrainedTokenizerBase

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts


class VLLMSampler:
    """Takes turns from a `vllm.LLM` holding the trainer's latest pushed weights.

    `weights_step` is the step whose weights vLLM holds (None before the first `push`). Request
    i of a batch is seeded `seed + n`, n counting every request since the last `reseed`, so the
    G samples of one prompt differ and a run repeats. Extra keyword arguments go to `vllm.LLM`.
    """

    returns_logprobs = True
    prompt_mismatches = 0  # the prompt goes as the ledger's own ids

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        model: str,
        *,
        lora_r: int = 0,
        gpu_memory_utilization: float = 0.3,
        sampling: SamplingOptions = DEFAULT_SAMPLING,
        **llm_kwargs: Any,
    ) -> None:
        self._vllm = import_vllm()
        self.tokenizer = tokenizer
        self.encoder = ChatEncoder(tokenizer)
        self.stop_ids = stop_ids(self.encoder)
        self.name = f"vllm-in-process:{model}"
        self.lora_r = lora_r
        if lora_r > 0:
            llm_kwargs |= {"enable_lora": True, "max_lora_rank": lora_rank_bound(lora_r), "max_loras": 1}
        # the trainer's model shares the GPU, so vLLM gets a fraction of its memory
        self.llm = self._vllm.LLM(model=model, seed=sampling.seed, gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=True, **llm_kwargs)
        self.sampling = sampling
        self.weights_step: int | None = None
        self._lora: Any = None
        self._adapter_dir: Path | None = None
        self._seed, self._requests = sampling.seed, 0

    def reseed(self, seed: int) -> None:
        """Seed the next requests from `seed` (the trainer calls this per rollout batch)."""
        self._seed, self._requests = seed, 0

    def close(self) -> None:
        self.llm = None

    def act(self, batch: Sequence[Conversation]) -> list[Turn]:
        """Sync the ledgers, sample one turn each in one `generate` call, record them."""
        if self.weights_step is None:
            raise PolicyError(f"{self.name}: no weights pushed yet; call push(model, step, directory) first")
        for conv in batch:
            self.encoder.sync(conv)
        prompts = [{"prompt_token_ids": list(conv.token_ids)} for conv in batch]
        params = [self.sampling_params(self._seed + self._requests + i) for i in range(len(batch))]
        self._requests += len(batch)
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self._lora)
        return [self._record(conv, output.outputs[0]) for conv, output in zip(batch, outputs, strict=True)]

    def sampling_params(self, seed: int) -> Any:
        """One request's `vllm.SamplingParams`: the sampled token's log-prob, the template's stop ids."""
        return self._vllm.SamplingParams(
            temperature=self.sampling.temperature, top_p=self.sampling.top_p, max_tokens=self.sampling.max_new_tokens, seed=seed,
            logprobs=0, stop_token_ids=self.stop_ids, skip_special_tokens=False,
        )  # fmt: skip

    def _record(self, conv: Conversation, completion: Any) -> Turn:
        ids = list(completion.token_ids)
        logprobs = [step[token].logprob for step, token in zip(completion.logprobs, ids)] if completion.logprobs else [0.0] * len(ids)
        return record_turn(self.encoder, self.stop_ids, conv, ids, logprobs, reply_text(self.tokenizer, ids, self.stop_ids), completion.finish_reason)

    def push(self, model: torch.nn.Module, step: int, directory: str | Path) -> float:
        """Make vLLM sample from `model`'s current weights; seconds taken."""
        started = time.perf_counter()
        if hasattr(model, "peft_config"):
            self._push_lora(model, step, Path(directory).resolve() / f"step-{step}")
        elif self.lora_r > 0:
            raise ValueError(f"{self.name} was built for LoRA (lora_r={self.lora_r}) but the model has no adapter")
        else:
            weights = [(name, tensor.detach()) for name, tensor in model.state_dict().items()]
            self.llm.collective_rpc(load_weights, args=(weights,))
            self.llm.reset_prefix_cache()  # cached keys and values belong to the old weights
        self.weights_step = step
        return time.perf_counter() - started

    def _push_lora(self, model: torch.nn.Module, step: int, target: Path) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        save_atomic(target, model.save_pretrained)
        # a new int id per version: vLLM caches adapters by id, and max_loras=1 evicts the previous one
        self._lora = importlib.import_module("vllm.lora.request").LoRARequest(f"cgym-step-{step}", step + 1, str(target))
        previous, self._adapter_dir = self._adapter_dir, target
        if previous is not None and previous != target and previous.exists():
            shutil.rmtree(previous)
        self.llm.reset_prefix_cache()


def load_weights(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> int:
    """Run on each vLLM worker by `collective_rpc`: load a Hugging Face state dict into its model."""
    worker.model_runner.model.load_weights(weights=weights)
    return len(weights)


def lora_rank_bound(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that fits an adapter of `rank`."""
    for bound in LORA_RANKS:
        if bound >= rank:
            return bound
    raise ValueError(f"lora_r={rank} is above vLLM's largest max_lora_rank ({LORA_RANKS[-1]})")
