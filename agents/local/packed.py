"""Linear layers with their weights pre-packed for oneDNN, for sampling on CPUs with native bf16.

A bf16 `F.linear` on the CPU hands oneDNN a plain row-major weight, which it reorders into its
blocked layout at every call. A decode step of a few rows is bound by reading the weights, and
the reorder reads and writes each one again: on the 2-core AVX512-BF16 machine a 1536 x 576
layer at 12 rows took 170 us (10 GB/s of weights) plain and 102 us (17 GB/s) packed once, with
the same products (`benchmarks/RESULTS.md`). Packing happens once per set of weights: when the
sampler folds or copies them for a new optimizer step.

Only for inference (the packed op has no backward) and only where `packable` says the CPU and
the dtype take it; the results match `F.linear` bit for bit on the machines measured, and
`tests/agents/local/test_packed.py` holds them to it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

_REORDER = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None)


class PackedLinear(nn.Module):
    """`nn.Linear`'s forward on a weight packed in oneDNN's layout; no `weight` parameter (the
    plain one is not kept) and no gradients."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.load(weight, bias)

    def load(self, weight: Tensor, bias: Tensor | None) -> None:
        """Pack new weights (of any dtype: cast to this layer's) in place of the current ones."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"weight of shape {tuple(weight.shape)} for a {self.in_features} -> {self.out_features} layer")
        self.packed = _REORDER(weight.detach().to(self.dtype), None)
        self.bias = None if bias is None else bias.detach().to(self.dtype).clone()

    def forward(self, x: Tensor) -> Tensor:
        return _LINEAR(x, self.packed, self.bias, "none", [None], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed"


class FusedLinear(PackedLinear):
    """Several linear layers that read the same input as one packed layer: their outputs side by
    side, in the order of `parts` (the names of the layers it replaces, beside it in its parent).
    Each output column is the same dot product as in its own layer."""

    def __init__(self, parts: tuple[str, ...], layers: list[nn.Module]) -> None:
        self.parts = parts
        self.widths = [layer.out_features for layer in layers]
        super().__init__(*_stacked(layers))

    def load_parts(self, layers: list[nn.Module]) -> None:
        """Pack the weights of new layers of the replaced shapes, in the order of `parts`."""
        if [layer.out_features for layer in layers] != self.widths:
            raise ValueError(f"layers of {[layer.out_features for layer in layers]} outputs for parts of {self.widths}")
        self.load(*_stacked(layers))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, parts={'+'.join(self.parts)}"


def _stacked(layers: list[nn.Module]) -> tuple[Tensor, Tensor | None]:
    weight = torch.cat([layer.weight.detach() for layer in layers])
    biases = [layer.bias for layer in layers]
    if all(bias is None for bias in biases):
        return weight, None
    return weight, torch.cat([b.detach() if b is not None else weight.new_zeros(layer.out_features) for b, layer in zip(biases, layers, strict=True)])


def packable(model: nn.Module) -> bool:
    """Whether `model`'s linear layers can be packed: bf16 weights on the CPU, and a PyTorch
    built with oneDNN's packed linear. (fp32 is left alone: there `F.linear` takes MKL's sgemm,
    and oneDNN's sums differ from it in the last bits.)"""
    param = next(model.parameters(), None)
    return param is not None and param.device.type == "cpu" and param.dtype == torch.bfloat16 and _REORDER is not None and _LINEAR is not None


def pack_linears(model: nn.Module) -> nn.Module:
    """Replace every `nn.Linear` of `model` (in place) by a `PackedLinear` of its weights, and
    return it; a model that is not `packable` is returned as it is. A weight another module
    shares (an LM head tied to the embeddings) stays where that module holds it."""
    if not packable(model):
        return model
    targets = [name for name, module in model.named_modules() if type(module) is nn.Linear]
    for done, name in enumerate(targets):  # one at a time: each plain weight goes as its packed one comes
        linear = model.get_submodule(name)
        try:
            layer = PackedLinear(linear.weight, linear.bias)
        except RuntimeError:  # a oneDNN build that cannot reorder these weights: plain layers then
            if done == 0:
                return model
            raise
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, layer)
    return model


def copy_weights(copy: nn.Module, source: nn.Module) -> None:
    """Copy `source`'s parameters into `copy`, a copy of it made earlier (in another dtype, its
    linear layers perhaps packed since), in place: packed layers pack the new weights again."""
    sources = dict(source.named_modules())
    with torch.no_grad():
        for name, module in copy.named_modules():
            if isinstance(module, FusedLinear):
                parent = name.rpartition(".")[0]
                module.load_parts([sources[f"{parent}.{part}" if parent else part] for part in module.parts])
                continue
            if isinstance(module, PackedLinear):
                module.load(sources[name].weight, sources[name].bias)
                continue
            for mine, theirs in zip(module.parameters(recurse=False), sources[name].parameters(recurse=False), strict=True):
                mine.copy_(theirs)


def own_weights(module: nn.Module) -> int:
    """Number of weights `module` holds itself, not through its children: its parameters, and a
    packed layer's packed ones (which are not parameters)."""
    own = sum(p.numel() for p in module.parameters(recurse=False))
    if isinstance(module, PackedLinear):
        own += module.in_features * module.out_features + (0 if module.bias is None else module.out_features)
    return own


def is_packed(model: nn.Module) -> bool:
    """Whether any linear layer of `model` is packed."""
    return any(isinstance(module, PackedLinear) for module in model.modules())
