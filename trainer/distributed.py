"""torchrun / DDP support: the process group, and the few collectives the GRPO loop needs.

A plain process is a `World` of one whose collectives return their input, so nothing imports
or initialises `torch.distributed` unless torchrun started us (WORLD_SIZE > 1 in the env).

Gradients are summed across ranks explicitly, once per optimizer step, after every rank has
accumulated its micro-batches: the same all-reduce DistributedDataParallel does, but DDP's
reducer cannot follow this loop (ranks hold different numbers of micro-batches once
refinements and dropped groups are counted, a rank may hold none, and the shared-prefix loss
pass calls the model twice per backward). Each rank's loss is divided by the *global*
normaliser, so the summed gradient is the 1-process gradient of the same global batch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from cgym.envs.errors import ConfigError
from cgym.trainer.config import LossType
from cgym.trainer.losses import token_normalizer
from torch import Tensor

BUCKET_ELEMENTS = 1 << 24  # gradients all-reduced per ~64 MB of fp32
# The other ranks wait at a barrier while rank 0 evaluates or checkpoints; a CPU evaluation of
# a real model can outlast torch's default 30 minutes.
GROUP_TIMEOUT = timedelta(hours=4)


@dataclass(frozen=True)
class World:
    """This process's rank among `size` training processes (1: no torch.distributed at all)."""

    rank: int = 0
    size: int = 1
    device: torch.device = torch.device("cpu")
    owns_group: bool = False  # `init_world` created the process group (so `close_world` ends it)

    @property
    def is_main(self) -> bool:
        """Rank 0 writes metrics and checkpoints and runs evaluations."""
        return self.rank == 0

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks (float64)."""
        return self._reduce(values, "SUM")

    def max(self, values: list[float]) -> list[float]:
        return self._reduce(values, "MAX")

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (picklable), in rank order, on every rank."""
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        torch.distributed.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.size > 1:
            torch.distributed.barrier()

    def broadcast_parameters(self, model: torch.nn.Module) -> None:
        """Rank 0's weights to every rank (they load the same ones; this makes it certain)."""
        if self.size == 1:
            return
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                torch.distributed.broadcast(tensor.data, src=0)

    def sum_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Replace each gradient by its sum over ranks (a missing one counts as zeros)."""
        if self.size == 1:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for bucket in _buckets([p.grad for p in params]):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            torch.distributed.all_reduce(flat)
            offset = 0
            for g in bucket:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def _reduce(self, values: list[float], op: str) -> list[float]:
        if self.size == 1:
            return [float(v) for v in values]
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(tensor, op=getattr(torch.distributed.ReduceOp, op))
        return tensor.tolist()


def init_world(device: torch.device | str = "cpu") -> World:
    """Join torchrun's process group (from RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT):
    gloo for CPU training, NCCL for CUDA. Without torchrun, a World of one."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World(device=torch.device(device))
    device = torch.device(device)
    owns = not torch.distributed.is_initialized()
    if owns:
        torch.distributed.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", timeout=GROUP_TIMEOUT)
    return World(torch.distributed.get_rank(), torch.distributed.get_world_size(), device, owns)


def training_device(name: str) -> torch.device:
    """The device a rank trains on: `name`, with a bare `cuda` under torchrun meaning this
    rank's cuda:LOCAL_RANK. A CUDA device on a machine without one is a ConfigError."""
    device = torch.device(name)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ConfigError(f"device={name!r}, but torch sees no CUDA GPU here (torch {torch.__version__}): train with --device cpu")
    if device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if device.index >= torch.cuda.device_count():
        raise ConfigError(f"device {device} does not exist: this machine has {torch.cuda.device_count()} CUDA device(s)")
    torch.cuda.set_device(device)
    return device


def close_world(world: World) -> None:
    """Leave the process group `init_world` created (a no-op for a World of one, or a group the caller made)."""
    if world.owns_group and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def check_divisible(tasks_per_step: int, world: World) -> None:
    """A group never spans ranks: every rank rolls out tasks_per_step / world.size whole groups."""
    if tasks_per_step % world.size:
        below = tasks_per_step - tasks_per_step % world.size
        raise ConfigError(
            f"tasks_per_step={tasks_per_step} does not split over {world.size} processes: each rank rolls out whole groups, "
            f"so use a multiple of {world.size} (e.g. {below or world.size} or {below + world.size})"
        )


def global_normalizer(mask: Tensor | None, loss_type: LossType, max_completion_length: int, world: World) -> float:
    """The loss divisor of the whole global batch (every rank's rows), for `policy_loss`.

    grpo: sequences; bnpo/dapo: masked tokens; dr_grpo: sequences * max_completion_length;
    all are sums over ranks, so each rank dividing its own sum by this gives, summed over
    ranks, the 1-process loss (see `trainer.losses.token_normalizer`). `mask` is None on a
    rank left with no rows.
    """
    if world.size == 1:
        assert mask is not None
        return token_normalizer(mask, loss_type, max_completion_length)
    rows, tokens = world.sum([0.0 if mask is None else mask.shape[0], 0.0 if mask is None else float(mask.sum())])
    count = {"grpo": rows, "bnpo": tokens, "dapo": tokens, "dr_grpo": rows * max_completion_length}[loss_type]
    return max(count, 1.0)


def _buckets(tensors: list[Tensor]) -> list[list[Tensor]]:
    """Consecutive groups of same-dtype tensors with about BUCKET_ELEMENTS elements each."""
    buckets: list[list[Tensor]] = []
    size = 0
    for t in tensors:
        if not buckets or size + t.numel() > BUCKET_ELEMENTS or buckets[-1][0].dtype != t.dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(t)
        size += t.numel()
    return buckets


__all__ = ["World", "check_divisible", "close_world", "global_normalizer", "init_world", "training_device"]
