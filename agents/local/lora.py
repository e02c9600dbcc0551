"""LoRA adapters (peft) on a causal LM: wrap for training, fold into plain weights for sampling and saving.

A LoRA-wrapped model computes `W x + (alpha / r) B A x` in every adapted linear layer: two extra
small matmuls per layer at every decode step. Folded (`W + (alpha / r) B A`), it is a plain model
again: it samples as fast as the base, takes the same kernels, and loads without peft.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from cgym.agents.local.instances import replaced


def with_lora(model: torch.nn.Module, rank: int, *, adapter: Path | None = None) -> torch.nn.Module:
    """`model` with trainable rank-`rank` LoRA adapters on every linear layer (the base frozen),
    fresh or loaded from a saved `adapter` directory (a resumed run's checkpoint).

    alpha = 2r, as LoRA Without Regret (Thinking Machines, 2025) and most RL recipes use.
    """
    try:
        from peft import PeftModel, get_peft_model
    except ImportError as exc:
        raise ImportError("lora_r > 0 needs peft: pip install peft") from exc
    with warnings.catch_warnings():
        # peft reads transformers' deprecated `is_gradient_checkpointing`: its FutureWarning is
        # theirs to fix, and would reach every LoRA run's console
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        if adapter is not None:
            return PeftModel.from_pretrained(model, str(adapter), is_trainable=True)
        return get_peft_model(model, lora_config(rank))


def lora_config(rank: int) -> Any:
    """peft's `LoraConfig` for rank-`rank` adapters on every linear layer, alpha = 2r (what
    `with_lora` trains, and what a comparison with another trainer should hand it)."""
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", task_type="CAUSAL_LM")


@contextmanager
def lean_adapters(model: torch.nn.Module) -> Iterator[int]:
    """Within the block, `model`'s plain LoRA layers (one adapter, no dropout, no DoRA, no hook
    on the base layer) take fewer products than peft's forward; yields how many layers that covers.

    - In fp32 outside autocast, the adapter's output joins the base product as one product,
      `base(x) += s (A x) B^T` in a single `addmm_` into the base product's own output, where peft
      writes three full-size tensors (the adapter's output, its scaling, the sum) and its backward a
      fourth (the scaled gradient); the scale then falls on rank-wide tensors only. (An out-of-place
      `addmm` copied the base output first: 0.67-0.81 against 0.26-0.27 s of copies in a SmolLM2
      update on the Ice Lake, torch.profiler, ad hoc `lora_prof.py`.) Where the scale alpha / r is
      a power of two (`with_lora`'s 2) nothing rounds differently: the outputs and gradients are
      peft's bit for bit (`tests/agents/local/test_lora.py`).
    - Under autocast to a lower dtype (bf16 on a CPU with native bf16), a layer multiplies by its
      folded weight `W + s B A` cast to that dtype, made once per version of the weights: the
      weight the sampler's folded copy holds (`folded`), bit for bit, so the update's forward
      scores the policy that sampled. Its backward takes `dx` through the folded weight too, and
      the adapters' gradients from `A x` and `g B`: two of peft's six rank-wide products, and its
      full-size scalings and sums, are gone (`_FoldedProduct`). The sums round differently from
      peft's (within bf16 rounding, `tests/agents/local/test_lora.py`).

    Anywhere else (dropout, several adapters, DoRA, disabled or merged adapters, a trained bias) a
    layer runs peft's forward. Its effect on SmolLM2's update: `benchmarks/RESULTS.md`."""
    from peft.tuners.lora.layer import Linear

    layers = [module for module in model.modules() if type(module) is Linear]  # not peft's quantized or other layer kinds
    weights = _FoldedWeights()
    with replaced(layers, "forward", lambda layer: partial(_adapted, layer, weights)) as count:
        yield count


def _plain_adapter(layer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The name of `layer`'s one active adapter where `lean_adapters` may take over its forward
    with these arguments; None where peft's forward must run."""
    names = [name for name in layer.active_adapters if name in layer.lora_A]
    name = names[0] if len(names) == 1 else None
    plain = (
        name is not None
        and not args
        and not kwargs
        and not layer.disable_adapters
        and not layer.merged
        and name not in getattr(layer, "lora_variant", {})  # peft >= 0.16's DoRA and kin
        and not getattr(layer, "use_dora", {}).get(name, False)  # and older peft's DoRA
        and isinstance(layer.lora_dropout[name], torch.nn.Identity)
        and layer.lora_B[name].bias is None
        and not _hooked(layer.base_layer)  # its output is summed into in place, or never made
    )
    return name if plain else None


def _adapted(layer: Any, weights: _FoldedWeights, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """A peft LoRA `Linear`'s forward in fewer products (`lean_adapters`), else peft's own."""
    name = _plain_adapter(layer, args, kwargs)
    if name is None:
        return type(layer).forward(layer, x, *args, **kwargs)
    base, lora_a, lora_b = layer.get_base_layer(), layer.lora_A[name].weight, layer.lora_B[name].weight
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        trained_bias = base.bias is not None and base.bias.requires_grad
        if dtype == torch.float32 or base.weight.requires_grad or trained_bias or x.dtype not in (torch.float32, dtype):
            return type(layer).forward(layer, x, *args, **kwargs)
        weight, bias = weights.of(layer, name, dtype)
        return _FoldedProduct.apply(x, weight, bias, lora_a, lora_b, layer.scaling[name])
    if not x.dtype == lora_a.dtype == lora_b.dtype == base.weight.dtype == torch.float32:
        return type(layer).forward(layer, x, *args, **kwargs)
    return _summed(layer, name, x)


def _summed(layer: Any, name: str, x: torch.Tensor) -> torch.Tensor:
    """An fp32 layer's forward with its adapter's sum in one `addmm_`. The base product runs on
    the rows flattened (as `F.linear` flattens them) and the adapter on `x` as it comes: the
    gradients into `x` then add up in peft's order, bit for bit."""
    result = layer.base_layer(x.reshape(-1, x.shape[-1]))  # a new tensor that its product's backward pass does not read: summed into in place
    hidden = layer.lora_A[name](x)
    result.addmm_(hidden.reshape(-1, hidden.shape[-1]), layer.lora_B[name].weight.t(), alpha=layer.scaling[name])
    return result.view(*x.shape[:-1], result.shape[-1])


class _FoldedWeights:
    """Each adapted layer's folded weight `W + s B A` (and its frozen bias) in a compute dtype,
    made as `folded` makes the sampler's and kept until any of the three tensors changes (an
    optimizer step bumps their version counters)."""

    def __init__(self) -> None:
        self._made: dict[int, tuple[tuple[int, ...], torch.Tensor, torch.Tensor | None]] = {}

    def of(self, layer: Any, name: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        base = layer.get_base_layer()
        tensors = (base.weight, layer.lora_A[name].weight, layer.lora_B[name].weight)
        key = (*(id(t) for t in tensors), *(t._version for t in tensors), id(dtype))
        made = self._made.get(id(layer))
        if made is None or made[0] != key:
            with torch.no_grad():
                weight = folded_weight(layer).to(dtype)
                bias = None if base.bias is None else base.bias.detach().to(dtype)
            made = self._made[id(layer)] = (key, weight, bias)
        return made[1], made[2]


class _FoldedProduct(torch.autograd.Function):
    """`x W'^T + bias` with `W' = W + s B A` folded in the compute dtype, and the gradients of
    LoRA's `x W^T + s (x A^T) B^T`, `W'` read for `W + s B A`: with `u = x A^T` and `g` the output's
    gradient, `dx = g W'`, `dB = s g^T u` and `dA = s (g B)^T x`, each product in the compute dtype
    and the adapters' gradients scaled in their own (fp32)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float
    ) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).to(weight.dtype)
        a, b = lora_a.to(weight.dtype), lora_b.to(weight.dtype)
        out = torch.nn.functional.linear(flat, weight, bias)
        ctx.save_for_backward(flat, flat @ a.t() if ctx.needs_input_grad[4] else None, weight, a, b)
        ctx.scale, ctx.x_dtype, ctx.x_shape, ctx.a_dtype, ctx.b_dtype = scale, x.dtype, x.shape, lora_a.dtype, lora_b.dtype
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        flat, hidden, weight, a, b = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1]).to(weight.dtype)
        dx = (g @ weight).view(ctx.x_shape).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        da = ((g @ b).t() @ flat).to(ctx.a_dtype).mul_(ctx.scale) if ctx.needs_input_grad[3] else None
        db = (g.t() @ hidden).to(ctx.b_dtype).mul_(ctx.scale) if ctx.needs_input_grad[4] else None
        return dx, None, None, da, db, None


def _hooked(module: torch.nn.Module) -> bool:
    """Whether a forward hook sees `module`'s output: its own, or one registered for every
    module (`torch.nn.modules.module.register_module_forward_hook`, as some profilers do)."""
    return bool(module._forward_hooks) or bool(getattr(torch.nn.modules.module, "_global_forward_hooks", None))


def folded_weight(module: Any) -> torch.Tensor:
    """A LoRA layer's base weight plus its active adapters' deltas (`W + B A alpha / r`, as peft
    merges it), in the base weight's dtype and with autocast off: the one fold the sampler's copy
    (`folded`, `refold`) and the update's folded products (`lean_adapters`) all read."""
    with torch.autocast(module.get_base_layer().weight.device.type, enabled=False):
        return module.get_base_layer().weight + sum(module.get_delta_weight(name) for name in module.active_adapters if name in module.lora_A)


def has_adapters(model: torch.nn.Module) -> bool:
    """Whether `model` is a peft model whose adapters can be folded into its weights."""
    return callable(getattr(model, "merge_and_unload", None))


def merged(model: torch.nn.Module) -> torch.nn.Module:
    """A plain model: LoRA adapters folded into a copy of the base weights (the model itself is
    untouched); a model without adapters as it is."""
    if not has_adapters(model):
        return model
    return copy.deepcopy(model).merge_and_unload()


def folded(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`merged(model).to(dtype)` without a copy of the model in its own dtype first: each
    adapted layer's weight is folded (`W + B A alpha / r`, as peft merges it) and cast once,
    every other weight cast once, and the modules are copied around the new tensors (deepcopy's
    memo hands them over), the adapters left behind. The sampler's copy is made this way at
    every optimizer step: for SmolLM2, copying the fp32 model and merging took ~0.7 s of a
    ~14 s rollout. Adapters that peft merges otherwise (DoRA) take `merged`."""
    from peft.tuners.lora import LoraLayer

    if not has_adapters(model):
        return copy.deepcopy(model).to(dtype)
    base = model.get_base_model()
    adapted = [module for module in base.modules() if isinstance(module, LoraLayer)]
    if any(any(module.use_dora.get(name, False) for name in module.active_adapters) for module in adapted):
        return merged(model).to(dtype)
    memo: dict[int, Any] = {}
    with torch.no_grad():
        for module in adapted:
            layer = module.get_base_layer()
            memo[id(layer.weight)] = torch.nn.Parameter(folded_weight(module).to(dtype), requires_grad=False)
            own = {id(param) for param in layer.parameters()}  # the base layer's bias: cast below
            for param in module.parameters():  # the adapters: not carried into the copy
                if id(param) not in own:
                    memo[id(param)] = None
        for param in base.parameters():
            memo.setdefault(id(param), torch.nn.Parameter(param.detach().to(dtype, copy=True), requires_grad=False))
        plain = copy.deepcopy(base, memo)
    for name, module in list(plain.named_modules()):
        if isinstance(module, LoraLayer):
            parent, _, child = name.rpartition(".")
            setattr(plain.get_submodule(parent), child, module.get_base_layer())
    return plain.to(dtype)  # buffers too, as `merged(model).to(dtype)` casts them


def refold(copy: torch.nn.Module, model: torch.nn.Module) -> None:
    """Write `model`'s folded weights into `copy`, a `folded(model, dtype)` made earlier (its
    linear layers perhaps packed since), in place: what a fresh `folded` would hold, bit for bit,
    without deepcopying the modules again (for SmolLM2 the copy's ~120k objects took ~0.65 s of
    each GRPO step's rollout)."""
    from cgym.agents.local.packed import copy_weights
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    layers: dict[str, Any] = dict(base.named_modules())
    with torch.no_grad():
        for name, module in layers.items():
            if not isinstance(module, LoraLayer):
                continue
            layer = module.get_base_layer()
            if any(module.use_dora.get(adapter, False) for adapter in module.active_adapters):
                copy_weights(copy, merged(model))  # peft folds DoRA otherwise: take its fold whole
                return
            layers[name] = _Folded(folded_weight(module), layer.bias, layer.out_features)
    copy_weights(copy, layers)


@dataclass
class _Folded:
    """An adapted layer's folded weights, where `copy_weights` reads a source layer's."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    out_features: int
