"""The shape of one GRPO rollout: how many decode steps its turns take, and what its rows share.

    python -m cgym.benchmarks.rollout_shape --model runs/sft --json PATH

Samples `--tasks` x `--group` ApiReport episodes as a GRPO step does (each group one task, the
training sampling settings) and reports, from the episodes' turns and token ledgers:
- decode steps when every turn waits for its longest row (`lockstep_steps`, how `act` samples)
  against the longest episode's sampled tokens (`chained_steps`: no schedule takes fewer, not
  even `play`'s, where a row rejoins the decode as soon as its env answers), and the rows a step
  carries in each;
- the columns the loss pass runs past the shared head with micro-batches sorted by length and
  with `trainer.rollout.group_micro_batches`' plan, and the nodes of its prefix trees
  (`trainer.rollout.tree_micro_batches`, `agents.local.prefix_tree`: what rows share runs once).
Counts, not times: they are the same on any machine for the same episodes.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cgym.benchmarks.output import emit


def lockstep_steps(turns: Sequence[Sequence[int]]) -> int:
    """Decode steps when each turn of the batch runs until its longest row ends: the sum over
    turn indices of the longest sampled turn at that index (`turns`: each episode's turn lengths)."""
    depth = max((len(episode) for episode in turns), default=0)
    return sum(max(episode[i] for episode in turns if len(episode) > i) for i in range(depth))


def chained_steps(turns: Sequence[Sequence[int]]) -> int:
    """The fewest decode steps any schedule takes: the longest episode's sampled tokens."""
    return max((sum(episode) for episode in turns), default=0)


def shape(turns: Sequence[Sequence[int]], ids: Sequence[Sequence[int]], groups: Sequence[int], most: int) -> dict[str, Any]:
    """The figures above from each episode's turn lengths, token ids and group."""
    from cgym.agents.local.prefix_tree import tree_size
    from cgym.agents.local.sampling import common_prefix_len
    from cgym.trainer.rollout import group_micro_batches, group_rows, loss_pass_columns, micro_batches, tree_micro_batches

    sampled = sum(sum(episode) for episode in turns)
    lockstep, chained = lockstep_steps(turns), chained_steps(turns)
    head = common_prefix_len(ids)
    by_length = micro_batches([len(row) for row in ids], most)
    planned = group_micro_batches(ids, groups, most)
    trees = tree_micro_batches(ids, groups)
    return {
        "episodes": len(turns),
        "turns": [list(episode) for episode in turns],
        "sampled_tokens": sampled,
        "decode": {
            "lockstep_steps": lockstep,
            "chained_steps": chained,
            "rows_a_step_lockstep": round(sampled / max(lockstep, 1), 1),
            "rows_a_step_chained": round(sampled / max(chained, 1), 1),
        },
        "loss_pass": {
            "head_columns": head,
            "row_columns_past_head": [len(row) - head for row in ids],
            "shared_past_head_by_group": {str(g): common_prefix_len([ids[r] for r in rows]) - head if len(rows) > 1 else 0 for g, rows in group_rows(groups).items()},
            "columns_by_length": loss_pass_columns(ids, by_length),
            "columns_planned": loss_pass_columns(ids, planned),
            "plan_keeps_groups_together": all(len({groups[r] for r in chunk}) == 1 for chunk in planned),
            "tree_nodes": sum(tree_size([ids[r][head:] for r in chunk]) for chunk in trees),
            "micro_batches": {"by_length": len(by_length), "planned": len(planned), "trees": len(trees)},
        },
    }


def run(model: str, *, difficulty: str, tasks: int, group: int, seed: int) -> dict[str, Any]:
    import gymnasium as gym
    from cgym.agents.eval.episodes import run_episodes
    from cgym.agents.local.hf import HFPolicy
    from cgym.benchmarks.cpu_floors import ENV_ID
    from cgym.benchmarks.output import machine
    from cgym.trainer.config import TrainConfig

    config = TrainConfig(env_id=ENV_ID, model=model)
    policy = HFPolicy.from_pretrained(model, sampling=config.sampling)
    policy.reseed(seed)
    seeds = [seed + task for task in range(tasks) for _ in range(group)]  # a task's seed, once per attempt
    results = run_episodes(lambda: gym.make(ENV_ID, difficulty=difficulty, split="train"), policy, seeds, batch_size=len(seeds))
    turns = [[len(turn.token_ids) for turn in result.turns] for result in results]
    ids = [list(result.conversation.token_ids) for result in results]
    groups = [index // group for index in range(len(seeds))]
    return {"machine": machine(), "model": model, "env": ENV_ID, "difficulty": difficulty, "tasks_x_group": f"{tasks} x {group}", "sampling": {"temperature": config.sampling.temperature, "top_p": config.sampling.top_p, "max_new_tokens": config.sampling.max_new_tokens}, "success": sum(r.success for r in results), **shape(turns, ids, groups, config.micro_batch_size)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="an SFT'd model directory (or a short name)")
    parser.add_argument("--difficulty", default="easy", choices=["easy", "medium", "hard"])
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    emit(run(args.model, difficulty=args.difficulty, tasks=args.tasks, group=args.group, seed=args.seed), args.json)


if __name__ == "__main__":
    main()
