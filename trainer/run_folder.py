"""One folder, one run: a training run's `out` folder is continued (`resume`) or replaced
(`overwrite`), never mixed with another run's checkpoints and metrics."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from cgym.envs.errors import ConfigError
from cgym.trainer.config import TrainConfig, resume_conflicts

CONFIG_FILE = "train_config.json"
RUN_DIRS = ("checkpoints", "final", "served")
RUN_FILES = (CONFIG_FILE, "metrics.jsonl", "curve.png")


def run_contents(out: Path) -> list[str]:
    """What a run has written under `out` (empty for a new or unrelated folder)."""
    out = Path(out)
    found = [name for name in RUN_DIRS if (out / name).is_dir()]
    found += [name for name in RUN_FILES if (out / name).is_file()]
    found += sorted(p.name for p in out.glob("metrics.jsonl.*.bak"))
    return found


def check_out(config: TrainConfig, *, resume: bool, overwrite: bool) -> None:
    """Refuse to start where a run already is, unless told what to do with it; refuse to resume a
    different run. Reads only, so every process of a distributed run can call it."""
    if resume and overwrite:
        raise ConfigError("resume continues the run in out and overwrite replaces it: choose one")
    out = Path(config.out)
    if resume:
        check_same_run(out / CONFIG_FILE, config)
    elif not overwrite and (found := run_contents(out)):
        raise ConfigError(f"{out} already holds a run ({', '.join(found[:3])}): pass --resume to continue it or --overwrite to start over")


def check_same_run(saved: Path, config: TrainConfig) -> None:
    """Refuse `config` if the run whose config was saved at `saved` is a different one (no file: no run to differ from)."""
    if not saved.is_file():
        return
    try:
        values = json.loads(saved.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"cannot read {saved} to check that --resume continues the same run ({exc}); --overwrite starts over") from None
    conflicts = resume_conflicts(values, config) if isinstance(values, dict) else [f"{saved} holds no config object"]
    if conflicts:
        more = f" (and {len(conflicts) - 3} more)" if len(conflicts) > 3 else ""
        raise ConfigError(
            f"--resume would continue a different run from {saved.parent}: {'; '.join(conflicts[:3])}{more}. Resume with the same settings, or --overwrite to start over"
        )


def clear_run(out: Path) -> None:
    """Remove what a run wrote under `out`, and nothing else."""
    out = Path(out)
    for name in RUN_DIRS:
        shutil.rmtree(out / name, ignore_errors=True)
    for name in (*RUN_FILES, *(p.name for p in out.glob("metrics.jsonl.*.bak"))):
        (out / name).unlink(missing_ok=True)
