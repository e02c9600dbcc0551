"""`cgym quickstart` under several seeds: GRPO's own gain per seed and pooled, with paired intervals.

Usage:
    python -m cgym.benchmarks.quickstart_seeds --seeds 0 1 2 --out runs/quickstart \\
        --json benchmarks/results/quickstart_lora_seeds.json

Each seed runs the whole quickstart, in a process of its own (so its peak memory is its own), into
OUT/seedN (a seed whose quickstart.json exists is kept, so a cut-short call resumes), then the
gains are paired on the same 100 test episodes:
SFT + GRPO against SFT (GRPO's own gain) and against the prompt-only model.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from cgym.agents.eval.paired import paired_difference
from cgym.agents.tool_prompt import TOOL_LAYOUTS
from cgym.benchmarks.output import emit
from cgym.trainer.quickstart import QuickstartPlan


def outcomes(run: Path) -> dict[str, list[int]]:
    """Per-episode success (1/0) of every arm of one quickstart run, by short label."""
    compare = json.loads((run / "compare.json").read_text())
    return {label.split(" (")[0]: [int(e["success"]) for e in compare["arms"][label]["per_episode"]] for label in compare["labels"]}


def summarize(runs: dict[int, Path]) -> dict[str, Any]:
    per_seed, arms = {}, {}
    for seed, run in sorted(runs.items()):
        summary = json.loads((run / "quickstart.json").read_text())
        arms[seed] = outcomes(run)
        per_seed[seed] = {key: summary[key] for key in ("arms", "grpo_gain", "timings_s", "peak_rss_gb") if key in summary}  # older runs lack memory
    seeds = sorted(arms)
    trained, sft, base = ([arms[s][label] for s in seeds] for label in ("SFT + GRPO", "SFT", "prompt-only"))
    return {
        "seeds": seeds,
        "per_seed": per_seed,
        "pooled": {
            "grpo_gain (SFT + GRPO - SFT)": paired_difference(sft, trained).to_dict(),
            "SFT + GRPO - prompt-only": paired_difference(base, trained).to_dict(),
            "SFT - prompt-only": paired_difference(base, sft).to_dict(),
        },
        "total_s": {seed: per_seed[seed]["timings_s"]["total"] for seed in seeds},
    }


def plot(result: dict[str, Any], path: Path) -> None:
    """Test success of each arm, seed by seed, with GRPO's own gain and its interval written above."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["prompt-only", "SFT", "SFT + GRPO"]
    per_seed = {int(k): v for k, v in result["per_seed"].items()}  # JSON keys are strings
    seeds = sorted(per_seed)
    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        xs = [n + i * width for n in range(len(seeds))]
        ax.bar(xs, [per_seed[s]["arms"][label] for s in seeds], width, label=label, color=f"C{i}")
    for n, s in enumerate(seeds):
        gain = per_seed[s]["grpo_gain"]
        top = per_seed[s]["arms"]["SFT + GRPO"]
        ax.annotate(f"GRPO {100 * gain['mean']:+.0f} [{100 * gain['low']:+.0f}, {100 * gain['high']:+.0f}]", (n + width, top + 0.02), ha="center", fontsize=8)
    ax.set_xticks([n + width for n in range(len(seeds))], [f"seed {s}" for s in seeds])
    ax.set_ylim(0, 1.25)
    ax.set_ylabel("greedy test success (100 episodes)")
    ax.set_title("cgym quickstart, SmolLM2-135M, ApiReport easy: GRPO's own gain (points, paired 95% interval)", fontsize=9)
    ax.legend(fontsize=8, loc="upper center", ncol=3)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=Path("runs/quickstart"))
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tool-layout", choices=TOOL_LAYOUTS, default=QuickstartPlan.tool_layout, help="how the tools are shown from SFT on (default: %(default)s)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path, help="PNG: each arm's success per seed, GRPO's gain above")
    args = parser.parse_args(argv)
    plan = QuickstartPlan(model=args.model, tool_layout=args.tool_layout)
    runs = {}
    for seed in args.seeds:
        runs[seed] = args.out / f"seed{seed}"
        if not (runs[seed] / "quickstart.json").exists():  # a process each, so each seed's peak memory is its own
            command = ["quickstart", "--out", str(runs[seed]), "--model", plan.model, "--tool-layout", plan.tool_layout, "--seed", str(seed)]
            subprocess.run([sys.executable, "-m", "cgym", *command], check=True)
    result = {"command": "python -m cgym.benchmarks.quickstart_seeds " + " ".join(sys.argv[1:] if argv is None else argv), "plan": asdict(plan), **summarize(runs)}
    emit(result, args.json)
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
