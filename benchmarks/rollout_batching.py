"""GRPO rollouts sampled in lockstep and with continuous batching, alternated in one process.

    python -m cgym.benchmarks.rollout_batching --model runs/sft_easy_compact --rounds 4 \\
        --json benchmarks/results/rollout_batching_easy_bf16.json

Each round samples `--tasks` x `--group` ApiReport episodes twice, as a GRPO step does (the
trainer's sampler, LoRA folded in, the training sampling settings): once through `policy.act`,
every turn of the batch waiting for its longest row, and once through `policy.play`, each
conversation's next turn joining the rows still decoding (`agents.local.joins`,
`HFPolicy(continuous=True)`). The arms draw
different random numbers, so their episodes differ: compare the milliseconds per sampled id and
the forward calls (prefills and decode steps), not the wall times alone; the success rates
should agree within sampling noise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from cgym.benchmarks.output import emit

ARMS = ("lockstep", "continuous")


def rollout(state: Any, seeds: list[int], env_id: str, arm: str, forwards: list[int]) -> dict[str, Any]:
    """One rollout of `seeds` (one group each) in `arm`; `forwards` counts the sampler's calls."""
    from cgym.trainer import grpo

    policy = state.sampler
    policy.continuous = arm == "continuous"
    forwards.clear()
    start = time.perf_counter()
    trajectories = grpo._rollout_groups(state, seeds, [env_id] * len(seeds), 1)
    seconds = time.perf_counter() - start
    policy.continuous = False
    policy.drop_caches()
    sampled = sum(t.sampled_tokens for t in trajectories)
    return {
        "arm": arm,
        "seconds": round(seconds, 2),
        "forwards": len(forwards),
        "sampled_ids": sampled,
        "ms_per_sampled_id": round(1000 * seconds / max(sampled, 1), 3),
        "success_rate": round(sum(t.success for t in trajectories) / len(trajectories), 4),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="an SFT'd model directory (or a short name)")
    parser.add_argument("--env", default="cgym/ApiReport-v0")
    parser.add_argument("--env-kwargs", type=json.loads, default={"difficulty": "easy"})
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4, help="alternations of the two arms")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    from cgym.trainer import grpo
    from cgym.trainer.config import TrainConfig

    from cgym import envs  # noqa: F401 - registers the built-in envs

    config = TrainConfig(
        env_id=args.env,
        env_kwargs=args.env_kwargs,
        model=args.model,
        out=tempfile.mkdtemp(prefix="cgym-rollout-batching-"),
        group_size=args.group,
        tasks_per_step=args.tasks,
        eval_episodes=0,
        progress=False,
        lora_r=args.lora_r,
    )
    state = grpo.setup(config)
    forwards: list[int] = []
    rollout(state, list(range(args.tasks)), args.env, "continuous", forwards)  # warm: kernels built, the sampler's copy folded
    state.sampler.sampling_weights.get().register_forward_pre_hook(lambda module, inputs: forwards.append(1))
    runs = []
    for round_ in range(args.rounds):
        seeds = [1_000 + args.tasks * round_ + i for i in range(args.tasks)]  # both arms: the same tasks
        for arm in ARMS:
            runs.append({"round": round_, **rollout(state, seeds, args.env, arm, forwards)})
            print(json.dumps(runs[-1]), flush=True)
    emit(summary(args, runs), args.json)


def summary(args: argparse.Namespace, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The runs, each arm's pooled ms per sampled id, and each round's lockstep / continuous ratio."""
    arms = {arm: [r for r in runs if r["arm"] == arm] for arm in ARMS}
    per_id = {arm: 1000 * sum(r["seconds"] for r in rs) / max(sum(r["sampled_ids"] for r in rs), 1) for arm, rs in arms.items()}
    ratios = [a["ms_per_sampled_id"] / b["ms_per_sampled_id"] for a, b in zip(arms["lockstep"], arms["continuous"], strict=True)]
    return {
        "model": args.model,
        "env": args.env,
        "env_kwargs": args.env_kwargs,
        "tasks_x_group": f"{args.tasks} x {args.group}",
        "lora_r": args.lora_r,
        "runs": runs,
        "ms_per_sampled_id": {arm: round(v, 4) for arm, v in per_id.items()},
        "speedup_per_sampled_id": round(per_id["lockstep"] / per_id["continuous"], 3),
        "round_speedups": {"median": round(statistics.median(ratios), 3), "min": round(min(ratios), 3), "max": round(max(ratios), 3)},
        "forwards_mean": {arm: round(statistics.mean(r["forwards"] for r in rs), 1) for arm, rs in arms.items()},
        "success_rate_mean": {arm: round(statistics.mean(r["success_rate"] for r in rs), 4) for arm, rs in arms.items()},
    }


if __name__ == "__main__":
    main()
