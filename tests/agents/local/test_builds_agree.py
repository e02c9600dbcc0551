"""The AVX2 build of the kernels (`agents.local.avx2`) against the AVX-512 build, on a CPU that
runs both: every kernel's outputs, bit for bit. Each build runs in its own process, the same
script (`build_outputs.py`) on the same seeded inputs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cgym.agents.local.kernels import AVX512, ISA_ENV, KERNEL_ENV, cpu_flags, enabled
from cgym.agents.local.lean_layers import _library

pytestmark = pytest.mark.skipif(
    not AVX512 <= cpu_flags() or not enabled() or _library() is None, reason="the AVX2 and AVX-512 builds both run only on an AVX-512 CPU with a C compiler"
)

SCRIPT = Path(__file__).with_name("build_outputs.py")


def _outputs(tiny_chat_model: Path, tmp_path: Path, isa: str) -> dict:
    target = tmp_path / f"{isa}.pt"
    env = {**os.environ, ISA_ENV: isa, KERNEL_ENV: "1"}
    subprocess.run([sys.executable, str(SCRIPT), str(tiny_chat_model), str(target)], env=env, check=True, timeout=600)
    return torch.load(target, weights_only=False)


def _same(mine: object, theirs: object) -> bool:
    if isinstance(mine, torch.Tensor):
        return isinstance(theirs, torch.Tensor) and mine.dtype == theirs.dtype and torch.equal(mine, theirs)
    if isinstance(mine, (list, tuple)):
        return isinstance(theirs, (list, tuple)) and len(mine) == len(theirs) and all(_same(a, b) for a, b in zip(mine, theirs))
    return mine == theirs


def test_the_avx2_build_computes_the_avx512_builds_bits(tiny_chat_model: Path, tmp_path: Path) -> None:
    wide, halves = (_outputs(tiny_chat_model, tmp_path, isa) for isa in ("avx512", "avx2"))
    assert (wide["isa"], halves["isa"]) == ("avx512", "avx2")
    everything = {"attention_backward", "layer_step", "lean_layers", "own_attention", "pair_linear", "pick", "row_logprobs", "step_attention", "training_ops"}
    assert everything <= set(wide["kernels"]) and everything <= set(halves["kernels"])
    assert wide["outputs"].keys() == halves["outputs"].keys()
    differ = [name for name, value in wide["outputs"].items() if not _same(value, halves["outputs"][name])]
    assert not differ, f"the builds differ in {differ}"
