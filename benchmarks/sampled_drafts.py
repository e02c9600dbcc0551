"""A sampled eval with and without prompt-lookup drafts, alternated in one process.

    python -m cgym.benchmarks.sampled_drafts --model runs/sft_easy --episodes 64 --rounds 2 \\
        --json benchmarks/results/sampled_drafts_smollm2.json

`--drafts` and `--against` set the two arms' draft counts (the default's and none): two counts
of drafts compare as well, e.g. `--drafts 8 --against 4`.

Sampled turns check their drafts by speculative sampling (`agents.local.sampling.accept_drafts`), so
both arms draw from the same distribution but from different random numbers: their episodes
differ. Compare the seconds per sampled id (and the success rates, which should agree within
sampling noise), not the wall times alone.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from cgym.agents.local.lookup import LOOKUP_TOKENS
from cgym.agents.options import SamplingOptions
from cgym.benchmarks.output import emit


def sampled_eval(model: Any, tokenizer: Any, env_id: str, env_kwargs: dict[str, Any], episodes: int, draft_tokens: int, seed: int) -> dict[str, Any]:
    from cgym.agents.eval.evaluate import EvalConfig, evaluate
    from cgym.agents.local.hf import HFPolicy

    policy = HFPolicy(model, tokenizer, draft_tokens=draft_tokens, sampling=SamplingOptions(temperature=1.0, seed=seed))
    start = time.perf_counter()
    summary, results = evaluate(policy, EvalConfig(env_id, {**env_kwargs, "split": "test"}, episodes=episodes, seed=seed))
    seconds = time.perf_counter() - start
    sampled = sum(sum(r.conversation.loss_mask) for r in results)
    return {
        "draft_tokens": draft_tokens,
        "seconds": round(seconds, 2),
        "sampled_ids": sampled,
        "ms_per_sampled_id": round(1000 * seconds / max(sampled, 1), 2),
        "success_rate": summary["success_rate"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="an SFT'd model directory (or a short name)")
    parser.add_argument("--env", default="cgym/ApiReport-v0")
    parser.add_argument("--env-kwargs", type=json.loads, default={"difficulty": "easy"})
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the two arms")
    parser.add_argument("--drafts", type=int, default=LOOKUP_TOKENS, help="the first arm's drafted ids a step")
    parser.add_argument("--against", type=int, default=0, help="the second arm's (0: no drafts)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.drafts == args.against or min(args.drafts, args.against) < 0:
        parser.error(f"--drafts {args.drafts} and --against {args.against}: two different counts, neither negative")
    from cgym.agents.local.hf import HFPolicy

    from cgym import envs  # noqa: F401 - registers the built-in envs

    loaded = HFPolicy.from_pretrained(args.model)
    runs = [
        sampled_eval(loaded.model, loaded.tokenizer, args.env, args.env_kwargs, args.episodes, draft_tokens, seed=round_)
        for round_ in range(args.rounds)
        for draft_tokens in (args.drafts, args.against)
    ]
    arms = {d: [r for r in runs if r["draft_tokens"] == d] for d in (args.drafts, args.against)}
    per_id = {d: sum(r["seconds"] for r in rs) * 1000 / max(sum(r["sampled_ids"] for r in rs), 1) for d, rs in arms.items()}
    emit(
        {
            "model": args.model,
            "env": args.env,
            "env_kwargs": args.env_kwargs,
            "episodes": args.episodes,
            "temperature": 1.0,
            "runs": runs,
            "ms_per_sampled_id": {str(d): round(v, 4) for d, v in per_id.items()},
            "speedup_per_sampled_id": round(per_id[args.against] / per_id[args.drafts], 3),
        },
        args.json,
    )


if __name__ == "__main__":
    main()
