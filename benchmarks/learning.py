"""Does training help? Arms trained from one start, several seeds, judged on the same test episodes.

The measurement protocol: every arm (GRPO, RFT, Critique-GRPO, ...) starts from the same model,
trains for the same wall-clock budget (or the same number of steps) under each seed, and is then
evaluated greedily on the same test episodes as the start. Differences are paired episode by
episode and pooled over seeds, with a two-level bootstrap interval (`agents.eval.paired`); a PNG shows
test success against training seconds for every arm.

Usage (the CPU defaults: LoRA rank 16 on every linear layer, lr 2e-4, temperature 0.7, 2 tasks x 8):
    python -m cgym.benchmarks.learning --start runs/sft --env cgym/SqlQuery-v0 --env-kwargs '{"difficulty": "easy"}' \\
        --arm grpo --arm rft --seeds 0 1 2 --budget 600 --eval-episodes 100 \\
        --json benchmarks/results/learning_sql_easy.json --plot benchmarks/results/learning_sql_easy.png
    --arm NAME takes a built-in arm (grpo, rft, critique_step, critique_every_group) or NAME=JSON
    (TrainConfig overrides); --steps N trains every arm N steps instead of a time budget; --eval-every N
    also evaluates every N-th step's checkpoint (a curve, not only its end); --resume keeps the runs a
    previous call of the same command finished.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cgym.agents.options import SamplingOptions
from cgym.benchmarks.critique_vs_grpo import parse_arm
from cgym.benchmarks.output import machine

EVAL_SEED = 10_000
DEFAULTS: dict[str, Any] = {"lora_r": 16, "learning_rate": 2e-4, "temperature": 0.7, "group_size": 8, "tasks_per_step": 2}
ARMS: dict[str, dict[str, Any]] = {
    "grpo": {},
    "rft": {"algo": "rft"},
    "critique_step": {"critique": "step"},
    # as Critique-GRPO's released script: one critique-guided refinement in every group that has a failure
    "critique_every_group": {"critique": "step", "refine_fail_fraction": 0.125, "refine_attempts": 1, "refine_k": 1},
}


@dataclass(frozen=True)
class Setting:
    """What every arm shares."""

    start: str
    env_id: str
    env_kwargs: dict[str, Any]
    seeds: tuple[int, ...]
    budget_s: float
    steps: int
    eval_episodes: int
    eval_every: int
    out: Path
    train: dict[str, Any] = field(default_factory=dict)


def run_arm(name: str, overrides: dict[str, Any], seed: int, setting: Setting) -> dict[str, Any]:
    """Train one arm under one seed from the start, then evaluate its checkpoints and final model."""
    from cgym.trainer.config import TrainConfig
    from cgym.trainer.grpo import train
    from cgym.trainer.metrics import MetricsLog

    out = setting.out / f"{name}-seed{seed}"
    config = TrainConfig.from_dict({
        "env_id": setting.env_id, "env_kwargs": setting.env_kwargs, "model": setting.start, "out": str(out), "seed": seed,
        "steps": setting.steps, "time_budget_s": setting.budget_s, "save_every": setting.eval_every, "eval_episodes": 0, "progress": False,
        **setting.train, **overrides,
    })  # fmt: skip
    result = trained_already(out, config.to_dict()) or train(config, overwrite=True)  # a run cut short is run again whole
    rows = MetricsLog(out / "metrics.jsonl").rows()
    steps = [r for r in rows if "step_time_s" in r]
    elapsed = list(itertools.accumulate(r["step_time_s"] for r in steps))
    checkpoints = range(setting.eval_every, result["steps"], setting.eval_every) if setting.eval_every else range(0)
    curve = [(round(elapsed[step - 1], 1), test_outcomes(str(out / "checkpoints" / f"step-{step}"), setting)[0]) for step in checkpoints]
    errors: list[Any] = []
    final_rate, outcomes = test_outcomes(result["final"], setting, errors)
    curve.append((round(elapsed[-1] if elapsed else 0.0, 1), final_rate))
    refine = [r for r in steps if "refine/attempts" in r]
    return {
        "arm": name, "seed": seed, "machine": machine(), "overrides": overrides, "steps": result["steps"], "train_s": round(result["train_time_s"], 1), **({"recovered": True} if result.get("recovered") else {}),
        "success": final_rate, "curve": curve, "outcomes": outcomes, "first_errors": errors, "errors": error_profile(errors),
        "sampled_success": [r["success_rate"] for r in steps],
        "refine": {"attempts": sum(r["refine/attempts"] for r in refine), "rescued_groups": sum(r["refine/rescued_groups"] for r in refine),
                   "success_rate": _ratio(sum(r["refine/success_rate"] * r["refine/attempts"] for r in refine), sum(r["refine/attempts"] for r in refine))} if refine else None,
    }  # fmt: skip


def trained_already(out: Path, config: dict[str, Any]) -> dict[str, Any] | None:
    """What `train` returned, for a run of this config that finished training but lost its evaluation
    (the benchmark was stopped while it evaluated): its final model passes its manifest check and
    holds the last logged step. None when the run has to be trained (again).

    Its `train_time_s` is the sum of the logged step times (the trainer's own clock also counts the
    save between steps, a second or two over a run)."""
    from cgym.trainer.checkpoint import CheckpointError, verify_checkpoint
    from cgym.trainer.metrics import MetricsLog

    final, saved = out / "final", out / "train_config.json"
    steps = [r for r in MetricsLog(out / "metrics.jsonl").rows() if "step_time_s" in r]
    try:
        if not steps or json.loads(saved.read_text()) != json.loads(json.dumps(config, default=str)):
            return None
        verify_checkpoint(final)
        if json.loads((final / "manifest.json").read_text()).get("step") != steps[-1]["step"]:
            return None
    except (OSError, ValueError, CheckpointError):
        return None
    return {"steps": steps[-1]["step"], "train_time_s": sum(r["step_time_s"] for r in steps), "final": str(final), "recovered": True}


def _ratio(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def test_outcomes(model: str, setting: Setting, errors: list[Any] | None = None) -> tuple[float, list[int]]:
    """Greedy success rate and per-episode outcomes (1/0) on the fixed test episodes.

    `errors`, when given, receives each episode's first error as `[turn, code]` (None where it
    succeeded): where a policy goes wrong, and whether training moves that later.
    """
    from cgym.agents.eval.evaluate import EvalConfig, evaluate
    from cgym.agents.local.hf import HFPolicy

    policy = HFPolicy.from_pretrained(model, sampling=SamplingOptions(temperature=0.0, max_new_tokens=setting.train.get("max_new_tokens", 96), seed=0))
    config = EvalConfig(setting.env_id, {**setting.env_kwargs, "split": "test"}, episodes=setting.eval_episodes, seed=EVAL_SEED, batch_size=100)
    summary, results = evaluate(policy, config)
    if errors is not None:
        errors += [first_error(r.critiques) if not r.success else None for r in results]
    return summary["success_rate"], [int(r.success) for r in results]


def first_error(critiques: list[dict[str, Any]]) -> list[Any] | None:
    """The earliest critique of a failed episode as `[turn, code]` (the first of that turn)."""
    return [critiques[0]["step"], critiques[0]["code"]] if critiques else None  # the env sorts them by step


def error_profile(errors: list[list[Any] | None]) -> dict[str, Any]:
    """First errors summed up: how many at each turn, the codes counted, the mean turn of a first error."""
    failed = [e for e in errors if e is not None]
    return {
        "first_error_turn": dict(sorted(Counter(str(turn) for turn, _ in failed).items())),
        "first_error_code": dict(Counter(code for _, code in failed).most_common()),
        "mean_first_error_turn": round(sum(turn for turn, _ in failed) / len(failed), 2) if failed else None,
    }


def paired_table(start: list[int], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Every arm against the start, and every pair of arms, on the seeds both ran."""
    from cgym.agents.eval.paired import paired_difference

    by_arm: dict[str, dict[int, list[int]]] = {}
    for run in runs:
        by_arm.setdefault(run["arm"], {})[run["seed"]] = run["outcomes"]
    table: dict[str, Any] = {}
    for arm, seeds in by_arm.items():
        order = sorted(seeds)
        table[f"{arm} - start"] = paired_difference([start] * len(order), [seeds[s] for s in order]).to_dict() | {"seeds": order}
    for a, b in itertools.combinations(by_arm, 2):
        common = sorted(set(by_arm[a]) & set(by_arm[b]))
        if common:
            table[f"{a} - {b}"] = paired_difference([by_arm[b][s] for s in common], [by_arm[a][s] for s in common]).to_dict() | {"seeds": common}
    return table


def plot(result: dict[str, Any], path: Path) -> None:
    """Test success against training seconds: a line per run, a colour per arm, the start dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    colors: dict[str, str] = {}
    start = result["start"]["success"]
    for run in result["runs"]:
        color = colors.setdefault(run["arm"], f"C{len(colors)}")
        xs, ys = zip(*([(0.0, start)] + [tuple(p) for p in run["curve"]]))
        ax.plot(xs, ys, "o-", color=color, alpha=0.75, label=run["arm"] if run["arm"] not in ax.get_legend_handles_labels()[1] else None)
    ax.axhline(start, color="0.4", linestyle="--", linewidth=1, label=f"start ({start:.0%})")
    ax.set_xlabel("training time (s)")
    ax.set_ylabel(f"greedy test success ({result['setting']['eval_episodes']} episodes)")
    ax.set_ylim(0.0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, title="one line per seed", title_fontsize=8)
    ax.set_title(f"{result['setting']['env_id']} {json.dumps(result['setting']['env_kwargs'])}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def resolve_arms(specs: list[tuple[str, dict[str, Any] | None]]) -> dict[str, dict[str, Any]]:
    """`--arm` values -> {name: overrides}; a bare name must be a built-in arm."""
    arms: dict[str, dict[str, Any]] = {}
    for name, overrides in specs or [("grpo", None), ("rft", None)]:
        if overrides is None and name not in ARMS:
            raise SystemExit(f"error: unknown arm {name!r}: use one of {sorted(ARMS)} or NAME=JSON")
        arms[name] = ARMS[name] if overrides is None else overrides
    return arms


def _arm(text: str) -> tuple[str, dict[str, Any] | None]:
    return parse_arm(text) if "=" in text else (text, None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--start", required=True, help="the model every arm starts from (an SFT'd directory)")
    parser.add_argument("--env", default="cgym/ApiReport-v0")
    parser.add_argument("--env-kwargs", type=json.loads, default={"difficulty": "easy"})
    parser.add_argument("--arm", type=_arm, action="append", default=[], metavar="NAME[=JSON]")
    parser.add_argument("--train", type=json.loads, default={}, help="TrainConfig overrides for every arm (over the CPU defaults)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--budget", type=float, default=0.0, help="training seconds per run (equal wall clock); 0: --steps only")
    parser.add_argument("--steps", type=int, default=10_000, help="optimizer steps per run (a cap when --budget is set)")
    parser.add_argument("--eval-episodes", type=int, default=100)
    parser.add_argument("--eval-every", type=int, default=0, help="also evaluate every N-th step's checkpoint")
    parser.add_argument("--out", type=Path, default=Path("runs/learning"))
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--resume", action="store_true", help="keep the runs the JSON already holds for this command")
    parser.add_argument("--profile-errors", action="store_true", help="with --resume: evaluate the start and kept runs that lack first-error profiles again to add them")
    args = parser.parse_args(argv)
    if not args.budget and args.steps == 10_000:
        parser.error("give --budget SECONDS (equal wall clock) or --steps N")
    from cgym import envs  # noqa: F401

    arms = resolve_arms(args.arm)
    setting = Setting(args.start, args.env, args.env_kwargs, tuple(args.seeds), args.budget, args.steps, args.eval_episodes, args.eval_every, args.out, DEFAULTS | args.train)
    shown = json.loads(json.dumps(asdict(setting), default=str))  # as the JSON holds it, so a resume can compare
    result: dict[str, Any] = {"command": "python -m cgym.benchmarks.learning " + " ".join(sys.argv[1:] if argv is None else argv), "setting": shown, "arms": arms, "runs": []}
    if args.resume and args.json.exists():
        previous = json.loads(args.json.read_text())
        if previous.get("setting") == shown:
            result.update(start=previous.get("start"), runs=previous.get("runs", []))
    if not result.get("start") or (args.profile_errors and "errors" not in result["start"]):
        errors: list[Any] = []
        rate, outcomes = test_outcomes(args.start, setting, errors)
        result["start"] = {"machine": machine(), "success": rate, "outcomes": outcomes, "first_errors": errors, "errors": error_profile(errors)}
        _save(result, args)
    for run in result["runs"] if args.profile_errors else []:  # runs from before the error profile get it from their final model
        final = setting.out / f"{run['arm']}-seed{run['seed']}" / "final"
        if "errors" not in run and final.is_dir():
            errors = []
            _, outcomes = test_outcomes(str(final), setting, errors)
            run.update(first_errors=errors, errors=error_profile(errors), errors_outcomes_match=outcomes == run["outcomes"])
            _save(result, args)
    for seed, (name, overrides) in itertools.product(args.seeds, arms.items()):  # seed by seed: a cut run holds whole seeds
        if any(r["arm"] == name and r["seed"] == seed for r in result["runs"]):
            continue
        result["runs"].append(run_arm(name, overrides, seed, setting))
        _save(result, args)
    _save(result, args)
    print(json.dumps({k: result[k] for k in ("table", "paired")}, indent=2))


def machines_used(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The distinct machines the runs trained on (runs from before the record count as unknown),
    with a warning on stderr when there is more than one: equal wall clock is then not equal work."""
    seen: list[dict[str, Any]] = []
    for run in runs:
        where = run.get("machine", {"cpu": "unknown"})
        if where not in seen:
            seen.append(where)
    if len(seen) > 1:
        print(f"warning: these runs trained on {len(seen)} kinds of machine; equal wall clock is not equal work: {seen}", file=sys.stderr)
    return seen


def _save(result: dict[str, Any], args: argparse.Namespace) -> None:
    """Rewrite the JSON (and PNG) after every run: a crash loses one run at most."""
    runs = result["runs"]
    result["table"] = {arm: {"success": [r["success"] for r in runs if r["arm"] == arm], "steps": [r["steps"] for r in runs if r["arm"] == arm]} for arm in dict.fromkeys(r["arm"] for r in runs)}
    result["paired"] = paired_table(result["start"]["outcomes"], runs)
    result["machines"] = machines_used(runs)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
