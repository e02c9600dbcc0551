"""Can a policy act on critiques? Refine its own failures once per critique style and count fixes.

Usage:
    python -m cgym.benchmarks.refine_success --policy hf:quickstart/sft --env-kwargs '{"difficulty": "easy"}' \\
        --episodes 100 --json runs/refine_success.json

Critique-GRPO only rescues a group when a refinement succeeds. This runs the policy on the test
episodes, gives each failed episode's critique (indicative, ground truth, step-level) to the same
policy in the trainer's refinement prompt, replays the task, and reports how many refinements
succeeded, how many turns they took and which tools they called (beside the same for the first
attempts), and a few of the refined answers. A refinement that succeeds without the tools the
first attempts needed is one that the critique's content carried: trained on the original prompt,
it teaches the policy to skip them.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cgym.agents.base import Policy
from cgym.agents.critics import run_refinements
from cgym.agents.eval.episodes import EpisodeResult, run_episodes
from cgym.benchmarks.output import emit
from cgym.envs.registration import make

STYLES = ("indicative", "ground_truth", "step")


def refine_failures(
    policy: Policy, env_id: str, env_kwargs: dict[str, Any], seeds: list[int], styles: tuple[str, ...] = STYLES, *, examples: int = 3, max_failures: int | None = None
) -> dict[str, Any]:
    """Run `seeds`, then refine every failed episode (the first `max_failures`) once per critique style."""

    def new_env() -> Any:
        return make(env_id, **env_kwargs)

    results = run_episodes(new_env, policy, seeds, batch_size=len(seeds))
    failed = [r for r in results if not r.success][:max_failures]
    report: dict[str, Any] = {"episodes": len(results), "failed": len(failed), "first_attempts": episode_shape(results), "styles": {}}
    for style in styles:
        todo = [(r, c) for r in failed if (c := r.critique(style))]  # type: ignore[arg-type]
        refined = run_refinements(new_env, policy, todo)
        report["styles"][style] = {
            "refined": len(refined),
            "succeeded": sum(r.success for r in refined),
            **episode_shape(refined),
            "examples": [{"before": _answer(old), "critique": critique, "after": _answer(new)} for (old, critique), new in list(zip(todo, refined))[:examples]],
        }
    return report


def episode_shape(results: Sequence[EpisodeResult]) -> dict[str, Any]:
    """Turns per episode, and how many episodes (all; successful ones) called each tool."""
    called = [{m.get("name", "") for m in r.conversation.messages if m["role"] == "tool"} for r in results]
    return {
        "turns": [len(r.turns) for r in results],
        "tools": dict(sorted(Counter(name for names in called for name in names).items())),
        "tools_in_successes": dict(sorted(Counter(name for r, names in zip(results, called) if r.success for name in names).items())),
    }


def _answer(result: EpisodeResult) -> str:
    return str(result.conversation.messages[-1]["content"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", required=True, help="policy spec, e.g. hf:quickstart/sft")
    parser.add_argument("--env", default="cgym/ApiReport-v0")
    parser.add_argument("--env-kwargs", type=json.loads, default={}, help='JSON, e.g. \'{"difficulty": "easy"}\'')
    parser.add_argument("--episodes", type=int, default=100)
    parser.add_argument("--seed", type=int, default=10_000, help="first seed (the trainer's evaluation seeds by default)")
    parser.add_argument("--split", default="test", help="the env's task split (train: what training refines)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (the trainer's is 0.7)")
    parser.add_argument("--sampling-seed", type=int, default=0)
    parser.add_argument("--styles", nargs="+", choices=STYLES, default=list(STYLES))
    parser.add_argument("--max-failures", type=int, help="refine only the first N failures")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    from cgym.agents.options import SamplingOptions
    from cgym.agents.spec import load_policy

    from cgym import envs  # noqa: F401

    policy = load_policy(args.policy, SamplingOptions(temperature=args.temperature, max_new_tokens=96, seed=args.sampling_seed))
    env_kwargs = {**args.env_kwargs, "split": args.split}
    seeds = [args.seed + i for i in range(args.episodes)]
    report = refine_failures(policy, args.env, env_kwargs, seeds, tuple(args.styles), max_failures=args.max_failures)
    command = "python -m cgym.benchmarks.refine_success " + " ".join(sys.argv[1:] if argv is None else argv)
    emit({"command": command, "policy": args.policy, "env": args.env, "env_kwargs": env_kwargs, "temperature": args.temperature, **report}, args.json)


if __name__ == "__main__":
    main()
