"""Progress bars for long work (rich), as context managers that hand out an `advance` callback."""

from __future__ import annotations

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
    """A bar over episodes; the callback takes an `EpisodeResult` and shows the success rate."""
    done = {"n": 0, "ok": 0}
    with _progress(console) as progress:
        task = progress.add_task(description, total=total, status="")

        def advance(result: Any) -> None:
            done["n"] += 1
            done["ok"] += bool(getattr(result, "success", False))
            progress.update(task, advance=1, status=f"success {done['ok'] / done['n']:.0%}")

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
            status = f"reward {row.get('reward_mean', 0):+.2f} success {row.get('success_rate', 0):.0%} loss {row.get('loss', 0):+.3f} {row.get('step_time_s', 0):.1f}s/step"
            progress.update(task, advance=1, status=status)

        yield advance
