"""`cgym quickstart` end to end on a shrunken plan: every phase runs and every promised file appears."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cgym.agents.local.hf import load_tokenizer
from cgym.agents.tool_prompt import tool_layout
from cgym.trainer.quickstart import QuickstartPlan, run
from rich.console import Console

SMALL = dict(sft_demos=8, train_steps=1, group_size=2, tasks_per_step=2, eval_episodes=4, lora_r=4, learning_rate=1e-3)


def test_quickstart_writes_the_reports_and_the_figures(tmp_path: Path, tiny_chat_model: Path) -> None:
    plan = QuickstartPlan(model=str(tiny_chat_model), tool_layout="compact", **SMALL)
    console = Console(record=True, width=200)
    summary = run(tmp_path, plan, console=console)
    for name in ("report.md", "report.html", "compare.json", "compare.png", "quickstart.json", "grpo/curve.png", "grpo/final/config.json"):
        assert (tmp_path / name).is_file(), name
    compare = json.loads((tmp_path / "compare.json").read_text())
    assert {"before", "after", "arms", "paired", "differing"} <= compare.keys() and compare["before"]["episodes"] == 4
    assert compare["labels"][0].startswith("prompt-only") and compare["labels"][-1].startswith("SFT + GRPO")
    assert compare["before"] == compare["arms"][compare["labels"][0]] and compare["after"] == compare["arms"][compare["labels"][-1]]
    assert list(summary["arms"]) == ["prompt-only", "SFT", "SFT + GRPO"]
    assert 0.0 <= summary["before_success"] <= 1.0 and 0.0 <= summary["after_success"] <= 1.0
    gain = summary["grpo_gain"]
    assert gain["episodes"] == 4 and gain["low"] <= gain["mean"] <= gain["high"]
    assert gain["mean"] == summary["after_success"] - summary["arms"]["SFT"]
    assert set(summary["timings_s"]) == {"model", "sft", "train", "compare", "total"}
    memory = list(summary["peak_rss_gb"].values())  # high-water marks after each phase
    assert list(summary["peak_rss_gb"]) == ["model", "sft", "train", "compare"] and 0 < memory[0] and memory == sorted(memory)
    for model in ("sft", "grpo/final"):  # the layout is the SFT'd model's, and GRPO's model keeps it
        assert tool_layout(load_tokenizer(tmp_path / model)) == "compact", model
    assert summary["tool_layout"] == "compact"
    assert f"| sft | {summary['timings_s']['sft']:.0f} s | {summary['peak_rss_gb']['sft']:.2f} GiB |" in (tmp_path / "report.md").read_text()
    assert json.loads((tmp_path / "quickstart.json").read_text()) == summary
    printed = console.export_text()
    assert "report.html" in printed and "expected: about" in printed and "GRPO's own gain" in printed
    # 8 demonstrations of an untrained tiny model solve nothing: the hint must show
    assert summary["arms"]["SFT"] < 0.05 and "larger --sft-demos" in printed


def test_a_seed_gives_the_same_models_on_every_run(tmp_path: Path, tiny_chat_model: Path) -> None:
    """Phases are set by step counts, never by a clock: two runs of one seed end bit-identical."""
    from safetensors.torch import load_file

    plan = QuickstartPlan(model=str(tiny_chat_model), **(SMALL | {"eval_episodes": 1}))
    for run_dir in ("a", "b"):
        run(tmp_path / run_dir, plan, console=Console(quiet=True))
    for weights in ("sft/model.safetensors", "grpo/final/model.safetensors"):
        a, b = load_file(tmp_path / "a" / weights), load_file(tmp_path / "b" / weights)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), weights


def test_embedded_model_drills_mix_copies_and_look_ups(monkeypatch, tmp_path: Path) -> None:
    import cgym.trainer.embedded as pipeline
    from transformers import AutoTokenizer

    seen: list = []
    monkeypatch.setattr(pipeline, "fit", lambda model, drills, out, **kwargs: seen.extend(drills))
    pipeline.build_embedded_model(tmp_path / "tiny", copy_steps=2, progress=False)
    opening = AutoTokenizer.from_pretrained(tmp_path / "tiny")('{"', add_special_tokens=False)["input_ids"]
    copies = [ids for ids, _ in seen if ids[: (len(ids) - 1) // 2] == ids[(len(ids) + 1) // 2 :]]
    look_ups = [ids for ids, _ in seen if ids[: len(opening)] == opening and ids not in copies]
    lookup_share = pipeline.COPY_PRETRAIN["lookup_share"]
    assert len(seen) == 2 * pipeline.COPY_PRETRAIN["batch_size"]
    assert len(look_ups) == round(len(seen) * lookup_share) and len(copies) == len(seen) - len(look_ups)


def test_the_printed_estimate_follows_the_compute_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 CPUs run the quickstart ~3x faster than fp32 ones, and fp32 ones with the kernels ~2x: the estimate says so."""
    from cgym.agents.local import precision
    from cgym.agents.local.precision import DTYPE_ENV
    from cgym.trainer.quickstart import QuickstartPlan

    seconds = {}
    for dtype in ("float32", "bfloat16"):
        monkeypatch.setenv(DTYPE_ENV, dtype)
        seconds[dtype] = QuickstartPlan().expected_seconds
    monkeypatch.delenv(DTYPE_ENV)
    monkeypatch.setattr(precision, "kernels_in_fp32", lambda: True)  # fp32 training, bf16 sampling in the kernels
    seconds["kernels"] = QuickstartPlan().expected_seconds
    assert 150 < seconds["bfloat16"] < 300 < seconds["kernels"] < 400 < 500 < seconds["float32"] < 800


def test_the_sft_phase_trains_in_fp32_where_the_cpu_computes_in_bf16(tmp_path: Path, tiny_chat_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 SFT learned far less from the same demonstrations (`precision.computing_in`): the
    quickstart's SFT phase computes in fp32, and the phases after it in the machine's dtype again."""
    from cgym.agents.local import precision
    from cgym.agents.local.precision import DTYPE_ENV, compute_dtype
    from cgym.trainer import sft as sft_module

    class Stop(Exception):
        pass

    seen: list[torch.dtype] = []

    def stub(*args: object, **kwargs: object) -> None:
        seen.append(compute_dtype())
        raise Stop

    monkeypatch.delenv(DTYPE_ENV, raising=False)
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: True)
    monkeypatch.setattr(sft_module, "sft", stub)
    with pytest.raises(Stop):
        run(tmp_path, QuickstartPlan(model=str(tiny_chat_model), **SMALL), console=Console(quiet=True))
    assert seen == [torch.float32] and compute_dtype() == torch.bfloat16
