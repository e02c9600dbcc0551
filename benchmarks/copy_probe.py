"""Does a model copy a report's values from the tool result, or guess them? (`agents.copy_probe`)

Usage:
    python -m benchmarks.copy_probe --model quickstart/sft --model quickstart/grpo/final \\
        --env-kwargs '{"difficulty": "easy"}' --episodes 300 --json runs/copy_probe.json

Runs the oracle on the test episodes, then probes every model on its transcripts (teacher-forced):
per report field, the share of values whose every token is the model's top choice and the mean
probability of the right value, broken down by value for few-valued fields, and the most common
token misses.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers import AutoModelForCausalLM, AutoTokenizer

from agents.copy_probe import oracle_transcripts, probe_model
from benchmarks.output import emit


def probe(model_dirs: Sequence[str], env_id: str, env_kwargs: dict[str, Any], seeds: Sequence[int]) -> dict[str, Any]:
    """Probe every model directory on the oracle's transcripts of `seeds`."""
    transcripts = oracle_transcripts(env_id, env_kwargs, seeds)
    report: dict[str, Any] = {"env": env_id, "env_kwargs": {"split": "test", **env_kwargs}, "episodes": len(transcripts), "models": {}}
    for path in model_dirs:
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        report["models"][path] = probe_model(model, AutoTokenizer.from_pretrained(path), transcripts)
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", required=True, help="a model directory; repeat to compare")
    parser.add_argument("--env", default="cgym/ApiReport-v0")
    parser.add_argument("--env-kwargs", type=json.loads, default={}, help='JSON, e.g. \'{"difficulty": "easy"}\'')
    parser.add_argument("--episodes", type=int, default=300)
    parser.add_argument("--seed", type=int, default=10_000, help="first test seed (the trainer's evaluation seeds by default)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.episodes < 1:
        parser.error("--episodes must be >= 1")
    emit(probe(args.model, args.env, args.env_kwargs, range(args.seed, args.seed + args.episodes)), args.json)


if __name__ == "__main__":
    main()
