"""The GPU paths of the trainer, checked for real, for whoever has a CUDA GPU (CI has none).

    python -m cgym.benchmarks.gpu_check --model smollm2-135m --json benchmarks/results/gpu_check.json

Each check runs on its own and reports ok / skipped (with why) / failed (with the error), so one
missing piece does not hide the others:

- `train_cuda`: `cgym train --device cuda` for 2 GRPO steps on ApiReport easy (in-process sampler);
- `vllm_push`: an in-process `VLLMSampler` takes a full-weight push: greedy replies from the
  start weights, then from weights whose final norm is zeroed (every logit 0, so the reply must
  change), then from the start weights again (the first reply must come back);
- `train_vllm`: 2 GRPO steps with `--served vllm:` (rollouts from vLLM, weights pushed each step);
  `sampler/logp_diff_max` is the largest gap between vLLM's log-probs and the trainer's;
- `torchrun_nccl`: with 2 or more GPUs, 2 ranks of `cgym train --device cuda` over NCCL for 2 steps.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from cgym.agents.options import SamplingOptions
from cgym.benchmarks.output import emit

ENV_ID = "cgym/ApiReport-v0"


class Skip(Exception):
    """A check that cannot run here; its message says why."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="cgym-gpu-check-"))
    checks: dict[str, Callable[[], dict[str, Any]]] = {
        "train_cuda": lambda: _train(args.model, root / "cuda", served=""),
        "vllm_push": lambda: _vllm_push(args.model, root / "push"),
        "train_vllm": lambda: _train(args.model, root / "vllm", served="vllm:"),
        "torchrun_nccl": lambda: _torchrun(args.model, root / "ddp"),
    }
    results = {name: _run(check) for name, check in checks.items()}
    shutil.rmtree(root, ignore_errors=True)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    emit({"device": device, "torch": torch.__version__, "vllm": _version("vllm"), "checks": results}, args.json)
    sys.exit(1 if any(r["status"] == "failed" for r in results.values()) else 0)


def _run(check: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    started = time.perf_counter()
    try:
        row = {"status": "ok", **check()}
    except Skip as why:
        row = {"status": "skipped", "why": str(why)}
    except Exception as exc:  # a check's failure is its result, not the end of the script
        row = {"status": "failed", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=6)}
    return row | {"seconds": round(time.perf_counter() - started, 1)}


def _config(model: str, out: Path, **fields: Any) -> Any:
    from cgym.trainer.config import TrainConfig

    base = TrainConfig(
        env_id=ENV_ID, env_kwargs={"difficulty": "easy"}, model=model, out=str(out), steps=2, group_size=4,
        tasks_per_step=2, eval_episodes=8, progress=False, device="cuda",
    )  # fmt: skip
    return replace(base, **fields)


def _train(model: str, out: Path, *, served: str) -> dict[str, Any]:
    _need_cuda()
    if served:
        _need_vllm()
    from cgym.trainer.grpo import train

    summary = train(_config(model, out, served=served), overwrite=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    keys = ("loss", "grad_norm", "train_tokens", "sampler/logp_diff_max", "served/weights_step", "served/push_s")
    return {
        "steps": summary["steps"],
        "success_before": (summary["before"] or {}).get("success_rate"),
        "success_after": (summary["after"] or {}).get("success_rate"),
        "rows": [{k: r[k] for k in keys if k in r} for r in steps],
    }


def _vllm_push(model: str, out: Path) -> dict[str, Any]:
    _need_cuda()
    _need_vllm()
    from cgym.agents.base import Conversation
    from cgym.agents.local.hf import HFPolicy
    from cgym.trainer.samplers.vllm_sampler import VLLMSampler

    policy = HFPolicy.from_pretrained(model, device="cuda", dtype=torch.float32)
    sampler = VLLMSampler(policy.tokenizer, policy.model.name_or_path, sampling=SamplingOptions(temperature=0.0, max_new_tokens=16))

    push_ms: list[float] = []

    def reply(weights: torch.nn.Module, step: int) -> list[int]:
        push_ms.append(round(sampler.push(weights, step, out) * 1000, 1))
        conv = Conversation([{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Name a colour."}])
        return list(sampler.act([conv])[0].token_ids)

    start = reply(policy.model, 0)
    silenced = copy.deepcopy(policy.model)
    torch.nn.init.zeros_(silenced.model.norm.weight)
    zeroed = reply(silenced, 1)
    back = reply(policy.model, 2)
    if zeroed == start or back != start:
        raise AssertionError(f"pushes did not reach vLLM: start {start}, zeroed norm {zeroed}, start again {back}")
    return {"greedy_start": start, "greedy_zeroed_norm": zeroed, "push_ms": push_ms}


def _torchrun(model: str, out: Path) -> dict[str, Any]:
    _need_cuda()
    if torch.cuda.device_count() < 2:
        raise Skip(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    cgym = shutil.which("cgym")
    if cgym is None:
        raise Skip("the cgym command is not on PATH (pip install -e .)")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", cgym, "train", "--env", ENV_ID,
        "--env-kwargs", '{"difficulty": "easy"}', "--model", model, "--out", str(out), "--steps", "2",
        "--group-size", "4", "--tasks-per-step", "2", "--eval-episodes", "0", "--device", "cuda",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"torchrun exited {done.returncode}: {done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"metrics_rows": len(rows), "losses": [r.get("loss") for r in rows]}


def _need_cuda() -> None:
    if not torch.cuda.is_available():
        raise Skip(f"torch {torch.__version__} sees no CUDA GPU")


def _need_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        raise Skip("vLLM is not installed (pip install 'critique-gym[vllm]')")


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
