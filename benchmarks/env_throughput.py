"""Env overhead per step, excluding the agent: replay oracle actions and time `env.step` alone.

Usage: python -m cgym.benchmarks.env_throughput --env cgym/ApiReport-v0 --json out.json
(also `cgym bench env`). For the API env it also times a bare respx-mocked httpx request,
so the env's own overhead shows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from cgym.agents.base import Conversation
from cgym.agents.scripted import ScriptedPolicy
from cgym.benchmarks.output import emit
from cgym.envs.registration import make


def record_actions(env_id: str, env_kwargs: dict[str, Any], seeds: list[int]) -> dict[int, list[str]]:
    """The oracle's actions per seed, so the timed loop runs no agent code."""
    env, oracle, actions = make(env_id, **env_kwargs), ScriptedPolicy("oracle", env_id=env_id), {}
    for seed in seeds:
        _, info = env.reset(seed=seed)
        conv = Conversation(list(info["messages"]), info["tools"], task=info["task"], env_seen=len(info["messages"]))
        taken, done = [], False
        while not done:
            text = oracle.act([conv])[0].text
            taken.append(text)
            _, _, terminated, truncated, info = env.step(text)
            conv.extend_from_env(info["messages"])
            done = terminated or truncated
        actions[seed] = taken
    env.close()
    return actions


def time_steps(env_id: str, env_kwargs: dict[str, Any], actions: dict[int, list[str]], *, tool_steps_only: bool) -> list[float]:
    """Microseconds per `env.step` (unwrapped: no Gymnasium checker wrappers)."""
    env = make(env_id, **env_kwargs).unwrapped
    timings: list[float] = []
    for seed, taken in actions.items():
        env.reset(seed=seed)
        for i, text in enumerate(taken):
            start = time.perf_counter_ns()
            env.step(text)
            elapsed = (time.perf_counter_ns() - start) / 1000
            if not tool_steps_only or i < len(taken) - 1:
                timings.append(elapsed)
    env.close()
    return timings


def bare_request_us(samples: int = 2000) -> float:
    """Median cost of one respx-mocked httpx GET against the shop service."""
    from cgym.mock_apis.shop.data import generate_shop
    from cgym.mock_apis.shop.service import ShopService

    service = ShopService(generate_shop(0))
    name = service.data.customers[0].name
    with service.client() as client:
        timings = []
        for _ in range(samples):
            start = time.perf_counter_ns()
            client.get("/customers", params={"name": name}).json()
            timings.append((time.perf_counter_ns() - start) / 1000)
    return statistics.median(timings)


def run(env_id: str, env_kwargs: dict[str, Any] | None = None, *, episodes: int = 300) -> dict[str, Any]:
    kwargs = dict(env_kwargs or {})
    actions = record_actions(env_id, kwargs, list(range(episodes)))
    time_steps(env_id, kwargs, dict(list(actions.items())[:20]), tool_steps_only=False)  # warm-up
    all_steps = time_steps(env_id, kwargs, actions, tool_steps_only=False)
    tool_steps = time_steps(env_id, kwargs, actions, tool_steps_only=True)
    median = statistics.median(all_steps)
    result: dict[str, Any] = {
        "env": env_id,
        "env_kwargs": kwargs,
        "steps": len(all_steps),
        "median_step_us": round(median, 1),
        "p90_step_us": round(statistics.quantiles(all_steps, n=10)[-1], 1),
        "median_tool_step_us": round(statistics.median(tool_steps), 1) if tool_steps else None,
        "steps_per_s": round(1e6 / median, 1),
    }
    if "ApiReport" in env_id:
        result["bare_request_us"] = round(bare_request_us(), 1)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="cgym/ApiReport-v0")
    parser.add_argument("--env-kwargs", default="{}", help="JSON kwargs for the env")
    parser.add_argument("--episodes", type=int, default=300)
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args(argv)
    from cgym import envs  # noqa: F401 - registers the built-in envs

    result = run(args.env, json.loads(args.env_kwargs), episodes=args.episodes)
    emit(result, args.json)


if __name__ == "__main__":
    main()
