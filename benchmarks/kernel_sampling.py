"""Sampled success of one model with the decode-attention kernel on and off, on the same tasks.

    python -m cgym.benchmarks.kernel_sampling --model runs/qs/sft --episodes 200 --rounds 1 \\
        --json benchmarks/results/kernel_sampling_quickstart_sft.json

The kernel (`agents.local.decode_attention`) changes the rounding of a decode step's attention,
so a sampled rollout drawn through it differs from one drawn through the flash kernel. What
training needs is that both draw from the same policy: the same tasks (the train split, as GRPO's
rollouts), sampled at the rollouts' temperature, should succeed as often either way. Each round
runs both arms on the same task seeds and sampling seed, so the per-task difference is paired.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from cgym.agents.local.decode_attention import KERNEL_ENV
from cgym.agents.options import SamplingOptions
from cgym.benchmarks.output import emit, machine

ARMS = {"kernel": "1", "flash": "0"}


def sampled_successes(model: str, env_id: str, env_kwargs: dict[str, Any], episodes: int, temperature: float, seed: int, kernel: bool) -> dict[str, Any]:
    """One arm of one round: each episode's success, sampled with the kernel on or off."""
    from cgym.agents.eval.evaluate import EvalConfig, evaluate
    from cgym.agents.local.hf import HFPolicy

    os.environ[KERNEL_ENV] = ARMS["kernel" if kernel else "flash"]  # read at every decode step; this process only
    policy = HFPolicy.from_pretrained(model, sampling=SamplingOptions(temperature=temperature, seed=seed), inference_only=True)
    start = time.perf_counter()
    summary, results = evaluate(policy, EvalConfig(env_id, {**env_kwargs, "split": "train"}, episodes=episodes, seed=seed))
    return {
        "kernel": kernel,
        "seed": seed,
        "seconds": round(time.perf_counter() - start, 2),
        "success_rate": summary["success_rate"],
        "successes": [int(r.success) for r in results],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="an SFT'd model directory (or a short name)")
    parser.add_argument("--env", default="cgym/ApiReport-v0")
    parser.add_argument("--env-kwargs", type=json.loads, default={"difficulty": "easy"})
    parser.add_argument("--episodes", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=1, help="rounds of both arms, each on new task and sampling seeds")
    parser.add_argument("--temperature", type=float, default=0.7, help="the GRPO rollouts' default")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.episodes < 1 or args.rounds < 1 or args.temperature <= 0:
        parser.error("--episodes and --rounds take counts >= 1, and --temperature a value > 0 (a sampled eval)")
    from cgym.agents.eval.paired import paired_difference

    from cgym import envs  # noqa: F401 - registers the built-in envs

    previous = os.environ.get(KERNEL_ENV)
    try:
        runs = [
            sampled_successes(args.model, args.env, args.env_kwargs, args.episodes, args.temperature, seed=500 + r, kernel=kernel)
            for r in range(args.rounds)
            for kernel in (True, False)
        ]
    finally:  # the caller's setting back
        if previous is None:
            os.environ.pop(KERNEL_ENV, None)
        else:
            os.environ[KERNEL_ENV] = previous
    arm = {kernel: [run["successes"] for run in runs if run["kernel"] is kernel] for kernel in (True, False)}
    difference = paired_difference(arm[False], arm[True])  # kernel - flash, rounds as rows
    for run in runs:
        run.pop("successes")
    emit(
        {
            "machine": machine(),
            "model": args.model,
            "env": args.env,
            "env_kwargs": {**args.env_kwargs, "split": "train"},
            "episodes": args.episodes,
            "temperature": args.temperature,
            "runs": runs,
            "kernel_minus_flash": difference.to_dict(),
            "kernel_minus_flash_points": difference.points(),
        },
        args.json,
    )


if __name__ == "__main__":
    main()
