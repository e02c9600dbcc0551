"""`hf:<name-or-path>`: a local transformers causal LM as a policy, with a token-exact ledger.

Any causal LM whose tokenizer has a chat template works (the embedded tiny model, or e.g.
Qwen2.5-0.5B-Instruct by name). Each `act` syncs every conversation's ledger, samples the whole
batch in one KV-cached decode loop and appends the sampled ids and log-probs to the ledgers, so
a trainer later learns from exactly those tokens (see `agents.ledger`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from cgym.agents.base import Conversation, Turn
from cgym.agents.ledger import ChatEncoder
from cgym.agents.local.allocator import keep_freed_memory
from cgym.agents.local.batching import kv_budgets, kv_bytes_per_token, length_chunks
from cgym.agents.local.joins import Request
from cgym.agents.local.kv_cache import PrefixCache
from cgym.agents.local.lean_layers import sampling_model
from cgym.agents.local.precision import SamplingWeights, compute_dtype, sampling_dtype
from cgym.agents.local.sampling import LOOKUP_TOKENS, Sample, sample_batch, sample_turns
from cgym.agents.local.turn_cache import TurnCache
from cgym.agents.options import DEFAULT_SAMPLING, SamplingOptions
from cgym.agents.pretrained import SHORT_NAMES, resolve_model
from cgym.envs.errors import CgymError, first_line
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

NOT_SAMPLED = Sample(ids=[], logprobs=[], stopped=False)  # the turn of a conversation past max_context

MODEL_FORMS = f"give a local model directory, a .gguf file, a short name ({', '.join(SHORT_NAMES)}) or a hub name such as Qwen/Qwen2.5-0.5B-Instruct"


class ModelLoadError(CgymError, OSError):
    """A model that is neither a local model directory nor loadable from the hub."""


class HFPolicy:
    """Samples assistant turns from a transformers model; keeps each conversation's ledger.

    `sampling` holds every sampling setting (`agents.options.SamplingOptions`): `temperature` 0 is
    greedy (log-probs then at temperature 1). Log-probs are those of
    `log_softmax(logits / temperature)`; top-p is not reflected in them. Its `seed` seeds the
    sampler: the same sequence of `act` calls gives the same turns.

    `max_context` (default: the model config's `max_position_embeddings`) ends conversations the
    model was not trained to read: one whose ledger already holds that many tokens is not
    sampled, and gets an empty turn, cut like one that hit `max_new_tokens` (its end-of-turn
    token unsampled, `Turn.truncated`), which the env then scores as it scores any empty reply.
    `context_cuts` counts such turns. None: no limit.

    `continuous` says how `run_episodes` schedules turns: True streams them through `play`, which
    joins each next turn to the rows still decoding (continuous batching); False (the default)
    runs the live conversations' turns together through `act`. Joined, a 4 x 8 sampled GRPO
    rollout took 1.22x less time a sampled id, and the 100-episode greedy eval of ApiReport easy
    29.3-29.9 s against 25.3-27.9 s. It is off by default: over twenty-four quickstart seeds, SFT +
    GRPO reached 84% trained with it against 90% in lockstep, two of its seeds collapsing
    (benchmarks/RESULTS.md), for a reason not yet found.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        sampling: SamplingOptions = DEFAULT_SAMPLING,
        device: str | torch.device = "cpu",
        name: str | None = None,
        draft_tokens: int = LOOKUP_TOKENS,
        max_context: int | None | Literal["model"] = "model",
        continuous: bool = False,
    ) -> None:
        if max_context == "model":
            max_context = getattr(model.config, "max_position_embeddings", None)
        if max_context is not None and (isinstance(max_context, bool) or not isinstance(max_context, int) or max_context < 1):
            raise ValueError(f"max_context must be a positive int, None (no limit) or 'model', got {max_context!r}")
        self.max_context = max_context
        self.context_cuts = 0  # turns not sampled because the conversation filled max_context
        self.draft_tokens = draft_tokens  # prompt-lookup drafts per step once few rows are left (0: off)
        self.continuous = continuous
        self.params = sampling
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.encoder = ChatEncoder(tokenizer)
        self.prefix_cache = PrefixCache()  # the system prompt's keys/values, shared by every episode
        self.batch_budget, turn_budget = kv_budgets()  # bytes: one sampling chunk's cache; the turn cache
        self.turn_cache: TurnCache | None = TurnCache(turn_budget)  # each live conversation's keys/values, for its next turn
        self.sampling_weights = SamplingWeights(self.model)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(sampling.seed)
        self.name = name or f"hf:{getattr(model, 'name_or_path', '') or type(model).__name__}"

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | Path,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        inference_only: bool = False,
        **kw: Any,
    ) -> HFPolicy:
        """Load model and tokenizer by short name (`smollm2-135m`, `tiny`; fetched on first use),
        local directory, GGUF file or hub name.

        `dtype` defaults to the compute dtype (`agents.local.precision`: bf16 on GPUs and on CPUs with
        native bf16), and for an `inference_only` policy to the dtype sampling runs in (bf16 also
        for a Llama or Qwen2 where this project's kernels run), so a policy that only samples
        holds one copy of the weights. A trainer passes float32 for its master weights and
        samples from a bf16 copy.

        `inference_only` says the policy will only ever sample (an eval, a comparison, a critic):
        its model's linear layers are then packed in place for oneDNN where the CPU takes it
        (`agents.local.packed`: decode steps read each weight once, `agents.local.lean_layers`:
        fewer ops a layer), and the plain weights are gone, so that model cannot be trained or
        saved."""
        if torch.device(device).type == "cpu":
            keep_freed_memory()
        model, tokenizer = load_pretrained(name_or_path, dtype=dtype or compute_dtype(device))
        if inference_only:
            sampler = sampling_dtype(model)
            if dtype is None and model.dtype != sampler:
                model.to(sampler)  # bf16 for the kernels on a CPU without native bf16
            if model.dtype == sampler:
                sampling_model(model.requires_grad_(False))
        return cls(model, tokenizer, device=device, name=f"hf:{name_or_path}", **kw)

    def reseed(self, seed: int) -> None:
        """Seed the sampler: the same `act` calls after the same seed give the same turns."""
        self.generator.manual_seed(seed)

    def drop_caches(self) -> None:
        """Free what sampling keeps between calls for the current weights: the keys/values of
        the conversations' next turns (`act` keeps each row's until its next call, so a finished
        batch's stay until then). A trainer calls this between its rollout and its update, where
        they would only take memory (on ApiReport medium, 32 conversations of ~2,000 tokens hold
        ~3 GB in fp32) and be stale after it. The sampling copy of the weights is kept: it is
        refreshed in place after the update, which costs less than building it again."""
        if self.turn_cache is not None:
            self.turn_cache.keep_only(())

    @property
    def stop_ids(self) -> set[int]:
        """End-of-turn, the tokenizer's eos and the generation config's eos ids."""
        ids = {self.encoder.end_of_turn_id}
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        extra = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        ids.update([extra] if isinstance(extra, int) else (extra or []))
        return ids

    def act(self, batch: Sequence[Conversation]) -> list[Turn]:
        """Sync the ledgers, sample one turn per conversation that still fits `max_context` (rows
        of similar length decode together, `agents.local.batching`; the others get an empty cut turn),
        record it."""
        for conv in batch:
            self.encoder.sync(conv)
        if self.sampling_weights.model is not self.model:  # the model was swapped (e.g. wrapped in LoRA)
            self.sampling_weights = SamplingWeights(self.model)
        model = self.sampling_weights.get()
        rows = [row for row, conv in enumerate(batch) if self.max_context is None or len(conv.token_ids) < self.max_context]
        if self.turn_cache is not None:
            self.turn_cache.keep_only({id(batch[row]) for row in rows})
        samples: dict[int, Sample] = {}
        for chunk in self._chunks(model, [batch[row] for row in rows]):
            chunk_rows = [rows[i] for i in chunk]
            samples.update(zip(chunk_rows, self._sample(model, [batch[row] for row in chunk_rows]), strict=True))
        self.context_cuts += len(batch) - len(rows)
        return [self._record(conv, samples.get(row, NOT_SAMPLED)) for row, conv in enumerate(batch)]

    def play(self, batch: Sequence[Conversation], follow: Callable[[int, Turn], Conversation | None]) -> None:
        """Take turns for `batch` as they come: `follow(slot, turn)` hears the turn of the
        conversation in `slot` (its place in `batch`) as soon as it is sampled, and returns the
        conversation whose turn is next in that slot (the same one with the env's reply, or a new
        episode's) or None to close the slot. A next turn joins the rows still decoding
        (continuous batching, `agents.local.joins`), so no turn waits for another's longest row.
        A conversation past `max_context` gets an empty cut turn, as in `act`."""
        if self.sampling_weights.model is not self.model:
            self.sampling_weights = SamplingWeights(self.model)
        model = self.sampling_weights.get()
        if self.turn_cache is not None:
            self.turn_cache.keep_only({id(conv) for conv in batch})
        live: dict[Hashable, tuple[int, Conversation]] = {}  # each sampling turn's slot and conversation, by key

        def ready(slot: int, conv: Conversation | None) -> Request | None:
            """`conv`'s turn to sample, once the turns past `max_context` are cut."""
            while conv is not None:
                self.encoder.sync(conv)
                if self.max_context is None or len(conv.token_ids) < self.max_context:
                    live[id(conv)] = (slot, conv)
                    return Request(conv.token_ids, id(conv))
                self.context_cuts += 1
                conv = follow(slot, self._record(conv, NOT_SAMPLED))
            return None

        def heard(key: Hashable, sample: Sample) -> tuple[Sequence[int], Hashable] | None:
            slot, conv = live.pop(key)
            after = follow(slot, self._record(conv, sample))
            if after is not conv and self.turn_cache is not None:
                self.turn_cache.forget(key)  # that conversation ended
            request = ready(slot, after)
            return None if request is None else (request.prompt, request.key)

        requests = [r for r in (ready(slot, conv) for slot, conv in enumerate(batch)) if r is not None]
        while requests:
            chunks = length_chunks([len(r.prompt) for r in requests], room=self.params.max_new_tokens, bytes_per_token=self._kv_bytes(model), budget=self.batch_budget)
            first = [requests[i] for i in chunks[0]]
            rest = [requests[i] for chunk in chunks[1:] for i in chunk]
            requests = sample_turns(
                model,
                [r.prompt for r in first],
                [r.key for r in first],
                heard,
                params=self.params,
                stop_ids=self.stop_ids,
                pad_id=self._pad_id,
                bytes_per_token=self._kv_bytes(model),
                budget=self.batch_budget,
                generator=self.generator,
                prefix_cache=self.prefix_cache,
                turn_cache=self.turn_cache,
                draft_tokens=self.draft_tokens,
                waiting=rest,
            )

    def _kv_bytes(self, model: PreTrainedModel) -> int:
        return kv_bytes_per_token(model.config, model.dtype.itemsize)

    @property
    def _pad_id(self) -> int:
        pad_id = self.tokenizer.pad_token_id
        return pad_id if pad_id is not None else self.encoder.end_of_turn_id

    def _chunks(self, model: PreTrainedModel, batch: Sequence[Conversation]) -> list[list[int]]:
        """Rows that sample together (`agents.local.batching`): similar lengths, within the budget."""
        lengths = [len(conv.token_ids) for conv in batch]
        return length_chunks(lengths, room=self.params.max_new_tokens, bytes_per_token=self._kv_bytes(model), budget=self.batch_budget)

    def _sample(self, model: PreTrainedModel, convs: Sequence[Conversation]) -> list[Sample]:
        return sample_batch(
            model,
            [conv.token_ids for conv in convs],
            params=self.params,
            stop_ids=self.stop_ids,
            pad_id=self._pad_id,
            generator=self.generator,
            prefix_cache=self.prefix_cache,
            turn_cache=self.turn_cache,
            turn_keys=[id(conv) for conv in convs],
            draft_tokens=self.draft_tokens,
        )

    def _record(self, conv: Conversation, sample: Sample) -> Turn:
        """Append a sample to the ledger and make its Turn.

        A turn that stopped on another eos than the end-of-turn token (e.g. `<|endoftext|>`) drops
        that token and is closed like a cut turn, so the ledger keeps the template's layout.
        """
        ended = sample.stopped and sample.ids[-1] == self.encoder.end_of_turn_id
        keep = len(sample.ids) - (sample.stopped and not ended)
        ids, logprobs = sample.ids[:keep], sample.logprobs[:keep]
        self.encoder.append_sampled(conv, ids, logprobs, ended=ended)
        text_ids = ids[:-1] if ended else ids
        text = self.tokenizer.decode(
            text_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        return Turn(
            text=text, token_ids=tuple(ids), logprobs=tuple(logprobs), truncated=not sample.stopped
        )


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_pretrained(name_or_path: str | Path, *, dtype: torch.dtype) -> tuple[Any, Any]:
    """Model and tokenizer for any model input (short name, directory, .gguf file, hub name);
    whatever is wrong with it (missing, not a model, no tokenizer, damaged weights) is one
    `ModelLoadError` that says what, never a traceback from transformers."""
    path = resolve_model(name_or_path)
    _check_local(path, name_or_path)
    with _load_errors(name_or_path):
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype), AutoTokenizer.from_pretrained(path)


def load_tokenizer(name_or_path: str | Path) -> Any:
    """The tokenizer of a model input, with `load_pretrained`'s errors."""
    path = resolve_model(name_or_path)
    _check_local(path, name_or_path)
    with _load_errors(name_or_path):
        return AutoTokenizer.from_pretrained(path)


@contextlib.contextmanager
def _load_errors(name_or_path: str | Path) -> Iterator[None]:
    try:
        yield
    except Exception as exc:  # transformers, safetensors, tokenizers and the hub client each raise their own
        raise ModelLoadError(f"cannot load the model {str(name_or_path)!r}: {first_line(exc, 300) or type(exc).__name__}") from None


def _check_local(path: str, shown: str | Path) -> None:
    """A local path must be a model directory with a tokenizer; a hub name is left to the hub."""
    directory = Path(path).expanduser()
    if not (_looks_local(path) or directory.exists()):
        return
    if not directory.exists():
        raise ModelLoadError(f"no model at {path}: that directory does not exist ({MODEL_FORMS})")
    if not directory.is_dir():
        raise ModelLoadError(f"cannot load the model {str(shown)!r}: {path} is a file, not a model directory ({MODEL_FORMS})")
    if not ((directory / "config.json").is_file() or (directory / "adapter_config.json").is_file()):
        raise ModelLoadError(f"cannot load the model {str(shown)!r}: {path} holds no config.json, so it is not a saved model ({MODEL_FORMS})")
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(f"cannot load the model {str(shown)!r}: {path} holds no tokenizer ({', '.join(TOKENIZER_FILES)}); save it beside the weights")


def _looks_local(name: str) -> bool:
    """A filesystem path rather than a hub id (`org/name`): absolute, `./`, `../`, `~` or deeper than one slash."""
    return Path(name).is_absolute() or name.startswith((".", "~")) or name.count("/") > 1
