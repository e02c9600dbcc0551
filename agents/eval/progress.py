"""Progress bars for long work (rich), as context managers that hand out an `advance` callback."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )


@contextmanager
def episode_progress(console: Console, total: int, description: str) -> Iterator[Callable[[Any], None]]:
    """A bar over episodes; the callback takes an `EpisodeResult` and shows the success rate and
    the sampled tokens per second so far."""
    done = {"n": 0, "ok": 0, "tokens": 0}
    started = time.perf_counter()
    with _progress(console) as progress:
        task = progress.add_task(description, total=total, status="")

        def advance(result: Any) -> None:
            done["n"] += 1
            done["ok"] += bool(getattr(result, "success", False))
            done["tokens"] += getattr(result, "sampled_tokens", 0)
            speed = done["tokens"] / max(time.perf_counter() - started, 1e-9)
            progress.update(task, advance=1, status=f"success {done['ok'] / done['n']:.0%} {speed:.0f} tok/s")

        yield advance


@contextmanager
def step_progress(console: Console, total: int, description: str, *, enabled: bool = True, start: int = 0) -> Iterator[Callable[[dict[str, Any]], None]]:
    """A bar over training steps; the callback takes the step's metrics row."""
    if not enabled:
        yield lambda row: None
        return
    with _progress(console) as progress:
        task = progress.add_task(description, total=total, completed=start, status="")

        def advance(row: dict[str, Any]) -> None:
            status = f"reward {row.get('reward_mean', 0):+.2f} success {row.get('success_rate', 0):.0%} loss {row.get('loss', 0):+.3f} {row.get('step_time_s', 0):.1f}s/step {speeds(row)}"
            progress.update(task, advance=1, status=status)

        yield advance


def speeds(row: dict[str, Any]) -> str:
    """Where a training step's time went, as tokens per second: sampled in the rollout, and
    through the forward/backward passes of the update."""
    update_s = row.get("step_time_s", 0.0) - row.get("rollout_time_s", 0.0)
    train = f" train {row['train_tokens'] / update_s:.0f} tok/s" if row.get("train_tokens") and update_s > 0 else ""
    return f"gen {row.get('tokens_per_s', 0):.0f} tok/s{train}"
