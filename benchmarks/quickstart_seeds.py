"""`cgym quickstart` under several seeds: GRPO's own gain per seed and pooled, with paired intervals.

Usage:
    python -m cgym.benchmarks.quickstart_seeds --seeds 0 1 2 --out runs/quickstart \\
        --json benchmarks/results/quickstart_lora_seeds.json

Each seed runs the whole quickstart into OUT/seedN (a seed whose quickstart.json exists is kept,
so a cut-short call resumes), then the gains are paired on the same 100 test episodes:
SFT + GRPO against SFT (GRPO's own gain) and against the prompt-only model.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from cgym.agents.eval.paired import paired_difference
from cgym.benchmarks.output import emit


def outcomes(run: Path) -> dict[str, list[int]]:
    """Per-episode success (1/0) of every arm of one quickstart run, by short label."""
    compare = json.loads((run / "compare.json").read_text())
    return {label.split(" (")[0]: [int(e["success"]) for e in compare["arms"][label]["per_episode"]] for label in compare["labels"]}


def summarize(runs: dict[int, Path]) -> dict[str, Any]:
    per_seed, arms = {}, {}
    for seed, run in sorted(runs.items()):
        summary = json.loads((run / "quickstart.json").read_text())
        arms[seed] = outcomes(run)
        per_seed[seed] = {"arms": summary["arms"], "grpo_gain": summary["grpo_gain"], "timings_s": summary["timings_s"]}
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=Path("runs/quickstart"))
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    from cgym.trainer.quickstart import QuickstartPlan, run

    runs = {}
    for seed in args.seeds:
        runs[seed] = args.out / f"seed{seed}"
        if not (runs[seed] / "quickstart.json").exists():
            run(runs[seed], QuickstartPlan(model=args.model, seed=seed))
    result = {"command": "python -m cgym.benchmarks.quickstart_seeds " + " ".join(sys.argv[1:] if argv is None else argv), "plan": asdict(QuickstartPlan(model=args.model)), **summarize(runs)}
    emit(result, args.json)


if __name__ == "__main__":
    main()
