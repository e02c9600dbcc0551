"""The kernel-sampling benchmark: both arms on the same tasks, a paired difference, bad flags refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cgym.agents.local.decode_attention import KERNEL_ENV
from cgym.benchmarks.kernel_sampling import main
from cgym.trainer.tiny import build_tiny

from tests.agents.local.test_hf import SIZES, chat_corpus


def test_both_arms_run_on_the_same_seeds_and_the_json_pairs_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    model = build_tiny(tmp_path / "tiny", chat_corpus(), **SIZES)
    out = tmp_path / "kernel.json"
    main(["--model", str(model), "--episodes", "2", "--rounds", "2", "--json", str(out)])
    result = json.loads(out.read_text())
    assert [(r["kernel"], r["seed"]) for r in result["runs"]] == [(True, 500), (False, 500), (True, 501), (False, 501)]
    difference = result["kernel_minus_flash"]
    assert difference["episodes"] == 2 and difference["seeds"] == 2
    assert difference["low"] <= difference["mean"] <= difference["high"]
    assert result["env_kwargs"]["split"] == "train"


@pytest.mark.parametrize("flags", [["--episodes", "0"], ["--rounds", "0"], ["--temperature", "0"]])
def test_bad_counts_are_refused_without_a_traceback(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--model", "unused", *flags])
    assert exit_.value.code == 2 and "--episodes" in capsys.readouterr().err
