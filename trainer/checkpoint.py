"""Atomic, resumable checkpoints: model + tokenizer (save_pretrained), optimizer, scheduler, step.

A checkpoint is written to a temporary directory and renamed into place, so a crash never
leaves a half-written one. Sampling and task RNGs are derived from (seed, step), so restoring
the weights and optimizer is enough to continue exactly.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

STATE_FILE = "trainer_state.pt"


def save_checkpoint(directory: Path, *, model: Any, tokenizer: Any, optimizer: torch.optim.Optimizer, scheduler: Any, step: int, config: dict[str, Any]) -> Path:
    """Write `directory` atomically (temp dir, then rename)."""
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    state = {
        "step": step,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
    }
    torch.save(state, tmp / STATE_FILE)
    (tmp / "train_config.json").write_text(json.dumps(config, indent=2, default=str))
    if directory.exists():
        old = directory.with_name(directory.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        directory.rename(old)
        tmp.rename(directory)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(directory)
    return directory


def latest_checkpoint(out: Path) -> Path | None:
    """The newest complete `checkpoints/step-N` under `out`, if any."""
    candidates = [p for p in (Path(out) / "checkpoints").glob("step-*") if (p / STATE_FILE).exists() and p.name[5:].isdigit()]
    return max(candidates, key=lambda p: int(p.name[5:]), default=None)


def load_state(directory: Path, *, optimizer: torch.optim.Optimizer, scheduler: Any) -> int:
    """Restore optimizer, scheduler and global RNGs; returns the step the checkpoint ended."""
    state = torch.load(Path(directory) / STATE_FILE, weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"]["torch"])
    np.random.set_state(state["rng"]["numpy"])
    random.setstate(state["rng"]["python"])
    return int(state["step"])
