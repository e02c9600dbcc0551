"""`cgym quickstart`: the whole story on a laptop CPU, end to end, in about ten minutes.

the pretrained model (SmolLM2-135M-Instruct, fetched once) -> a short SFT warm start on scripted
demos -> GRPO with step-level critiques (Critique-GRPO rescues groups that all failed) -> compare
prompt-only, prompted, SFT and trained on the same test episodes -> report.md, report.html,
compare.json, curve.png.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

ENV_ID = "cgym/ApiReport-v0"
WEAK_SFT = 0.05
WEAK_SFT_HINT = "the SFT'd model solved almost no test task, so GRPO had nothing to sharpen; try a larger --sft-demos or another --seed"


@dataclass(frozen=True)
class QuickstartPlan:
    """What each phase does; step counts set the work, so a run repeats itself on one machine."""

    model: str = "smollm2-135m"
    """The pretrained model (short name, directory or .gguf file)."""
    difficulty: str = "easy"
    sft_demos: int = 80
    """Scripted demonstrations for the warm start, one epoch (10 steps of 8). SmolLM2 learns easy
    fast: 8 steps gave 29% greedy, 10 steps 98%, 12 steps 100% (and 66% sampled at temperature 1,
    the room GRPO trains in)."""
    sft_epochs: float = 1.0
    sft_seconds: float = 240.0
    """A cap for slower machines (a cap that ends a phase makes the result machine-dependent)."""
    sft_lr: float = 5e-5
    train_steps: int = 1
    """One step of 2 tasks x 8 (~60 s on 2 cores): what is left of ten minutes after SFT and
    four 100-episode evaluations. The GRPO phase shows the pipeline end to end; what GRPO does
    for the model is measured apart, with room to train (see the README)."""
    train_seconds: float = 150.0
    group_size: int = 8
    tasks_per_step: int = 2
    learning_rate: float = 1e-5
    temperature: float = 1.0
    refine_attempts: int = 2
    eval_episodes: int = 100
    critique: str = "step"
    seed: int = 0


def run(out: Path, plan: QuickstartPlan = QuickstartPlan(), *, console: Console | None = None) -> dict[str, Any]:
    """Run every phase; returns the timings and the figures of every arm."""
    from agents.demos import demonstrations
    from agents.evaluate import EvalConfig
    from agents.hf import HFPolicy
    from agents.pretrained import resolve_model
    from agents.prompting import PromptedPolicy
    from trainer.compare import compare
    from trainer.config import TrainConfig
    from trainer.embedded import prepare_models
    from trainer.grpo import train
    from trainer.report import write_reports
    from trainer.sft import sft

    console = console or Console()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    started = time.perf_counter()

    def phase(name: str) -> None:
        timings[name] = round(time.perf_counter() - started - sum(timings.values()), 1)
        console.print(f"[green]done[/green] {name} in {timings[name]:.0f}s (total {time.perf_counter() - started:.0f}s)")

    console.rule(f"1/4 the pretrained model: {plan.model}")
    prepare_models(plan.model)
    base = resolve_model(plan.model)
    phase("model")

    console.rule(f"2/4 SFT warm start on {plan.sft_demos} scripted demonstrations")
    env_kwargs = {"difficulty": plan.difficulty}
    demos = demonstrations(ENV_ID, env_kwargs, episodes=plan.sft_demos, seed=plan.seed + 1)
    sft(base, demos, out / "sft", lr=plan.sft_lr, epochs=plan.sft_epochs, time_budget_s=plan.sft_seconds, seed=plan.seed)
    phase("sft")

    console.rule("3/4 GRPO + Critique-GRPO on the train split")
    config = TrainConfig(
        env_id=ENV_ID, env_kwargs=env_kwargs, model=str(out / "sft"), out=str(out / "grpo"), steps=plan.train_steps,
        group_size=plan.group_size, tasks_per_step=plan.tasks_per_step, learning_rate=plan.learning_rate,
        temperature=plan.temperature, critique=plan.critique, refine_attempts=plan.refine_attempts, time_budget_s=plan.train_seconds, seed=plan.seed,
        eval_episodes=0,  # every arm is measured once, by the comparison below, on the same episodes
    )  # fmt: skip
    trained = train(config, console=console)
    phase("train")

    console.rule("4/4 compare prompt-only, prompted, SFT and trained on the same test episodes (greedy)")
    eval_config = EvalConfig(ENV_ID, {**env_kwargs, "split": "test"}, episodes=plan.eval_episodes, seed=10_000, batch_size=100)
    greedy = {"temperature": 0.0, "max_new_tokens": config.max_new_tokens, "seed": 0}
    shipped = HFPolicy.from_pretrained(base, **greedy)
    arms = [
        ("prompt-only (the instruct model as shipped)", shipped),
        ("prompted (the article's rules added)", PromptedPolicy(HFPolicy(shipped.model, shipped.tokenizer, **greedy))),
        ("SFT", HFPolicy.from_pretrained(out / "sft", **greedy)),
        ("trained (SFT + GRPO, step critiques)", HFPolicy.from_pretrained(trained["final"], **greedy)),
    ]
    result = compare(arms, eval_config, on_arm=lambda label: console.print(f"evaluating {label} ..."))
    phase("compare")
    timings["total"] = round(time.perf_counter() - started, 1)
    summary = _summary(result, timings, plan)
    paths = write_reports(
        result, out, title=f"critique-gym quickstart: {plan.model}, prompt-only vs prompted vs SFT vs trained",
        extra_images=[out / "grpo" / "curve.png"], extra_md=_timing_md(summary),
    )  # fmt: skip
    (out / "quickstart.json").write_text(json.dumps(summary, indent=2))
    console.print(f"prompt-only {summary['before_success']:.1%} -> trained {summary['after_success']:.1%} test success (SFT alone {summary['arms']['SFT']:.1%}), in {timings['total']:.0f}s")
    if summary["arms"]["SFT"] < WEAK_SFT:
        console.print(f"[yellow]warning:[/yellow] {WEAK_SFT_HINT}")
    console.print(f"report: [bold]{paths['html']}[/bold] (and {paths['md']}, {paths['json']})")
    return summary


def _summary(result: dict[str, Any], timings: dict[str, float], plan: QuickstartPlan) -> dict[str, Any]:
    return {
        "model": plan.model,
        "difficulty": plan.difficulty,
        "sft_demos": plan.sft_demos,
        "train_steps": plan.train_steps,
        "before_success": result["before"]["success_rate"],
        "after_success": result["after"]["success_rate"],
        "arms": {label.split(" (")[0]: result["arms"][label]["success_rate"] for label in result["labels"]},
        "timings_s": timings,
    }


def _timing_md(summary: dict[str, Any]) -> str:
    rows = "\n".join(f"| {phase} | {seconds:.0f} s |" for phase, seconds in summary["timings_s"].items())
    return f"## Timings\n\n| phase | time |\n|---|---|\n{rows}\n\nCurve: grpo/curve.png"
