"""Where does SFT leave room for RL? A short SFT on each split, then greedy success and pass@K.

Usage:
    python -m cgym.benchmarks.headroom --model smollm2-135m --demos 96 --tasks 24 --samples 8 \\
        --json benchmarks/results/headroom_smollm2.json

For each split (ApiReport medium and hard, SqlQuery easy, medium and hard by default; `--split
ENV:DIFFICULTY` to choose) this warm-starts the model on scripted demonstrations of that split,
then on the same `--tasks` test tasks measures greedy success and, at `--temperature`, pass@1,
pass@K and how many tasks K samples solve never, sometimes or always. GRPO learns from the
"sometimes" tasks (a group with mixed rewards); Critique-GRPO also from the "never" ones, when a
critique-guided refinement succeeds. The JSON is rewritten after every step of a split (SFT,
greedy eval, sampled eval).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cgym.agents.options import SamplingOptions
from cgym.benchmarks.critique_vs_grpo import ENVS, task_split

SPLITS = ("api:medium", "api:hard", "sql:easy", "sql:medium", "sql:hard")


def parse_split(text: str) -> tuple[str, str]:
    """`api:medium` -> ("cgym/ApiReport-v0", "medium")."""
    family, sep, difficulty = text.partition(":")
    if not sep or family not in ENVS or not difficulty:
        raise argparse.ArgumentTypeError(f"--split {text!r}: expected one of {', '.join(ENVS)} then ':' and a difficulty, e.g. api:medium")
    return ENVS[family], difficulty


def measure_split(env_id: str, difficulty: str, args: argparse.Namespace, save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """SFT on `args.demos` train demos of the split (or, with `--reuse-sft`, the checkpoint a
    previous run left), then the greedy and sampled test evals; `save` gets the row after each
    step, so a run that dies while sampling keeps its SFT and greedy figures."""
    from cgym.agents.demos import demonstrations
    from cgym.agents.eval.evaluate import EvalConfig, evaluate
    from cgym.agents.eval.progress import episode_progress
    from cgym.agents.local.hf import HFPolicy
    from cgym.trainer.grpo import EVAL_SEED  # the trainer's test seeds
    from cgym.trainer.sft import sft
    from rich.console import Console

    kwargs = {"difficulty": difficulty}
    out = args.out / f"{env_id.split('/')[1]}-{difficulty}"
    row: dict[str, Any] = {"env": env_id, "difficulty": difficulty, "model_dir": str(out / "sft")}
    if args.reuse_sft and (out / "sft" / "config.json").exists():
        row["sft"] = {"reused": str(out / "sft")}
    else:
        start = time.perf_counter()
        demos = demonstrations(env_id, kwargs, episodes=args.demos, seed=1)
        stats = sft(args.model, demos, out / "sft", lr=args.lr, epochs=1.0, seed=0, progress=False)
        row["sft"] = {"demos": args.demos, "steps": stats["steps"], "first_loss": round(stats["first_loss"], 4), "final_loss": round(stats["final_loss"], 4), "seconds": round(time.perf_counter() - start, 1)}
    save(row)
    test = {**kwargs, "split": "test"}

    def run(temperature: float, samples: int) -> tuple[dict[str, Any], list[Any]]:
        policy = HFPolicy.from_pretrained(out / "sft", sampling=SamplingOptions(temperature=temperature, max_new_tokens=args.max_new_tokens, seed=0))
        config = EvalConfig(env_id, test, episodes=args.tasks, seed=EVAL_SEED, samples=samples, batch_size=args.batch_size)
        with episode_progress(Console(stderr=True), len(config.seeds), f"{env_id} {difficulty} T {temperature}") as advance:
            return evaluate(policy, config, on_done=advance)

    greedy, _ = run(0.0, 1)
    row.update({"greedy": greedy["success_rate"], "greedy_codes": greedy["critique_codes"], "greedy_seconds": greedy["wall_s"], "greedy_context_cuts": greedy["context_cuts"]})
    save(row)
    sampled, results = run(args.temperature, args.samples)
    k = args.samples
    row.update({
        "temperature": args.temperature,
        "pass@1": sampled["pass@1"],
        f"pass@{k}": sampled[f"pass@{k}"],
        f"pass^{k}": sampled[f"pass^{k}"],
        "tasks": task_split([r.success for r in results], k),
        "sampled_codes": sampled["critique_codes"],
        "sampled_mean_turns": sampled["mean_turns"],
        "sampled_context_cuts": sampled["context_cuts"],
        "eval_seconds": round(greedy["wall_s"] + sampled["wall_s"], 1),
    })
    save(row)
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--split", type=parse_split, action="append", default=[], metavar="ENV:DIFFICULTY", help=f"repeatable; default {' '.join(SPLITS)}")
    parser.add_argument("--demos", type=int, default=96, help="SFT demonstrations per split (1 epoch)")
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--tasks", type=int, default=24, help="test tasks per split")
    parser.add_argument("--samples", type=int, default=8, help="K, for pass@K")
    parser.add_argument("--temperature", type=float, default=1.0, help="the training temperature")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--batch-size", type=int, default=64, help="episodes run at once (the policy samples them in chunks of similar length within its memory budget, `agents.local.batching`)")
    parser.add_argument("--reuse-sft", action="store_true", help="skip a split's SFT where --out already holds its checkpoint")
    parser.add_argument("--out", type=Path, default=Path("runs/headroom"))
    parser.add_argument("--json", type=Path, default=Path("runs/headroom.json"))
    args = parser.parse_args(argv)
    from cgym import envs  # noqa: F401

    splits = args.split or [parse_split(s) for s in SPLITS]
    result: dict[str, Any] = {"command": "python -m cgym.benchmarks.headroom " + " ".join(sys.argv[1:] if argv is None else argv), "model": args.model, "splits": []}
    args.json.parent.mkdir(parents=True, exist_ok=True)

    def save(row: dict[str, Any]) -> None:  # the finished splits and this one, so far
        args.json.write_text(json.dumps({**result, "splits": [*result["splits"], row]}, indent=2))

    for env_id, difficulty in splits:
        row = measure_split(env_id, difficulty, args, save)
        result["splits"].append(row)
        print(json.dumps({k: row[k] for k in ("env", "difficulty", "greedy", f"pass@{args.samples}", "tasks")}), flush=True)


if __name__ == "__main__":
    main()
