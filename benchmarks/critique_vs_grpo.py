"""GRPO vs Critique-GRPO from the same warm-started model, same wall-clock budget, several seeds.

Usage:
    python -m cgym.benchmarks.critique_vs_grpo --model quickstart/sft --difficulty hard \\
        --budget 180 --seeds 0 1 2 --json runs/critique_vs_grpo.json --plot runs/critique_vs_grpo.png
    (--ablations adds indicative / ground-truth critiques and step critiques without shaping;
     --task-pool N trains on a fixed pool of N train tasks and also reports greedy success on it;
     --env sql runs on SqlQuery; --sft-arm adds "SFT alone": more SFT for the same budget;
     --eval-every 0 evaluates the start model once and each run's final model, nothing between)

    A settings sweep instead of the two arms: repeat --arm NAME=JSON (TrainConfig overrides), and
    --headroom K to measure pass@K at the training temperature of the starting model and of every
    run's final model, and how many test tasks K samples never, sometimes or always solve (what GRPO
    can sharpen towards without learning anything new, and whether training kept it):
    python -m cgym.benchmarks.critique_vs_grpo --model quickstart/sft --difficulty easy --budget 110 \
        --seeds 0 --temperature 0.8 --eval-every 10 --eval-episodes 100 --headroom 8 \
        --arm 'grpo={"critique": "none"}' --arm 'lr_1e-3={"critique": "none", "learning_rate": 1e-3}'

Each run trains for `--budget` seconds of training time and evaluates on the test split at
regular steps; the plot shows test success against training time, the table mean and spread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cgym.agents.options import SamplingOptions

ARMS = {"grpo": {"critique": "none"}, "critique_grpo_step": {"critique": "step"}}
ABLATIONS = {
    "critique_grpo_indicative": {"critique": "indicative"},
    "critique_grpo_ground_truth": {"critique": "ground_truth"},
    "critique_grpo_step_no_shaping": {"critique": "step", "shaping": False},
}


ENVS = {"api": "cgym/ApiReport-v0", "sql": "cgym/SqlQuery-v0"}
SFT_ARM = "sft_more"


@dataclass(frozen=True)
class Setting:
    model: str
    difficulty: str
    budget_s: float
    eval_every: int
    eval_episodes: int
    group_size: int
    tasks_per_step: int
    out: Path
    task_pool: int = 0
    learning_rate: float = 1e-5
    temperature: float = 1.0
    env_id: str = ENVS["api"]
    sft_lr: float = 5e-5


def run_arm(name: str, overrides: dict[str, Any], seed: int, setting: Setting, *, headroom_k: int = 0, start: float | None = None) -> dict[str, Any]:
    """Train one arm from the start model for the budget. With `start` (the start model's test
    success, measured once) the trainer skips its own before/between evals and the final model
    is evaluated here on the same test episodes."""
    from cgym.trainer.config import TrainConfig
    from cgym.trainer.grpo import train

    out = setting.out / f"{name}-seed{seed}"
    base = dict(
        env_id=setting.env_id, env_kwargs={"difficulty": setting.difficulty}, model=setting.model, out=str(out),
        steps=10_000, time_budget_s=setting.budget_s, eval_every=setting.eval_every, eval_episodes=0 if start is not None else setting.eval_episodes,
        group_size=setting.group_size, tasks_per_step=setting.tasks_per_step, task_pool=setting.task_pool,
        learning_rate=setting.learning_rate, temperature=setting.temperature, seed=seed, progress=False, lora_r=0,  # its figures are full fine-tuning
    )  # fmt: skip
    config = TrainConfig.from_dict({**base, **overrides})  # an arm's overrides win over the shared setting
    result = train(config, overwrite=True)  # a run cut short is run again whole
    if start is not None:
        result["before"] = {"success_rate": start}
        result["after"] = test_success(result["final"], setting)
    extra = {}
    if setting.task_pool:
        extra = {"pool_before": pool_success(setting.model, setting), "pool_after": pool_success(result["final"], setting)}
    if headroom_k:
        extra["final_headroom"] = headroom(result["final"], setting, headroom_k)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    elapsed, curve = 0.0, [] if start is None else [(0.0, start)]
    for row in rows:
        elapsed += row.get("step_time_s", 0.0)
        if "eval/success_rate" in row:
            curve.append((round(elapsed, 1), row["eval/success_rate"]))
    if start is not None:
        curve.append((round(elapsed, 1), result["after"]["success_rate"]))
    steps = [r for r in rows if "tokens/initial" in r]
    refine = [r for r in rows if "refine/trigger_rate" in r]
    return {
        "arm": name,
        "seed": seed,
        "before": result["before"]["success_rate"],
        "after": result["after"]["success_rate"],
        "steps": result["steps"],
        "curve": curve,
        "refine_trigger_rate": statistics.mean(r["refine/trigger_rate"] for r in refine) if refine else None,
        "refine_success_rate": statistics.mean(r["refine/success_rate"] for r in refine if r["refine/attempts"]) if any(r["refine/attempts"] for r in refine) else None,
        "rescued_groups": sum(r.get("refine/rescued_groups", 0) for r in refine),
        "tokens": {"initial": sum(r["tokens/initial"] for r in steps), "refined": sum(r["tokens/refined"] for r in steps)},
        **extra,
    }


def run_sft_arm(seed: int, setting: Setting, start: float) -> dict[str, Any]:
    """"SFT alone" at equal extra compute: SFT from the start model on fresh demonstrations
    (seeds no other arm saw) for the same budget, then the same test evaluation."""
    from cgym.agents.demos import demonstrations
    from cgym.trainer.sft import sft

    out = setting.out / f"{SFT_ARM}-seed{seed}"
    demos = demonstrations(setting.env_id, {"difficulty": setting.difficulty}, episodes=SFT_ARM_DEMOS, seed=100 + seed)
    stats = sft(setting.model, demos, out, lr=setting.sft_lr, epochs=1.0, time_budget_s=setting.budget_s, seed=seed, progress=False)
    after = test_success(str(out), setting)["success_rate"]
    return {
        "arm": SFT_ARM, "seed": seed, "before": start, "after": after, "steps": stats["steps"],
        "curve": [(0.0, start), (round(stats["seconds"], 1), after)], "sft_tokens": stats["tokens"],
        "refine_trigger_rate": None, "refine_success_rate": None, "rescued_groups": 0,
    }  # fmt: skip


SFT_ARM_DEMOS = 400  # more than a 10-minute budget gets through on 2 cores (~110 SQL easy demos): the clock ends the run


def test_success(model: str, setting: Setting) -> dict[str, Any]:
    """Greedy success on the trainer's test episodes."""
    from cgym.trainer.grpo import EVAL_SEED

    return _evaluate(model, setting, split="test", episodes=setting.eval_episodes, seed=EVAL_SEED)[0]


def _rates(start: dict[str, Any] | None) -> dict[str, float]:
    """The greedy and pass@K rates of a headroom measurement (the lines the plot draws)."""
    return {key: value for key, value in (start or {}).items() if key == "greedy" or (key.startswith("pass@") and key != "pass@1")}


def parse_arm(text: str) -> tuple[str, dict[str, Any]]:
    """`NAME=JSON` -> (name, TrainConfig overrides), for `--arm`."""
    name, sep, overrides = text.partition("=")
    try:
        parsed = json.loads(overrides) if sep else None
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--arm {text!r}: the overrides after '=' are not JSON ({exc})") from exc
    if not name or not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"--arm {text!r}: expected NAME={{...}}, e.g. 'lr_1e-3={{\"learning_rate\": 0.001}}'")
    return name, parsed


def headroom(model: str, setting: Setting, samples: int) -> dict[str, Any]:
    """Greedy success, and pass@`samples` at the training temperature with the test tasks split
    by how many of the tries solved them (never / sometimes / always), on the test episodes."""
    from cgym.trainer.grpo import EVAL_SEED

    test = {"split": "test", "episodes": setting.eval_episodes, "seed": EVAL_SEED}
    sampled, results = _evaluate(model, setting, temperature=setting.temperature, samples=samples, **test)
    return {
        "greedy": _evaluate(model, setting, **test)[0]["success_rate"],
        "pass@1": sampled["pass@1"],
        f"pass@{samples}": sampled[f"pass@{samples}"],
        "tasks": task_split([r.success for r in results], samples),
    }


def task_split(successes: list[bool], samples: int) -> dict[str, int]:
    """How many tasks (`samples` consecutive tries each) were solved never, sometimes, always."""
    solved = [sum(successes[i : i + samples]) for i in range(0, len(successes), samples)]
    return {"never": sum(n == 0 for n in solved), "sometimes": sum(0 < n < samples for n in solved), "always": sum(n == samples for n in solved)}


def pool_success(model: str, setting: Setting) -> float:
    """Greedy success on the training pool's tasks (train split, seeds 0..task_pool-1)."""
    return _evaluate(model, setting, split="train", episodes=setting.task_pool, seed=0, batch_size=64)[0]["success_rate"]


def _evaluate(model: str, setting: Setting, *, split: str, episodes: int, seed: int, temperature: float = 0.0, samples: int = 1, batch_size: int = 128) -> tuple[dict[str, Any], list[Any]]:
    from cgym.agents.eval.evaluate import EvalConfig, evaluate
    from cgym.agents.local.hf import HFPolicy

    policy = HFPolicy.from_pretrained(model, sampling=SamplingOptions(temperature=temperature, max_new_tokens=96, seed=0))
    config = EvalConfig(setting.env_id, {"difficulty": setting.difficulty, "split": split}, episodes=episodes, seed=seed, samples=samples, batch_size=batch_size)
    return evaluate(policy, config)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for arm in dict.fromkeys(r["arm"] for r in runs):
        finals = [r["after"] for r in runs if r["arm"] == arm]
        mine = [r for r in runs if r["arm"] == arm]
        # final_std is the population std (kept for the JSONs already written); the README quotes final_sample_std
        table[arm] = {"final_mean": statistics.mean(finals), "final_std": statistics.pstdev(finals), "final_sample_std": _sample_std(finals), "finals": finals, "before": [r["before"] for r in mine]}
        if all("pool_after" in r for r in mine):
            pool = [r["pool_after"] for r in mine]
            table[arm].update(pool_mean=statistics.mean(pool), pool_std=statistics.pstdev(pool), pool_finals=pool, pool_before=[r["pool_before"] for r in mine])
    return table


def _sample_std(values: list[float]) -> float | None:
    """The spread of a few seeds (n - 1 in the divisor); None for a single seed."""
    return statistics.stdev(values) if len(values) > 1 else None


def plot(runs: list[dict[str, Any]], path: Path, *, title: str = "GRPO vs Critique-GRPO", start: dict[str, float] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    colors = {}
    for run in runs:
        color = colors.setdefault(run["arm"], f"C{len(colors)}")
        xs, ys = zip(*run["curve"]) if run["curve"] else ((), ())
        ax.plot(xs, ys, "o-", color=color, alpha=0.7, label=run["arm"] if run["seed"] == runs[0]["seed"] else None)
    for n, (label, value) in enumerate(sorted((start or {}).items(), key=lambda item: item[1])):
        ax.axhline(value, color="0.4", linestyle=(0, (2, 2 + n)), linewidth=1)
        ax.annotate(f"start model {label} ({value:.0%})", (0.0, value), textcoords="offset points", xytext=(2, 3), fontsize=7, color="0.3")
    ax.set_xlabel("training time (s)")
    ax.set_ylabel("test success rate")
    top = max([y for run in runs for _, y in run["curve"]] + list((start or {}).values()), default=1.0)
    ax.set_ylim(0.0, min(1.02, top + 0.15))
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, title="one line per seed", title_fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the warm-started (SFT) model directory")
    parser.add_argument("--env", choices=sorted(ENVS), default="api")
    parser.add_argument("--difficulty", default="hard")
    parser.add_argument("--budget", type=float, default=180.0, help="training seconds per run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--eval-episodes", type=int, default=50)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--tasks-per-step", type=int, default=4)
    parser.add_argument("--task-pool", type=int, default=0, help="train on a fixed pool of N train tasks (0: the whole split)")
    parser.add_argument("--lr", type=float, default=1e-5, help="GRPO learning rate (1e-5 suits SmolLM2; the tiny model trained at 2e-4)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--ablations", action="store_true", help="also run the ablation arms (first seed only)")
    parser.add_argument("--ablation-seeds", type=int, nargs="+", help="seeds for the ablation arms (default: the first of --seeds)")
    parser.add_argument("--sft-arm", action="store_true", help='also run "SFT alone": more SFT for the same budget, every seed')
    parser.add_argument("--arm", type=parse_arm, action="append", default=[], metavar="NAME=JSON", help="run these arms (TrainConfig overrides) instead of GRPO vs Critique-GRPO; repeatable")
    parser.add_argument("--headroom", type=int, default=0, metavar="K", help="also measure greedy success and pass@K at --temperature of the starting model and of each run's final one")
    parser.add_argument("--out", type=Path, default=Path("runs/critique_vs_grpo"))
    parser.add_argument("--json", type=Path, default=Path("runs/critique_vs_grpo.json"))
    parser.add_argument("--plot", type=Path, default=Path("runs/critique_vs_grpo.png"))
    args = parser.parse_args(argv)
    from cgym import envs  # noqa: F401

    setting = Setting(
        args.model, args.difficulty, args.budget, args.eval_every, args.eval_episodes, args.group_size, args.tasks_per_step, args.out,
        task_pool=args.task_pool, learning_rate=args.lr, temperature=args.temperature, env_id=ENVS[args.env],
    )  # fmt: skip
    arms = dict(args.arm) or ARMS
    plan = [(name, overrides, seed) for seed in args.seeds for name, overrides in arms.items()]
    if args.ablations:
        plan += [(name, overrides, seed) for seed in args.ablation_seeds or args.seeds[:1] for name, overrides in ABLATIONS.items()]
    if args.sft_arm:  # seed by seed, so a run cut short still holds whole seeds of every arm
        plan = [step for seed in args.seeds for step in [(SFT_ARM, {}, seed), *(p for p in plan if p[2] == seed and p[0] in arms)]] + [
            p for p in plan if p[0] not in arms
        ]
    result: dict[str, Any] = {"command": "python -m cgym.benchmarks.critique_vs_grpo " + " ".join(sys.argv[1:] if argv is None else argv), "setting": {k: str(v) for k, v in vars(setting).items()}, "arms": arms}
    if args.headroom:
        result["start"] = headroom(args.model, setting, args.headroom)
    start = test_success(args.model, setting)["success_rate"] if args.eval_every == 0 else None
    result["start_greedy"] = start
    runs: list[dict[str, Any]] = []
    args.json.parent.mkdir(parents=True, exist_ok=True)
    for name, overrides, seed in plan:  # the JSON is rewritten after every run: a crash loses one run at most
        if name == SFT_ARM:
            runs.append(run_sft_arm(seed, setting, start if start is not None else test_success(args.model, setting)["success_rate"]))
        else:
            runs.append(run_arm(name, overrides, seed, setting, headroom_k=args.headroom, start=start))
        result.update(table=summarize(runs), runs=runs)
        args.json.write_text(json.dumps(result, indent=2))
        plot(runs, args.plot, title=f"{setting.env_id.split('/')[1]} {args.difficulty}: {args.budget:.0f} s of training per run, {args.eval_episodes} test episodes", start=_rates(result.get("start")))
    print(json.dumps({key: result[key] for key in ("start", "table") if key in result}, indent=2))


if __name__ == "__main__":
    main()
