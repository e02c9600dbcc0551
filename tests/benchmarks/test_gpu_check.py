"""benchmarks/gpu_check.py on a machine without a GPU: every check says why it skipped, exit 0."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from cgym.benchmarks import gpu_check


def test_without_a_gpu_every_check_is_skipped_with_its_reason(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["gpu_check", "--json", str(tmp_path / "gpu.json")])
    with pytest.raises(SystemExit) as exited:
        gpu_check.main()
    assert exited.value.code == 0
    checks = json.loads((tmp_path / "gpu.json").read_text())["checks"]
    assert set(checks) == {"train_cuda", "vllm_push", "train_vllm", "torchrun_nccl"}
    assert all(c["status"] == "skipped" and "CUDA" in c["why"] for c in checks.values())


def test_a_failing_check_is_reported_not_raised() -> None:
    def broken() -> dict:
        raise AssertionError("pushes did not reach vLLM")

    row = gpu_check._run(broken)
    assert row["status"] == "failed" and "pushes did not reach vLLM" in row["error"]
