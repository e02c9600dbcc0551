"""LoRA adapters (peft) on a causal LM: wrap for training, fold into plain weights for sampling and saving.

A LoRA-wrapped model computes `W x + (alpha / r) B A x` in every adapted linear layer: two extra
small matmuls per layer at every decode step. Folded (`W + (alpha / r) B A`), it is a plain model
again: it samples as fast as the base, takes the same kernels, and loads without peft.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import torch


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


def has_adapters(model: torch.nn.Module) -> bool:
    """Whether `model` is a peft model whose adapters can be folded into its weights."""
    return callable(getattr(model, "merge_and_unload", None))


def merged(model: torch.nn.Module) -> torch.nn.Module:
    """A plain model: LoRA adapters folded into a copy of the base weights (the model itself is
    untouched); a model without adapters as it is."""
    if not has_adapters(model):
        return model
    return copy.deepcopy(model).merge_and_unload()
