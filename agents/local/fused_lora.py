"""A LoRA layer's base product and adapter product in one matmul, for the bf16 training pass.

peft computes `W x + s B (A x)` in five steps under bf16 autocast: the base product, `A x`,
`B (A x)` (a matmul whose inner size is the rank, 16, which oneDNN ran at a few percent of its
peak), the scaling and the sum, each output rounded to bf16 and each with its own backward.
Here the adapter's output joins the base's as extra columns of one product:

    y = [x | A x] @ [W | s B]^T

so the sum happens in the matmul's fp32 accumulator (one rounding to bf16, not three), and the
backward pass reads `g @ [W | s B]` once for the input's gradient and the adapter's. At the GRPO
update's shapes (881 rows, 576 -> 1536) one layer's forward and backward took 9.1 ms against
11.4 ms through peft (`benchmarks/RESULTS.md`). `s = alpha / r = 2` scales `B` exactly.

`precision.frozen_weights_cast(model, fuse_adapters=True)` fuses a LoRA model's plain adapter
layers for an update: the joined weight is made once, from the frozen base weight cast once, and
its `s B` columns are rewritten when an optimizer step changes `B`.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import Tensor


def fusable(module: torch.nn.Module) -> bool:
    """Whether `module` is a plain peft LoRA linear layer: one active adapter, no dropout, no
    DoRA or other variant, not merged, on a frozen `nn.Linear`."""
    base = getattr(module, "base_layer", None)
    adapters = getattr(module, "active_adapters", None)
    if type(base) is not torch.nn.Linear or base.weight.requires_grad or not isinstance(adapters, list) or len(adapters) != 1:
        return False
    name = adapters[0]
    lora_a, lora_b = getattr(module, "lora_A", {}), getattr(module, "lora_B", {})
    if (
        name not in lora_a
        or name not in lora_b
        or name in getattr(module, "lora_variant", {})
        or getattr(module, "merged", True)
        or getattr(module, "disable_adapters", True)
    ):
        return False
    plain = type(lora_a[name]) is torch.nn.Linear and type(lora_b[name]) is torch.nn.Linear and lora_a[name].bias is None and lora_b[name].bias is None
    return plain and isinstance(module.lora_dropout[name], torch.nn.Identity)


def fuse(layer: torch.nn.Module, dtype: torch.dtype) -> None:
    """Run `fusable` `layer` as one product under `dtype` autocast (peft's forward elsewhere),
    until `del layer.forward`. Its base weight is cast to `dtype` once, here."""
    layer.forward = partial(_forward, layer, _Weights(layer, dtype))  # the instance's, over the class's


class _Weights:
    """A fused layer's `[W | s B]` in `dtype`; the `s B` columns are rewritten when `B` changes."""

    def __init__(self, layer: Any, dtype: torch.dtype) -> None:
        name = layer.active_adapters[0]
        self.a, self.b, self.scale = layer.lora_A[name].weight, layer.lora_B[name].weight, float(layer.scaling[name])
        base = layer.base_layer
        self.joined = torch.cat([base.weight.detach().to(dtype), (self.b.detach() * self.scale).to(dtype)], 1)
        self.bias = None if base.bias is None else base.bias.detach().to(dtype)
        self.dtype = dtype
        self._version = self.b._version

    def current(self) -> Tensor:
        if self.b._version != self._version:  # an optimizer step wrote B in place (after the backward that read the old one)
            with torch.no_grad():
                self.joined[:, -self.b.shape[1] :].copy_(self.b * self.scale)
            self._version = self.b._version
        return self.joined


def _forward(layer: Any, weights: _Weights, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    device = x.device.type
    if args or kwargs or not (torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == weights.dtype):
        return type(layer).forward(layer, x, *args, **kwargs)
    with torch.autocast(device, enabled=False):
        return _Fused.apply(x.to(weights.dtype), weights.a, weights.b, weights.current(), weights.bias, weights.scale)


class _Fused(torch.autograd.Function):
    """`[x | x A^T] @ [W | s B]^T (+ bias)`, with gradients for `x`, `A` and `B`."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, a: Tensor, b: Tensor, joined: Tensor, bias: Tensor | None, scale: float) -> Tensor:
        a_low = a.detach().to(x.dtype)
        h = x @ a_low.t()  # (..., r)
        y = torch.cat([x, h], -1) @ joined.t()
        if bias is not None:
            y = y + bias
        ctx.save_for_backward(x, h, a_low, joined)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, h, a_low, joined = ctx.saved_tensors
        inner, rank = x.shape[-1], h.shape[-1]
        grad = grad.to(joined.dtype)
        both = grad @ joined  # (..., inner + r): the input's gradient through W, and x A^T's through s B
        dh = both[..., inner:]
        dx = both[..., :inner] + dh @ a_low
        da = (dh.reshape(-1, rank).t() @ x.reshape(-1, inner)).float()
        db = (grad.reshape(-1, grad.shape[-1]).t() @ h.reshape(-1, rank)).float().mul_(ctx.scale)
        return dx, da, db, None, None, None
