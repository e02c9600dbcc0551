"""Atomic, verified, resumable checkpoints: model + tokenizer (save_pretrained), optimizer, scheduler, step.

A checkpoint is written to a temporary directory and renamed into place, so a crash never
leaves a half-written one. Its `manifest.json`, written last, holds the size and sha256 of
every file, so a damaged checkpoint (truncated, bit-flipped, half-copied) is found before it
is loaded and the newest good one is resumed instead. `trainer_state.pt` holds only tensors
and plain Python values and is read with `torch.load(weights_only=True)`, so a pickle planted
in it cannot run code on `--resume`. Sampling and task RNGs are derived from (seed, step), so
restoring the weights and optimizer is enough to continue exactly.
"""

from __future__ import annotations

import json
import pickle
import random
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from cgym.agents.pretrained import sha256_of
from cgym.envs.errors import CgymError, first_line

STATE_FILE = "trainer_state.pt"
MANIFEST = "manifest.json"


class CheckpointError(CgymError):
    """A checkpoint that fails its manifest check or cannot be read safely."""


def save_checkpoint(directory: Path, *, model: Any, tokenizer: Any, optimizer: torch.optim.Optimizer, scheduler: Any, step: int, config: dict[str, Any]) -> Path:
    """Write `directory` atomically (temp dir, manifest last, then rename)."""
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    state = {"step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": _rng_state()}
    torch.save(state, tmp / STATE_FILE)
    (tmp / "train_config.json").write_text(json.dumps(config, indent=2, default=str))
    _write_manifest(tmp, step)
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
    """The newest `checkpoints/step-N` under `out` that passes `verify_checkpoint`; None if there are none.

    Newer ones that fail are skipped with a warning that names them; when every one fails,
    `CheckpointError` (rather than silently starting over).
    """
    return next(iter(good_checkpoints(out)), None)


def good_checkpoints(out: Path) -> Iterator[Path]:
    """The `checkpoints/step-N` under `out` that pass `verify_checkpoint`, newest first.

    Each one that fails is skipped with a warning that names it and the one tried instead; if the
    oldest fails too, `CheckpointError` (rather than silently starting over).
    """
    steps = [p for p in (Path(out) / "checkpoints").glob("step-*") if p.is_dir() and p.name[5:].isdigit()]
    damaged: list[str] = []
    for candidate in sorted(steps, key=lambda p: int(p.name[5:]), reverse=True):
        try:
            verify_checkpoint(candidate)
        except CheckpointError as exc:
            damaged.append(str(exc))
            continue
        for problem in damaged:
            warnings.warn(f"skipping a damaged checkpoint: {problem}; resuming from {candidate} instead", stacklevel=2)
        damaged.clear()
        yield candidate
    if damaged:
        raise CheckpointError(f"no checkpoint under {Path(out) / 'checkpoints'} passes its check ({damaged[0]}); --overwrite starts over")


def verify_checkpoint(directory: Path) -> None:
    """Raise `CheckpointError` unless the directory holds exactly the files its manifest lists,
    each with the recorded size and sha256."""
    directory = Path(directory)
    files = _read_manifest(directory)
    present = {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()} - {MANIFEST}
    if missing := sorted(set(files) - present):
        raise CheckpointError(f"{directory} lacks {missing[0]}, which its manifest lists")
    if extra := sorted(present - set(files)):
        raise CheckpointError(f"{directory} holds {extra[0]}, which its manifest does not list")
    for name, entry in files.items():
        path = directory / name
        if path.stat().st_size != entry["bytes"]:
            raise CheckpointError(f"{path} has {path.stat().st_size} bytes, its manifest says {entry['bytes']} (truncated?)")
        if sha256_of(path) != entry["sha256"]:
            raise CheckpointError(f"{path} does not match the sha256 in its manifest (the file is damaged)")


def load_state(directory: Path, *, optimizer: torch.optim.Optimizer, scheduler: Any) -> int:
    """Restore optimizer, scheduler and global RNGs; returns the step the checkpoint ended.

    Only tensors and plain values are unpickled (`weights_only=True`); anything else is a
    `CheckpointError`, never code run.
    """
    path = Path(directory) / STATE_FILE
    try:
        state = torch.load(path, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as exc:
        reason = first_line(exc) or type(exc).__name__
        raise CheckpointError(f"{path} cannot be loaded as plain tensors and values (weights_only=True): {reason}") from None
    try:
        _check_shapes(optimizer, state["optimizer"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        _set_rng_state(state["rng"])
        return int(state["step"])
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as exc:
        raise CheckpointError(f"{path} does not hold this run's optimizer, scheduler and RNG state ({type(exc).__name__}: {exc})") from None


def _check_shapes(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Refuse optimizer moments whose shapes differ from the parameters they would update
    (`load_state_dict` checks only the number of parameters): a state from another model."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, moments in saved["state"].items():
        for name, value in moments.items():
            if torch.is_tensor(value) and value.dim() > 0 and (int(index) >= len(params) or value.shape != params[int(index)].shape):
                shape = tuple(params[int(index)].shape) if int(index) < len(params) else "nothing"
                raise ValueError(f"parameter {index}'s {name} has shape {tuple(value.shape)}, the model's is {shape}: the state of another model")


# -- manifest ------------------------------------------------------------------------------
def _write_manifest(directory: Path, step: int) -> None:
    files = {p.relative_to(directory).as_posix(): {"bytes": p.stat().st_size, "sha256": sha256_of(p)} for p in sorted(directory.rglob("*")) if p.is_file()}
    (directory / MANIFEST).write_text(json.dumps({"step": step, "files": files}, indent=2))


def _read_manifest(directory: Path) -> dict[str, dict[str, Any]]:
    """The manifest's `files`, checked for shape: {relative path: {"bytes": int, "sha256": str}}."""
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{directory} has no {MANIFEST} (an interrupted copy, or a checkpoint from an older critique-gym)")
    try:
        files = json.loads(path.read_text()).get("files")
    except (ValueError, UnicodeDecodeError, AttributeError):
        files = None
    well_formed = isinstance(files, dict) and STATE_FILE in files and all(
        isinstance(e, dict) and isinstance(e.get("bytes"), int) and isinstance(e.get("sha256"), str) and ".." not in Path(n).parts and not Path(n).is_absolute()
        for n, e in files.items()
    )
    if not well_formed:
        raise CheckpointError(f"{path} is not a valid manifest")
    return files  # type: ignore[return-value]


# -- global RNGs, as tensors and lists (what weights_only loading accepts) ------------------
def _rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    version, internal, gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
        "python": {"version": int(version), "internal": [int(x) for x in internal], "gauss": gauss},
    }


def _set_rng_state(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    n = rng["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    p = rng["python"]
    random.setstate((p["version"], tuple(p["internal"]), p["gauss"]))
