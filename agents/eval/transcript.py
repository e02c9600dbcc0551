"""A readable transcript of one episode: messages, tool calls, critiques, reward."""

from __future__ import annotations

from cgym.agents.eval.episodes import EpisodeResult
from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.text import Text

_STYLE = {"system": "dim", "user": "cyan", "assistant": "green", "tool": "yellow"}


def print_transcript(console: Console, result: EpisodeResult) -> None:
    by_step: dict[int, list[dict]] = {}
    for critique in result.critiques:
        by_step.setdefault(critique["step"], []).append(critique)
    turn = 0
    for message in result.conversation.messages:
        role = message["role"]
        title = role if role != "tool" else f"tool: {message.get('name', '')}"
        console.print(Panel(Text(message["content"]), title=title, border_style=_STYLE.get(role, "white"), title_align="left"))
        if role == "assistant":
            turn += 1
            for critique in by_step.get(turn, []):
                console.print(f"  [red]critique[/red] step {turn} [bold]{critique['code']}[/bold]: {escape(critique['message'])}")
    verdict = "[green]success[/green]" if result.success else "[red]failure[/red]"
    console.print(f"{verdict}  reward {result.reward:+.2f}  breakdown {escape(str(result.breakdown))}")
    if result.record is not None:
        console.print(Panel(Text(result.critique("step")), title="step-level critique", border_style="magenta", title_align="left"))
