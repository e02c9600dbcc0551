"""`cgym quickstart`: the whole story on a laptop CPU, end to end, in about ten minutes.

the pretrained model (SmolLM2-135M-Instruct, fetched once) -> a short SFT warm start on scripted
demos that leaves room to learn -> GRPO on LoRA adapters -> prompt-only, SFT and SFT + GRPO on the
same greedy test episodes, with GRPO's own gain and its paired interval -> report.md,
report.html, compare.json, curve.png.

Every phase is set by step counts, never by a clock, so a seed gives the same model on any
machine; the expected time is printed instead.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cgym.agents.tool_prompt import TRAINED_LAYOUT, ToolLayout
from rich.console import Console

ENV_ID = "cgym/ApiReport-v0"
WEAK_SFT = 0.05
WEAK_SFT_HINT = "the SFT'd model solved almost no test task, so GRPO had little to sharpen; try a larger --sft-demos or another --seed"
# Seconds on 2 quiet cores (SmolLM2, ApiReport easy), for the printed estimate only: (SFT demo,
# GRPO step of 2 x 8, 100-episode eval) in fp32, where the CPU computes in bf16 (2e1fed0,
# `quickstart_seed1_continuous_s16.json`: GRPO 44 s for 4 steps, compare 87 s; its SFT phase runs
# in fp32 since, 98 s for 64 demos in `quickstart_seed0_bf16_machine_fp32_s30.json`), and in fp32
# with the kernels' bf16 sampling (an Ice Lake, `quickstart_seed0_icelake_s19.json`: SFT 92 s,
# GRPO 77 s, compare 144 s).
SECONDS_PER = {"float32": (2.2, 75.0, 60.0), "bfloat16": (1.55, 11.0, 29.0), "float32 with kernels": (1.45, 19.0, 48.0)}


@dataclass(frozen=True)
class QuickstartPlan:
    """What each phase does; step counts set the work, so a seed repeats itself on any machine."""

    model: str = "smollm2-135m"
    """The pretrained model (short name, directory or .gguf file)."""
    difficulty: str = "easy"
    max_turns: int = 3
    """The turn limit of every phase's episodes: easy takes one call and one answer, so 3 leaves a
    turn to spare and bounds what a weak policy's episodes cost (the env's default is 4)."""
    sft_demos: int = 64
    """Scripted demonstrations for the warm start, one epoch (8 steps of 8): few enough that
    the SFT'd model still fails often when it samples, the room GRPO trains in."""
    sft_epochs: float = 1.0
    sft_lr: float = 5e-5
    tool_layout: ToolLayout = TRAINED_LAYOUT
    """How tools are shown to SmolLM2, whose template has no tools section: compact signatures, or
    one JSON schema a line in about three times the tokens (`agents.tool_prompt`). The SFT'd
    model keeps it, so GRPO and the evaluations render it too; prompt-only keeps the model's own."""
    train_steps: int = 4
    """GRPO steps of tasks_per_step x group_size episodes each."""
    group_size: int = 8
    tasks_per_step: int = 2
    lora_r: int = 16
    """LoRA rank on every linear layer (0: full fine-tuning)."""
    learning_rate: float = 2e-4
    """LoRA's rate: about 10x the full fine-tuning optimum (LoRA Without Regret, 2025)."""
    temperature: float = 0.7
    max_new_tokens: int = 96
    """Tokens per turn, in training and in the evaluations: an easy report fits in well under 96."""
    critique: str = "none"
    """Critique-GRPO's critique style for groups that all failed (none: plain GRPO)."""
    eval_episodes: int = 100
    seed: int = 0

    @property
    def expected_seconds(self) -> float:
        """About how long the run takes on 2 quiet cores (3 evaluations)."""
        from cgym.agents.local.precision import compute_dtype, kernels_in_fp32

        demo, step, evaluation = SECONDS_PER["float32 with kernels" if kernels_in_fp32() else str(compute_dtype()).removeprefix("torch.")]
        return self.sft_demos * self.sft_epochs * demo + self.train_steps * step + 3 * evaluation * self.eval_episodes / 100


def run(out: Path, plan: QuickstartPlan = QuickstartPlan(), *, console: Console | None = None) -> dict[str, Any]:
    """Run every phase; returns the timings, every arm's figures and GRPO's paired gain."""
    import torch
    from cgym.agents.demos import demonstrations
    from cgym.agents.eval.compare import compare
    from cgym.agents.eval.evaluate import EvalConfig
    from cgym.agents.eval.report import write_reports
    from cgym.agents.local.allocator import release_freed_memory
    from cgym.agents.local.hf import HFPolicy
    from cgym.agents.local.precision import computing_in
    from cgym.agents.options import SamplingOptions
    from cgym.agents.pretrained import resolve_model
    from cgym.trainer.config import TrainConfig
    from cgym.trainer.embedded import prepare_models
    from cgym.trainer.grpo import train
    from cgym.trainer.metrics import peak_rss_gb
    from cgym.trainer.sft import sft

    console = console or Console()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    memory: dict[str, float] = {}
    started = time.perf_counter()
    console.print(f"expected: about {plan.expected_seconds / 60:.0f} minutes on 2 quiet cores (the work is fixed by step counts; a busier machine takes longer and gets the same model)")

    def phase(name: str) -> None:
        release_freed_memory()  # the phase's tensors are garbage now: the next phase's peak starts low
        timings[name] = round(time.perf_counter() - started - sum(timings.values()), 1)
        memory[name] = peak_rss_gb()  # the process's high-water mark so far
        console.print(f"[green]done[/green] {name} in {timings[name]:.0f}s (total {time.perf_counter() - started:.0f}s)")

    console.rule(f"1/4 the pretrained model: {plan.model}")
    prepare_models(plan.model)
    base = resolve_model(plan.model)
    phase("model")

    console.rule(f"2/4 SFT warm start on {plan.sft_demos} scripted demonstrations")
    env_kwargs = {"difficulty": plan.difficulty, "max_turns": plan.max_turns}
    demos = demonstrations(ENV_ID, env_kwargs, episodes=plan.sft_demos, seed=plan.seed + 1)
    with computing_in(torch.float32):  # bf16 SFT learned far less from the same demos (`computing_in`)
        sft(base, demos, out / "sft", lr=plan.sft_lr, epochs=plan.sft_epochs, seed=plan.seed, tool_layout=plan.tool_layout)
    phase("sft")

    console.rule(f"3/4 GRPO{' + Critique-GRPO' if plan.critique != 'none' else ''} on the train split ({plan.train_steps} steps of {plan.tasks_per_step} x {plan.group_size})")
    config = TrainConfig(
        env_id=ENV_ID, env_kwargs=env_kwargs, model=str(out / "sft"), out=str(out / "grpo"), steps=plan.train_steps,
        group_size=plan.group_size, tasks_per_step=plan.tasks_per_step, learning_rate=plan.learning_rate, lora_r=plan.lora_r,
        sampling=SamplingOptions(temperature=plan.temperature, max_new_tokens=plan.max_new_tokens), critique=plan.critique, seed=plan.seed,
        eval_episodes=0,  # every arm is measured once, by the comparison below, on the same episodes
    )  # fmt: skip
    trained = train(config, overwrite=True, console=console)  # a quickstart run again redoes every phase
    phase("train")

    console.rule("4/4 compare prompt-only, SFT and SFT + GRPO on the same test episodes (greedy)")
    eval_config = EvalConfig(ENV_ID, {**env_kwargs, "split": "test"}, episodes=plan.eval_episodes, seed=10_000, batch_size=100)
    greedy = {"sampling": SamplingOptions(temperature=0.0, max_new_tokens=plan.max_new_tokens, seed=0), "inference_only": True}
    arms = [  # loaded one at a time, when its turn comes
        ("prompt-only (the instruct model as shipped)", lambda: HFPolicy.from_pretrained(base, **greedy)),
        ("SFT", lambda: HFPolicy.from_pretrained(out / "sft", **greedy)),
        (f"SFT + GRPO{' (' + plan.critique + ' critiques)' if plan.critique != 'none' else ''}", lambda: HFPolicy.from_pretrained(trained["final"], **greedy)),
    ]

    def on_arm(label: str) -> None:
        release_freed_memory()  # the arm before is garbage now: this one's peak starts low
        console.print(f"evaluating {label} ...")

    result = compare(arms, eval_config, on_arm=on_arm)
    phase("compare")
    timings["total"] = round(time.perf_counter() - started, 1)
    summary = _summary(result, timings, memory, plan)
    paths = write_reports(
        result, out, title=f"critique-gym quickstart: {plan.model}, prompt-only vs SFT vs SFT + GRPO",
        extra_images=[out / "grpo" / "curve.png"], extra_md=_timing_md(summary),
    )  # fmt: skip
    (out / "quickstart.json").write_text(json.dumps(summary, indent=2))
    gain = summary["grpo_gain"]
    console.print(
        f"prompt-only {summary['before_success']:.1%} -> SFT {summary['arms']['SFT']:.1%} -> SFT + GRPO {summary['after_success']:.1%} test success; "
        f"GRPO's own gain {100 * gain['mean']:+.0f} points [{100 * gain['low']:+.0f}, {100 * gain['high']:+.0f}] (95%, paired over {gain['episodes']} episodes), in {timings['total']:.0f}s"
    )  # fmt: skip
    if summary["arms"]["SFT"] < WEAK_SFT:
        console.print(f"[yellow]warning:[/yellow] {WEAK_SFT_HINT}")
    console.print(f"report: [bold]{paths['html']}[/bold] (and {paths['md']}, {paths['json']})")
    return summary


def _summary(result: dict[str, Any], timings: dict[str, float], memory: dict[str, float], plan: QuickstartPlan) -> dict[str, Any]:
    from cgym.agents.eval.compare import paired_arms

    sft, trained = result["labels"][-2:]
    return {
        "model": plan.model,
        "difficulty": plan.difficulty,
        "sft_demos": plan.sft_demos,
        "train_steps": plan.train_steps,
        "lora_r": plan.lora_r,
        "learning_rate": plan.learning_rate,
        "tool_layout": plan.tool_layout,
        "seed": plan.seed,
        "before_success": result["before"]["success_rate"],
        "after_success": result["after"]["success_rate"],
        "arms": {label.split(" (")[0]: result["arms"][label]["success_rate"] for label in result["labels"]},
        "grpo_gain": paired_arms(result["arms"][sft], result["arms"][trained]).to_dict(),
        "timings_s": timings,
        "peak_rss_gb": memory,  # after each phase: the high-water mark of the whole run so far
    }


def _timing_md(summary: dict[str, Any]) -> str:
    memory = summary["peak_rss_gb"]
    rows = "\n".join(f"| {phase} | {seconds:.0f} s | {f'{memory[phase]:.2f} GiB' if phase in memory else ''} |" for phase, seconds in summary["timings_s"].items())
    return f"## Timings\n\n| phase | time | peak memory so far |\n|---|---|---|\n{rows}\n\nCurve: grpo/curve.png"
