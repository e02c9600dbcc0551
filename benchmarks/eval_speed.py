"""Greedy eval wall time with and without the turn cache, same policy, same episodes, one process.

Usage:
    python -m cgym.benchmarks.eval_speed --policy hf:runs/headroom/ApiReport-v0-medium/sft \\
        --env cgym/ApiReport-v0 --env-kwargs '{"difficulty": "medium"}' --episodes 50 \\
        --json benchmarks/results/eval_speed_medium.json

Multi-turn episodes prefill their whole conversation at every turn unless each conversation's
keys/values are kept (`agents.local.turn_cache`). Both runs must give the same episodes (greedy); the
JSON keeps both wall times, the success rates, and the tokens the turn cache did not recompute.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from cgym.agents.options import SamplingOptions
from cgym.benchmarks.output import emit


def timed_eval(policy: Any, env_id: str, env_kwargs: dict[str, Any], episodes: int, batch_size: int) -> tuple[float, dict[str, Any]]:
    from cgym.agents.eval.evaluate import EvalConfig, evaluate
    from cgym.trainer.grpo import EVAL_SEED

    summary, _ = evaluate(policy, EvalConfig(env_id, {**env_kwargs, "split": "test"}, episodes=episodes, seed=EVAL_SEED, batch_size=batch_size))
    return summary["wall_s"], summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", required=True, help="hf:<model>")
    parser.add_argument("--env", default="cgym/ApiReport-v0")
    parser.add_argument("--env-kwargs", type=json.loads, default={"difficulty": "medium"})
    parser.add_argument("--episodes", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    from cgym.agents.local.hf import HFPolicy
    from cgym.agents.local.turn_cache import TurnCache

    from cgym import envs  # noqa: F401

    if not args.policy.startswith("hf:"):
        parser.error("--policy must be an hf: policy")
    policy = HFPolicy.from_pretrained(args.policy[3:], sampling=SamplingOptions(temperature=0.0, max_new_tokens=args.max_new_tokens, seed=0))
    timed_eval(policy, args.env, args.env_kwargs, min(args.episodes, 8), args.batch_size)  # warm-up: weights cast, prefix cached
    policy.turn_cache = None
    off_s, off = timed_eval(policy, args.env, args.env_kwargs, args.episodes, args.batch_size)
    policy.turn_cache = TurnCache()
    on_s, on = timed_eval(policy, args.env, args.env_kwargs, args.episodes, args.batch_size)
    same = [e["reward"] for e in on["per_episode"]] == [e["reward"] for e in off["per_episode"]]
    emit(
        {
            "command": "python -m cgym.benchmarks.eval_speed " + " ".join(argv if argv is not None else sys.argv[1:]),
            "policy": args.policy, "env": args.env, "env_kwargs": args.env_kwargs, "episodes": args.episodes,
            "turn_cache_off_s": round(off_s, 1), "turn_cache_on_s": round(on_s, 1), "speedup": round(off_s / on_s, 2),
            "success_off": off["success_rate"], "success_on": on["success_rate"], "same_rewards": same,
            "mean_turns": on["mean_turns"], "reused_tokens": policy.turn_cache.reused_tokens, "hits": policy.turn_cache.hits,
        },
        args.json,
    )  # fmt: skip


if __name__ == "__main__":
    main()
