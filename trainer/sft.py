"""Supervised warm start on scripted demonstrations, in exactly the layout sampling produces.

Each demonstration `(messages, tools)` is laid out by `ChatEncoder.encode_demo`, so the model is
trained on the same token ledger it will later sample into, with loss on assistant tokens only
(their end-of-turn token included). Batches group demos of similar length; AdamW with a short
warm-up and cosine decay; deterministic for a given seed.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from cgym.agents.ledger import ChatEncoder
from cgym.agents.local.allocator import keep_freed_memory
from cgym.agents.local.hf import load_pretrained, load_tokenizer
from cgym.agents.local.precision import autocast
from cgym.agents.local.sampling import SharedHead, sequence_logprobs
from cgym.agents.pretrained import resolve_model
from cgym.agents.tool_prompt import TRAINED_LAYOUT, ToolLayout, recorded_layout, set_tool_layout
from cgym.trainer.heads import batch_head
from cgym.trainer.recompute import recomputed_past_budget
from cgym.trainer.rollout import micro_batches
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from torch import Tensor
from transformers import PreTrainedModel

Demo = tuple[list[dict[str, Any]], list[dict[str, Any]]]
Example = tuple[list[int], list[int]]  # (ids, loss mask)


def sft(
    model_dir_in: str | Path,
    demos: Sequence[Demo],
    out_dir: str | Path,
    *,
    epochs: float = 3.0,
    lr: float = 3e-3,
    batch_size: int = 8,
    max_len: int = 2048,
    time_budget_s: float | None = None,
    seed: int = 0,
    progress: bool = True,
    all_tokens: bool = False,
    tool_layout: ToolLayout | None = None,
) -> dict[str, float]:
    """Fine-tune the model in `model_dir_in` on `demos` and save model + tokenizer to `out_dir`.

    Demos longer than `max_len` tokens are cut (their remaining assistant tokens still count).
    `time_budget_s` caps the wall time: the schedule then runs on whichever of steps or time is
    further along, so a run stopped by the clock has still warmed up and decayed its learning
    rate. Returns `steps`, `final_loss` (mean over the last 10% of steps), `first_loss`, `tokens`
    (all tokens seen), `loss_tokens` (assistant tokens seen) and `seconds`. `all_tokens` puts the
    loss on every token instead (language-model pre-training on whole transcripts).
    `tool_layout` sets how tools are shown to a model whose template has no tools section
    (`agents.tool_prompt`; None: the start model's, or `TRAINED_LAYOUT` where it records none),
    and the saved model keeps it.
    """
    if max_len < 2:
        raise ValueError(f"need max_len >= 2, got {max_len}")
    model_dir_in = resolve_model(model_dir_in)
    tokenizer = load_tokenizer(model_dir_in)
    tool_layout = tool_layout or recorded_layout(tokenizer) or TRAINED_LAYOUT
    set_tool_layout(tokenizer, tool_layout)
    examples = encode_demos(ChatEncoder(tokenizer), demos, max_len)
    if all_tokens:
        examples = [(ids, [1] * len(ids)) for ids, _ in examples]
    return fit(
        model_dir_in,
        examples,
        out_dir,
        epochs=epochs,
        lr=lr,
        batch_size=batch_size,
        time_budget_s=time_budget_s,
        seed=seed,
        progress=progress,
        tool_layout=tool_layout,
    )


def fit(
    model_dir_in: str | Path,
    examples: Sequence[Example],
    out_dir: str | Path,
    *,
    epochs: float = 1.0,
    lr: float = 3e-3,
    batch_size: int = 8,
    time_budget_s: float | None = None,
    seed: int = 0,
    progress: bool = True,
    label: str = "sft",
    tool_layout: ToolLayout | None = None,
) -> dict[str, float]:
    """Train on ready `(ids, loss mask)` examples (SFT's engine; also `cgym tiny`'s drills)
    and save model + tokenizer to `out_dir`. Options and returned stats as in `sft`."""
    if epochs <= 0 or batch_size < 1 or not examples:
        raise ValueError(
            f"need epochs > 0, batch_size >= 1 and examples; got {epochs}, {batch_size}, "
            f"{len(examples)} examples"
        )
    model_dir_in = resolve_model(model_dir_in)
    keep_freed_memory()
    model, tokenizer = load_pretrained(model_dir_in, dtype=torch.float32)
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = ChatEncoder(tokenizer).end_of_turn_id
    batches = length_buckets(examples, batch_size)
    total = max(1, math.ceil(epochs * len(batches)))
    stats = _train(
        model,
        batches,
        pad_id,
        total,
        lr=lr,
        seed=seed,
        time_budget_s=time_budget_s,
        progress=progress,
        label=label,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    if tool_layout is not None:
        set_tool_layout(tokenizer, tool_layout)
    tokenizer.save_pretrained(out)
    return stats


def encode_demos(encoder: ChatEncoder, demos: Sequence[Demo], max_len: int) -> list[Example]:
    """Ledger layout of every demo, cut to `max_len` (dropped if no assistant token is left)."""
    examples = []
    for messages, tools in demos:
        ids, mask = encoder.encode_demo(messages, tools)
        ids, mask = ids[:max_len], mask[:max_len]
        if any(mask[1:]):
            examples.append((ids, mask))
    if not examples:
        raise ValueError("no demonstration has an assistant token within max_len")
    return examples


def length_buckets(examples: Sequence[Example], batch_size: int) -> list[list[Example]]:
    """Batches of similar length (sorted by length, then cut), so little compute goes to padding."""
    ordered = sorted(examples, key=lambda ex: len(ex[0]))
    return [ordered[i : i + batch_size] for i in range(0, len(ordered), batch_size)]


def collate(batch: Sequence[Example], pad_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """Right-padded (B, T) ids, attention mask and loss mask."""
    width = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(batch), width), dtype=torch.long)
    loss_mask = torch.zeros((len(batch), width), dtype=torch.float32)
    for row, (row_ids, row_mask) in enumerate(batch):
        ids[row, : len(row_ids)] = torch.tensor(row_ids)
        attention[row, : len(row_ids)] = 1
        loss_mask[row, : len(row_mask)] = torch.tensor(row_mask, dtype=torch.float32)
    return ids, attention, loss_mask


def sft_loss(model: PreTrainedModel, ids: Tensor, attention: Tensor, loss_mask: Tensor, head: SharedHead | None = None) -> Tensor:
    """Mean negative log-likelihood over the tokens with loss mask 1.

    Only the loss columns go through the LM head, and a prefix every row shares (the system
    prompt) through the model once: both are exact, and together ~3x faster on the tiny model.
    A `head` (`trainer.heads.batch_head`) is that prefix already run for the whole batch.
    """
    targets = loss_mask[:, 1:]
    logprobs = sequence_logprobs(model, ids, attention, mask=targets, head=head)  # (B, T-1)
    return -(logprobs * targets).sum() / targets.sum().clamp(min=1.0)


def accumulate_sft_loss(model: PreTrainedModel, ids: Tensor, attention: Tensor, loss_mask: Tensor, micro_batch_size: int) -> Tensor:
    """`sft_loss` of the whole batch, backpropagated a micro-batch at a time: at most
    `micro_batch_size` rows, fewer where they are long (`rollout.micro_batches`).

    Each micro-batch's summed token loss is divided by the whole batch's loss-token count, so
    the gradients equal one pass over the batch while the activations held for the backward
    pass stay those of a micro-batch (SmolLM2 with 8 demos of ~900 tokens held ~15 GB at once);
    a demo past the token budget runs alone with its layers recomputed (`trainer.recompute`).
    The prefix every demo shares (the system prompt) runs once for the batch (`batch_head`).
    Returns the (detached) batch loss.
    """
    total = loss_mask[:, 1:].sum().clamp(min=1.0)
    head = batch_head(model, ids, attention, loss_mask[:, 1:])
    loss = torch.zeros(())
    for chunk in micro_batches(attention.sum(-1).tolist(), micro_batch_size):  # sized by length, as GRPO's
        rows = torch.as_tensor(chunk, dtype=torch.long)
        width = int(attention[rows].sum(-1).max())  # right padding: trim to this chunk's longest row
        with autocast(model), recomputed_past_budget(model, len(chunk) * width):  # one demo past the budget
            part = sft_loss(model, ids[rows, :width], attention[rows, :width], loss_mask[rows, :width], head)
        part = part * loss_mask[rows, 1:width].sum() / total
        part.backward()
        loss = loss + part.detach()
    if head is not None:
        head.backward()
    return loss


WARMUP = 0.05  # share of the run (in steps or in time) spent warming up


def _schedule(progress: float) -> float:
    """LR multiplier at `progress` in [0, 1]: linear warm-up over the first 5%, then cosine decay
    to 10%."""
    if progress < WARMUP:
        return progress / WARMUP
    done = min(1.0, (progress - WARMUP) / (1.0 - WARMUP))
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * done))


def _batch_order(batches: list[list[Example]], rng: random.Random) -> Iterator[list[Example]]:
    """Shuffled batches, epoch after epoch, forever."""
    while True:
        yield from rng.sample(batches, len(batches))


def _train(
    model: PreTrainedModel,
    batches: list[list[Example]],
    pad_id: int,
    total: int,
    *,
    lr: float,
    seed: int,
    time_budget_s: float | None,
    progress: bool,
    label: str = "sft",
    micro_batch_size: int = 4,
) -> dict[str, float]:
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    order = _batch_order(batches, random.Random(seed))
    losses: list[float] = []
    tokens = loss_tokens = 0
    start = time.perf_counter()
    with Progress(
        TextColumn(label),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.3f} {task.fields[speed]:.0f} tok/s"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        disable=not progress,
    ) as bar:
        task = bar.add_task(label, total=total, loss=float("nan"), speed=0.0)
        for step in range(total):
            done = (step + 1) / total
            if time_budget_s:
                done = max(done, (time.perf_counter() - start) / time_budget_s)
            for group in optimizer.param_groups:
                group["lr"] = lr * _schedule(done)
            ids, attention, loss_mask = collate(next(order), pad_id)
            optimizer.zero_grad(set_to_none=True)
            loss = accumulate_sft_loss(model, ids, attention, loss_mask, micro_batch_size)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            losses.append(loss.item())
            tokens += int(attention.sum())
            loss_tokens += int(loss_mask[:, 1:].sum())
            elapsed = time.perf_counter() - start
            bar.update(task, advance=1, loss=losses[-1], speed=tokens / max(elapsed, 1e-9))
            if time_budget_s is not None and elapsed > time_budget_s:
                bar.update(task, total=step + 1)  # the time budget, not the step count, ended the run
                break
    model.eval()
    tail = losses[-max(1, len(losses) // 10) :]
    return {
        "steps": len(losses),
        "first_loss": losses[0],
        "final_loss": sum(tail) / len(tail),
        "tokens": tokens,
        "loss_tokens": loss_tokens,
        "seconds": time.perf_counter() - start,
    }
