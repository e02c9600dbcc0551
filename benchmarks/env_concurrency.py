"""Episodes per second when env steps wait on I/O: ApiReport with latency injected into every
request, its envs stepped one after another or concurrently (`run_episodes(..., workers=N)`).

Usage: python -m cgym.benchmarks.env_concurrency --json benchmarks/results/env_concurrency.json

The scripted oracle plays, so the policy costs next to nothing and the wall time is the envs'.
At each batch size (concurrent episodes) the sequential and the concurrent run must give the same
episodes; the JSON says so, and what the latency alone allows one-after-another stepping.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from cgym.agents.eval.episodes import EpisodeResult, run_episodes
from cgym.agents.scripted import ScriptedPolicy
from cgym.benchmarks.output import emit

ENV = "cgym/ApiReport-v0"


def timed(env_kwargs: dict[str, Any], episodes: int, batch_size: int, workers: int) -> tuple[float, list[EpisodeResult]]:
    """Wall seconds and results of `episodes` oracle episodes, `batch_size` at once."""
    from cgym.envs.registration import make

    policy = ScriptedPolicy("oracle", env_id=ENV)
    start = time.perf_counter()
    results = run_episodes(lambda: make(ENV, **env_kwargs), policy, range(episodes), batch_size=batch_size, workers=workers)
    return time.perf_counter() - start, results


def requests_per_episode(results: list[EpisodeResult]) -> float:
    return statistics.mean(len(r.record.extras.get("calls", [])) if r.record else 0 for r in results)


def compare(env_kwargs: dict[str, Any], episodes: int, batch_size: int) -> dict[str, Any]:
    """One batch size: sequential (`workers=1`) against one worker per live episode."""
    seq_s, sequential = timed(env_kwargs, episodes, batch_size, workers=1)
    conc_s, concurrent = timed(env_kwargs, episodes, batch_size, workers=batch_size)
    return {
        "concurrent_episodes": batch_size,
        "sequential_eps_per_s": round(episodes / seq_s, 2),
        "concurrent_eps_per_s": round(episodes / conc_s, 2),
        "speedup": round(seq_s / conc_s, 2),
        "same_results": [r.summary() for r in sequential] == [r.summary() for r in concurrent],
        "success_rate": sum(r.success for r in concurrent) / episodes,
        "requests_per_episode": round(requests_per_episode(sequential), 2),
    }


def run(*, difficulty: str, latency_ms: float, episodes: int, concurrency: list[int]) -> dict[str, Any]:
    from cgym import envs  # noqa: F401 - registers the built-in envs

    kwargs: dict[str, Any] = {"difficulty": difficulty, "latency_s": latency_ms / 1000}
    instant = kwargs | {"latency_s": 0.0}
    timed(instant, 8, 8, workers=8)  # warm-up: imports, task pools, threads
    rows = [compare(kwargs, episodes, size) for size in concurrency]
    overhead = compare(instant, episodes, max(concurrency))
    per_episode = rows[0]["requests_per_episode"]
    return {
        "env": ENV,
        "env_kwargs": kwargs,
        "policy": "scripted:oracle",
        "episodes": episodes,
        "sequential_latency_bound_eps_per_s": round(1000 / (latency_ms * per_episode), 2) if latency_ms and per_episode else None,
        "rows": rows,
        "zero_latency": overhead | {"what": "the same run without latency: the threads' own cost"},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--difficulty", default="hard", choices=["easy", "medium", "hard"])
    parser.add_argument("--latency-ms", type=float, default=20.0, help="latency of every API request")
    parser.add_argument("--episodes", type=int, default=128, help="episodes per run")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64], help="concurrent episodes (batch sizes)")
    parser.add_argument("--note", default="", help="a note kept in the JSON (e.g. the machine's load)")
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args(argv)
    result = run(difficulty=args.difficulty, latency_ms=args.latency_ms, episodes=args.episodes, concurrency=args.concurrency)
    if args.note:
        result["note"] = args.note
    emit(result, args.json)


if __name__ == "__main__":
    main()
