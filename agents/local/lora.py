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
    """Within the block, `model`'s plain LoRA layers add their adapter's output as one product,
    `base(x) += s (A x) B^T` in a single `addmm_` into the base product's own output, where peft
    writes three full-size tensors (the adapter's output, its scaling, the sum) and its backward a
    fourth (the scaled gradient); the scale then falls on rank-wide tensors only. (An out-of-place
    `addmm` copied the base output first: 0.67-0.81 against 0.26-0.27 s of copies in a SmolLM2
    update on the Ice Lake, torch.profiler, ad hoc `lora_prof.py`.) Yields how many layers that covers.

    In fp32 outside autocast only; anywhere else (bf16 autocast, dropout, several adapters, DoRA,
    disabled or merged adapters) a layer runs peft's forward. Where the scale alpha / r is a power
    of two (`with_lora`'s 2) nothing rounds differently: the outputs and gradients are peft's bit
    for bit (`tests/agents/local/test_lora.py`). Its effect on SmolLM2's update on the Ice Lake:
    `benchmarks/RESULTS.md`."""
    from peft.tuners.lora.layer import Linear

    layers = [module for module in model.modules() if type(module) is Linear]  # not peft's quantized or other layer kinds
    with replaced(layers, "forward", lambda layer: partial(_adapted, layer)) as count:
        yield count


def _adapted(layer: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """A peft LoRA `Linear`'s forward with its one adapter's sum in one `addmm_` (`lean_adapters`).
    The base product runs on the rows flattened (as `F.linear` flattens them) and the adapter on
    `x` as it comes: the gradients into `x` then add up in peft's order, bit for bit."""
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
        and x.dtype == layer.lora_A[name].weight.dtype == layer.lora_B[name].weight.dtype == layer.get_base_layer().weight.dtype == torch.float32
        and not torch.is_autocast_enabled(x.device.type)
        and not _hooked(layer.base_layer)  # the base product is summed into in place: nothing else may hold it
    )
    if not plain:
        return type(layer).forward(layer, x, *args, **kwargs)
    result = layer.base_layer(x.reshape(-1, x.shape[-1]))  # a new tensor that its product's backward pass does not read: summed into in place
    hidden = layer.lora_A[name](x)
    result.addmm_(hidden.reshape(-1, hidden.shape[-1]), layer.lora_B[name].weight.t(), alpha=layer.scaling[name])
    return result.view(*x.shape[:-1], result.shape[-1])


def _hooked(module: torch.nn.Module) -> bool:
    """Whether a forward hook sees `module`'s output: its own, or one registered for every
    module (`torch.nn.modules.module.register_module_forward_hook`, as some profilers do)."""
    return bool(module._forward_hooks) or bool(getattr(torch.nn.modules.module, "_global_forward_hooks", None))


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
            delta = sum(module.get_delta_weight(name) for name in module.active_adapters if name in module.lora_A)
            memo[id(layer.weight)] = torch.nn.Parameter((layer.weight + delta).to(dtype), requires_grad=False)
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
            delta = sum(module.get_delta_weight(adapter) for adapter in module.active_adapters if adapter in module.lora_A)
            layers[name] = _Folded(layer.weight + delta, layer.bias, layer.out_features)
    copy_weights(copy, layers)


@dataclass
class _Folded:
    """An adapted layer's folded weights, where `copy_weights` reads a source layer's."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    out_features: int
