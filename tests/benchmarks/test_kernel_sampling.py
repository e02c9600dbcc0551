"""The kernel-sampling benchmark: both arms on the same tasks, a paired difference, bad flags refused."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from cgym.agents.eval import evaluate as evaluate_module
from cgym.agents.local.decode_attention import KERNEL_ENV
from cgym.benchmarks.kernel_sampling import main
from cgym.trainer.tiny import build_tiny

from tests.agents.local.test_hf import SIZES, chat_corpus


@pytest.mark.parametrize("callers", [None, "1"])
def test_both_arms_run_on_the_same_seeds_and_the_json_pairs_them(callers: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each arm's episodes run with the kernel switched as it says, and the caller's switch is
    put back afterwards (unset, or set)."""
    if callers is None:
        monkeypatch.delenv(KERNEL_ENV, raising=False)
    else:
        monkeypatch.setenv(KERNEL_ENV, callers)
    switches: list[str | None] = []
    real = evaluate_module.evaluate

    def recording(*args: Any, **kwargs: Any) -> Any:
        switches.append(os.environ.get(KERNEL_ENV))
        return real(*args, **kwargs)

    monkeypatch.setattr(evaluate_module, "evaluate", recording)
    model = build_tiny(tmp_path / "tiny", chat_corpus(), **SIZES)
    out = tmp_path / "kernel.json"
    main(["--model", str(model), "--episodes", "2", "--rounds", "2", "--json", str(out)])
    result = json.loads(out.read_text())
    assert [(r["kernel"], r["seed"]) for r in result["runs"]] == [(True, 500), (False, 500), (True, 501), (False, 501)]
    assert switches == ["1", "0", "1", "0"]
    assert os.environ.get(KERNEL_ENV) == callers
    difference = result["kernel_minus_flash"]
    assert difference["episodes"] == 2 and difference["seeds"] == 2
    assert difference["low"] <= difference["mean"] <= difference["high"]
    assert result["env_kwargs"]["split"] == "train"


@pytest.mark.parametrize("flags", [["--episodes", "0"], ["--rounds", "0"], ["--temperature", "0"]])
def test_bad_counts_are_refused_without_a_traceback(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--model", "unused", *flags])
    assert exit_.value.code == 2 and "--episodes" in capsys.readouterr().err
