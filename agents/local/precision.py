"""bf16 compute on CPUs that have it, fp32 master weights everywhere.

On this project's 2-core machines (AVX512-BF16) a bf16 matmul ran ~2-3x faster than fp32, and a
batched decode step ~1.7x. Sampling uses a bf16 copy of the weights (`SamplingWeights`), the
training passes run under autocast, and every log-softmax is taken in fp32. `CGYM_DTYPE=float32`
turns bf16 off.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass
from functools import cache, partial

import torch
from cgym.agents.local.instances import replaced
from cgym.agents.local.kernels import available as kernels_available
from cgym.agents.local.kernels import cpu_flags
from cgym.agents.local.kv_cache import FOLDED_FROM, attention_on_pairs, weights_version
from cgym.agents.local.lean_layers import samples_lean, sampling_model
from cgym.agents.local.lora import folded, has_adapters, refold
from cgym.agents.local.packed import copy_weights

DTYPE_ENV = "CGYM_DTYPE"


NATIVE_BF16 = frozenset({"avx512_bf16", "amx_bf16"})


def native_bf16(flags: frozenset[str]) -> bool:
    """Whether CPU `flags` include bf16 dot products. oneDNN also calls bf16 "supported" on plain
    AVX-512 (Ice Lake, Skylake), where it emulates it: 70 against 360 GFLOP/s for fp32 measured
    on a 2-core Ice Lake."""
    return bool(flags & NATIVE_BF16)


@cache
def cpu_has_bf16() -> bool:
    """Whether this CPU runs bf16 matmuls natively: its flags say so and oneDNN takes them."""
    try:
        onednn = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False
    return onednn and native_bf16(cpu_flags())


_CHOSEN: ContextVar[torch.dtype | None] = ContextVar("cgym_compute_dtype", default=None)


def _forced() -> torch.dtype | None:
    """`CGYM_DTYPE`'s dtype, else the one a `computing_in` block chose, else None."""
    forced = os.environ.get(DTYPE_ENV, "").strip().lower()
    if forced in ("float32", "fp32"):
        return torch.float32
    if forced in ("bfloat16", "bf16"):
        return torch.bfloat16
    return _CHOSEN.get()


@contextmanager
def computing_in(dtype: torch.dtype) -> Iterator[None]:
    """Within the block, compute in `dtype` as `CGYM_DTYPE` would set it (which still wins: it
    is the user's word). The quickstart's SFT phase trains in fp32 this way on every machine:
    on the AVX512-BF16 machine its short bf16 SFT (8 steps at 5e-5) ended at 8-9% greedy success
    against 51% in fp32 from the same demonstrations and steps, where a longer or faster one
    reaches 100% in either dtype (`benchmarks/RESULTS.md`)."""
    token = _CHOSEN.set(dtype)
    try:
        yield
    finally:
        _CHOSEN.reset(token)


def compute_dtype(device: torch.device | str = "cpu") -> torch.dtype:
    """bf16 on GPUs and on CPUs with native bf16, else fp32; `CGYM_DTYPE`, then a
    `computing_in` block, overrides."""
    forced = _forced()
    if forced is not None:
        return forced
    if torch.device(device).type != "cpu":
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_bf16() else torch.float32


def sampling_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype `model` samples in: the compute dtype, and bf16 also on a CPU without native
    bf16 where a Llama or Qwen2 samples through this project's kernels (`samples_lean`). Those
    read bf16 weights and sum in fp32 with AVX512F, so a decode step reads half the bytes of
    fp32's and none of its matmuls go to oneDNN's emulated bf16 (~70 GFLOP/s on an Ice Lake that
    runs fp32 at ~250-360). Training stays in the compute dtype. `CGYM_DTYPE` overrides both."""
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    dtype = compute_dtype(device)
    if device.type == "cpu" and kernels_in_fp32() and samples_lean(model):
        return torch.bfloat16
    return dtype


def kernels_in_fp32() -> bool:
    """Whether this CPU computes in fp32 and still runs the kernels: no native bf16, AVX-512,
    `CGYM_DTYPE` unset. There a Llama or Qwen2 samples in bf16 and attention trains on bf16 pairs."""
    return compute_dtype() == torch.float32 and _forced() is None and kernels_available()


def autocast(model: torch.nn.Module) -> AbstractContextManager[object]:
    """Autocast to the compute dtype for a training pass of fp32 `model`. In fp32 nothing is cast,
    but on a CPU without native bf16 whose kernels run, attention takes its products on bf16
    pairs there (`kv_cache.attention_on_pairs`; `CGYM_DTYPE=float32` keeps it fp32): a GRPO
    update on an Ice Lake took 22.2-23.5 s against 25.9-28.8 with the flash kernel in fp32."""
    device = next(model.parameters()).device
    dtype = compute_dtype(device)
    if next(model.parameters()).dtype != torch.float32:
        return nullcontext()
    if dtype == torch.float32:
        return attention_on_pairs() if device.type == "cpu" and kernels_in_fp32() else nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


@contextmanager
def frozen_weights_cast(model: torch.nn.Module) -> Iterator[int]:
    """Within the block, the frozen linear layers of fp32 `model` (a LoRA model's base layers and
    its tied LM head) read one copy of their weights in the compute dtype under `autocast`, made at
    a layer's first call there; yields how many layers that covers (0 where nothing changes: fp32
    compute, a model that is not fp32, or one with no frozen linear layers).

    Autocast keeps its casts only of weights that take gradients, so a frozen weight was cast
    again at every call: in every micro-batch's forward, in each recomputed layer, and once more
    held for every backward pass. LoRA's adapter layers also cast their bf16 input up to their
    weights' fp32 before autocast cast it back down; here they take it as it comes. Both are
    exact: the products and their gradients are bit for bit those of plain autocast
    (`tests/agents/local/test_precision.py`). Outside autocast, or in another dtype, a layer
    reads its own weights as before. Hold it over a whole update, not across a weight change of
    the frozen layers (nothing in training changes them).
    """
    param = next(model.parameters(), None)
    dtype = compute_dtype(param.device) if param is not None else torch.float32
    if param is None or dtype == torch.float32 or param.dtype != torch.float32:
        yield 0
        return
    frozen = [m for m in model.modules() if type(m) is torch.nn.Linear and not any(p.requires_grad for p in m.parameters())]
    adapters = [m for m in model.modules() if callable(getattr(m, "_cast_input_dtype", None))]
    with replaced(adapters, "cast_input_dtype_enabled", lambda _: False), replaced(frozen, "forward", partial(_cast_forward, dtype=dtype)) as count:
        yield count


def _cast_forward(layer: torch.nn.Linear, *, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
    """`layer`'s forward reading its weights cast to `dtype` once (`frozen_weights_cast`)."""
    return partial(_linear_in, layer, _Cast(layer, dtype))


@dataclass
class _Cast:
    """`layer`'s weight and bias cast to `dtype`, made at the first call that reads them: a
    LoRA base layer whose adapted layer multiplies by its folded weight (`lora.lean_adapters`)
    never calls its own forward, and its copy is never made."""

    layer: torch.nn.Linear
    dtype: torch.dtype
    weights: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.weights is None:
            bias = self.layer.bias
            self.weights = (self.layer.weight.detach().to(self.dtype), None if bias is None else bias.detach().to(self.dtype))
        return self.weights


def _linear_in(layer: torch.nn.Linear, cast: _Cast, x: torch.Tensor) -> torch.Tensor:
    """`layer`'s forward on its `cast` copy where autocast runs in that copy's dtype."""
    device = x.device.type
    if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == cast.dtype:
        return torch.nn.functional.linear(x, *cast())
    return torch.nn.functional.linear(x, layer.weight, layer.bias)


class SamplingWeights:
    """A copy of `model` in the compute dtype for sampling, refreshed when the weights change.

    Autocast re-casts every weight at every decode step; a copy made once per optimizer step
    costs one cast of the weights, and packs its linear layers for oneDNN where the CPU takes
    it (`agents.local.packed`: a decode step of a GRPO group's rows reads each weight once, not
    twice), with Llama and Qwen2 layers in fewer ops (`agents.local.lean_layers`). Where the
    compute dtype is the model's own, it is the model, unless it is LoRA-wrapped: a LoRA model's
    copy, in any dtype, has its adapters folded in, so sampling runs a plain model (on the fp32
    EPYC, one GRPO step's rollout of 4 x 8 ApiReport episodes took 50.8 s through peft's adapter
    layers and 34.9 s on the folded copy). Either copy is refreshed in place at each new version
    of the weights, and held between versions (for SmolLM2, ~0.3 GB more through an update).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._copy: torch.nn.Module | None = None
        self._version: tuple[int, int] | None = None

    @property
    def separate(self) -> bool:
        """Whether sampling runs on a copy in another dtype (its log-probs then differ a little)."""
        return sampling_dtype(self.model) != next(self.model.parameters()).dtype

    def get(self) -> torch.nn.Module:
        adapters = has_adapters(self.model)
        if not self.separate and not adapters:
            return self.model
        dtype = sampling_dtype(self.model)
        version = weights_version(self.model)
        if adapters and self._copy is None:  # LoRA: a plain copy with the adapters folded in
            self._copy = sampling_model(folded(self.model, dtype).eval().requires_grad_(False))
        elif adapters and version != self._version:
            refold(self._copy, self.model)
        elif self._copy is None:
            self._copy = sampling_model(copy.deepcopy(self.model).to(dtype).eval().requires_grad_(False))
        elif version != self._version:
            copy_weights(self._copy, self.model)
        setattr(self._copy, FOLDED_FROM, version)  # what the caches compare (`weights_version`)
        self._version = version
        return self._copy
