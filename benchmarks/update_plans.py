"""A GRPO update's time by micro-batch plan, on one rollout: groups kept together or rows by length.

    python -m cgym.benchmarks.update_plans --model runs/sft --json PATH

Samples one 4 x 8 ApiReport step's rollout (LoRA rank 16, the training defaults), then times the
update on those same trajectories under each plan in turn, `--rounds` times, alternating:
- `grouped`: `trainer.rollout.group_micro_batches`, the columns a micro-batch's rows share past
  the batch's head run once (the trainer's default);
- `by_length`: rows sorted by length across groups, every row run whole after the head.
Each update also steps the optimizer, so later rounds start from other weights; an update's
work does not depend on the weights' values, so its time does not either. The loss-pass columns
of each plan (`trainer.rollout.loss_pass_columns`) are reported beside the times.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from cgym.benchmarks.output import emit

PLANS = ("grouped", "by_length")


def by_length(ids: Sequence[Sequence[int]], groups: Sequence[int], most: int) -> list[list[int]]:
    """The plan before groups were kept together: rows by length, whatever their group."""
    from cgym.trainer.rollout import micro_batches

    return micro_batches([len(row) for row in ids], most)


@contextmanager
def plan(name: str) -> Iterator[None]:
    """Within the block, GRPO updates use the named plan (`PLANS`)."""
    import cgym.trainer.grpo as grpo

    if name not in PLANS:
        raise ValueError(f"unknown plan {name!r}: choose one of {', '.join(PLANS)}")
    planner, logprobs = grpo.group_micro_batches, grpo.sequence_logprobs
    if name == "by_length":
        grpo.group_micro_batches = by_length
        grpo.sequence_logprobs = lambda *args, **kwargs: logprobs(*args, **{**kwargs, "share_prefix": False})
    try:
        yield
    finally:
        grpo.group_micro_batches, grpo.sequence_logprobs = planner, logprobs


def run(model: str, *, rounds: int, difficulty: str) -> dict[str, Any]:
    import cgym.trainer.grpo as grpo
    from cgym.benchmarks.cpu_floors import ENV_ID, matmul_peak_gflops
    from cgym.benchmarks.output import machine
    from cgym.trainer.config import TrainConfig
    from cgym.trainer.rollout import group_micro_batches, loss_pass_columns

    config = TrainConfig(env_id=ENV_ID, env_kwargs={"difficulty": difficulty}, model=model, out="/tmp/cgym-update-plans", group_size=8, tasks_per_step=4, eval_episodes=0, progress=False)
    state = grpo.setup(config)
    trajs = grpo._rollout_groups(state, list(range(4)), [ENV_ID] * 4, 1)
    state.policy.drop_caches()  # as a step does before its update
    advantages, _, _ = grpo._advantages(state, trajs)
    ids, groups = [t.ids for t in trajs], [t.group for t in trajs]
    seconds: dict[str, list[float]] = {name: [] for name in PLANS}
    for _ in range(rounds):
        for name in PLANS:
            with plan(name):
                start = time.perf_counter()
                grpo._update(state, trajs, advantages, 1)
                seconds[name].append(round(time.perf_counter() - start, 2))
    columns = {"grouped": loss_pass_columns(ids, group_micro_batches(ids, groups, config.micro_batch_size)), "by_length": loss_pass_columns(ids, by_length(ids, groups, config.micro_batch_size))}
    return {
        "machine": machine(),
        "model": model,
        "env": ENV_ID,
        "difficulty": difficulty,
        "tasks_x_group": "4 x 8",
        "lora_r": config.lora_r,
        "matmul_peak_gflops": round(matmul_peak_gflops(state.model.dtype), 1),
        "rows": len(trajs),
        "loss_pass_columns": columns,
        "update_s": seconds,
        "median_s": {name: sorted(times)[len(times) // 2] for name, times in seconds.items()},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="an SFT'd model directory (or a short name)")
    parser.add_argument("--rounds", type=int, default=3, help="updates per plan, alternating")
    parser.add_argument("--difficulty", default="easy", choices=["easy", "medium", "hard"])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    emit(run(args.model, rounds=args.rounds, difficulty=args.difficulty), args.json)


if __name__ == "__main__":
    main()
