"""The CPU speed figures with their compute floors: a GRPO step and a greedy eval, timed, with the
FLOPs of the tokens they ran and this CPU's matmul peak measured in the same run.

    python -m cgym.benchmarks.cpu_floors --model runs/sft_easy --json benchmarks/results/cpu_floors_smollm2.json

The GRPO steps train LoRA adapters (rank 16, the training default; `--lora-r 0`: every weight).

Every forward call of a causal LM is counted by a global forward pre-hook (rows x new tokens,
the keys each attends to (counted from the mask where it is a given 4D one: the loss pass's prefix
trees), the LM-head columns kept, and whether autograd is recording, which means a backward
follows). FLOPs are the usual dense estimate: 2 x non-embedding parameters per token, 4 x layers x
hidden x keys per token for attention, 2 x hidden x vocab per LM-head column; padding counts, since
it is computed. A backward costs, per weight, one forward's products for the gradient of its input
and, where the weight requires a gradient, another for its own: 2x the forward with every weight
trained, 1x for LoRA's frozen base (its adapters, trained, count 2x). Attention has no weights: its
backward takes the gradients of queries, keys and values, 2x its forward, frozen base or not. The
floor of a figure is its FLOPs divided by the measured bf16 matmul peak (the dtype both phases run
in on this CPU); `distance` = measured / floor.

A decode step of a few rows reads every weight to do little arithmetic: its time is bounded by
memory, not the matmul peak. `roofline_s` bounds each forward by the slower of its FLOPs at the
matmul peak and its weights' bytes at the read bandwidth measured in the same run (a streaming
sum; a backward reads them once more), plus the exps below; `distance_to_roofline` = measured /
that.

Attention on this CPU costs its softmax's `exp`s on top of its matmuls: a 100-row prefill of
a tool result scores 63M (query, key) pairs a layer against the shared prefix, and `exp` runs at
~2G a second on the 2 cores (~1.3G over a whole 250 MB score matrix), 30-50 ms a layer that no
matmul speed-up removes. So each figure also counts its exps (one per query, head and key seen;
twice in training, whose backward recomputes them) and a floor that adds their time at the
`exp` rate measured in the same run (`floor_with_exp_s`).
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from cgym.agents.local.kernels import AVX512, cpu_flags
from cgym.agents.local.packed import own_weights
from cgym.agents.local.sampling import LOOKUP_TOKENS
from cgym.agents.options import SamplingOptions
from cgym.benchmarks.output import emit, machine
from cgym.trainer.metrics import peak_rss_gb

ENV_ID = "cgym/ApiReport-v0"
ENV_KWARGS: dict[str, Any] = {"difficulty": "easy"}


class Call(NamedTuple):
    """One counted forward: when it began (`time.perf_counter`), its FLOPs (with its backward's
    in training) and the weight bytes it reads."""

    at: float
    flops: float
    read: float


@dataclass
class FlopCount:
    """FLOPs of the causal-LM forward calls seen, split by whether a backward follows, with each
    call's (FLOPs, weight bytes read) for the roofline."""

    inference: float = 0.0
    training: float = 0.0  # forward + backward (3x the forward with every weight trained; LoRA's: `backward_flops`)
    tokens: dict[str, int] = field(default_factory=lambda: {"inference": 0, "training": 0})
    exps: float = 0.0  # softmax exps of attention: forward, and again in a training backward
    calls: list[Call] = field(default_factory=list)

    @property
    def total(self) -> float:
        return self.inference + self.training

    def roofline_s(self, peak_gflops: float, read_gb_per_s: float) -> float:
        """Each call at the slower of its FLOPs at `peak_gflops` and its weights' bytes at
        `read_gb_per_s`: the least time this work could take here, exps aside."""
        return sum(max(call.flops / (peak_gflops * 1e9), call.read / (read_gb_per_s * 1e9)) for call in self.calls)

    def flops_before(self, moment: float) -> float:
        """FLOPs of the calls that began before `moment` (a step's rollout: those before its end)."""
        return sum(call.flops for call in self.calls if call.at < moment)


@dataclass(frozen=True)
class Weights:
    """A causal LM's weights as the FLOP estimate reads them: the body's (every weight but the
    embedding and the LM head, a packed copy's packed ones too), those of the body that require a
    gradient, and the bytes a forward reads (the body's and the LM head's)."""

    body: int
    trained: int
    head_trained: bool
    bytes: int


def weights(model: Any) -> Weights:
    ends = {id(model.get_input_embeddings()), id(model.get_output_embeddings())}
    body = trained = nbytes = 0
    for module in model.modules():
        if id(module) in ends:
            continue
        own = own_weights(module)  # a packed copy's layers too
        body += own
        trained += sum(p.numel() for p in module.parameters(recurse=False) if p.requires_grad)
        nbytes += own * _element_size(module)
    head = model.get_output_embeddings()  # a packed copy's is a packed layer, holding no parameter
    head_trained = any(p.requires_grad for p in head.parameters(recurse=False))
    return Weights(body, trained, head_trained, nbytes + own_weights(head) * _element_size(head))


def _element_size(module: Any) -> int:
    """Bytes per weight of `module`: its first parameter's, or a packed layer's dtype's."""
    for parameter in module.parameters(recurse=False):
        return parameter.element_size()
    dtype = getattr(module, "dtype", None)
    return torch.empty((), dtype=dtype).element_size() if isinstance(dtype, torch.dtype) else 4


def forward_flops(model: Any, rows: int, new: int, keys: int, head_columns: int, seen: float | None = None, of: Weights | None = None) -> float:
    """Dense FLOPs of one forward: `rows` x `new` tokens, each attending to about `keys` keys
    (`seen`: the keys a query sees on average, where a given mask says; else causal). `of`:
    `weights(model)`, where the caller has it."""
    return rows * 2 * (of or weights(model)).body * new + attention_flops(model, rows, new, keys, seen) + head_flops(model, rows, head_columns)


def attention_flops(model: Any, rows: int, new: int, keys: int, seen: float | None = None) -> float:
    """FLOPs of one forward's attention: scores and weighted values, 4 x hidden per key seen."""
    cfg = model.config
    seen = causal_keys(new, keys) if seen is None else seen
    return rows * 4 * cfg.num_hidden_layers * cfg.hidden_size * new * seen


def head_flops(model: Any, rows: int, head_columns: int) -> float:
    """FLOPs of one forward's LM head over `head_columns` kept positions a row."""
    cfg = model.config
    return rows * 2 * cfg.hidden_size * cfg.vocab_size * head_columns


def backward_flops(model: Any, rows: int, new: int, keys: int, head_columns: int, seen: float | None = None, of: Weights | None = None) -> float:
    """FLOPs of the backward after one training forward: each weight's input gradient (its
    forward's products again), each trained weight's own gradient (again), and attention's
    gradients of queries, keys and values (twice its forward). 2x the forward when every weight
    is trained; with LoRA's frozen base, the forward plus attention once more plus the adapters."""
    w = of or weights(model)
    head = head_flops(model, rows, head_columns)
    return rows * 2 * (w.body + w.trained) * new + 2 * attention_flops(model, rows, new, keys, seen) + head * (2 if w.head_trained else 1)


def causal_keys(new: int, keys: int) -> float:
    """Keys a query of a causal pass sees on average: a prefill's queries see half their own block."""
    return keys - (new - 1) / 2


def forward_exps(model: Any, rows: int, new: int, keys: int, seen: float | None = None) -> float:
    """Softmax exps of one forward's attention: one per query position, head, layer and key seen."""
    cfg = model.config
    return rows * new * cfg.num_attention_heads * cfg.num_hidden_layers * (causal_keys(new, keys) if seen is None else seen)


def keys_seen(mask: Any) -> float | None:
    """Keys a query sees on average under a given (B, 1, q, S) mask (a prefix tree's: each node
    sees the head and its ancestors), or None for a 2D padding mask or none."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        return None
    visible = mask if mask.dtype == torch.bool else mask == 0
    return float(visible.sum()) / (visible.shape[0] * visible.shape[2])


@contextmanager
def counting_flops(model_class: type) -> Iterator[FlopCount]:
    """Count every forward of `model_class` (a causal LM: the trained model, the sampler's bf16
    copy and the eval policy's alike) while the block runs. A forward under autograd is followed
    by a backward (`backward_flops`: which weights get gradients is read from the model).

    A model's weights are read once per block: walking its modules took ~19 ms a call for
    SmolLM2 under LoRA, ~0.9 s of a timed GRPO step's ~290 calls."""
    count = FlopCount()
    original = model_class.forward
    known: dict[int, tuple[Any, Weights]] = {}  # id -> (the model, held so that its id stays its own, its weights)

    # `wraps` keeps the forward's signature visible (inspect follows __wrapped__): the sampler and
    # the loss pass read it to find `logits_to_keep` and the cache argument, and without them they
    # fall back to full-vocabulary heads and unshared prompts, which is not the code being measured.
    @functools.wraps(original)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            rows, new = ids.shape
            mask = kwargs.get("attention_mask")
            past = next((v for v in kwargs.values() if hasattr(v, "get_seq_length")), None)
            keys = new + (int(past.get_seq_length()) if past is not None else 0)
            if mask is not None and mask.dim() == 2:
                keys = mask.shape[-1]
            keep = kwargs.get("logits_to_keep", 0)
            columns = new if isinstance(keep, int) and keep == 0 else (keep if isinstance(keep, int) else len(keep))
            seen = keys_seen(mask)
            if id(self) not in known:
                known[id(self)] = (self, weights(self))
            of = known[id(self)][1]
            flops, read = forward_flops(self, rows, new, keys, columns, seen, of), of.bytes
            training = torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
            if training:
                flops += backward_flops(self, rows, new, keys, columns, seen, of)
                read *= 2  # the backward reads each weight again for its input's gradient
            phase = "training" if training else "inference"
            setattr(count, phase, getattr(count, phase) + flops)
            count.calls.append(Call(time.perf_counter(), flops, read))
            count.exps += forward_exps(self, rows, new, keys, seen) * (2 if training else 1)
            count.tokens[phase] += rows * new
        return original(self, *args, **kwargs)

    model_class.forward = forward
    try:
        yield count
    finally:
        model_class.forward = original


def matmul_peak_gflops(dtype: torch.dtype, *, m: int = 2048, k: int = 576, n: int = 1536, repeats: int = 20) -> float:
    """Best-of GFLOP/s of an (m, k) x (k, n) matmul, SmolLM2's MLP shape, in `dtype`."""
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    for _ in range(3):
        a @ b
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * m * k * n / best / 1e9


def peak_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes whose matmul peak a run reads: fp32, and bf16 where the CPU computes in it or
    emulates it in AVX-512 (~70 GFLOP/s on an Ice Lake). With AVX2 alone a bf16 matmul ran at
    1.3 GFLOP/s, and its two readings took minutes of the run."""
    from cgym.agents.local.precision import compute_dtype

    if compute_dtype() == torch.bfloat16 or AVX512 <= cpu_flags():
        return (torch.bfloat16, torch.float32)
    return (torch.float32,)


def exp_rate_per_s(*, size: int = 8 * 2**20, repeats: int = 10) -> float:
    """Best-of fp32 `exp`s a second, the softmax's dtype in the attention kernels."""
    x, out = torch.rand(size) * -10, torch.empty(size)
    for _ in range(2):
        torch.exp(x, out=out)
    return size / min(_timed(lambda: torch.exp(x, out=out)) for _ in range(repeats))


def read_gb_per_s(*, size: int = 2**28, repeats: int = 5) -> float:
    """Best-of GB/s of a streaming read: summing `size` bytes of bf16 and of fp32 (the larger)."""
    best = 0.0
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.ones(size // torch.empty((), dtype=dtype).element_size(), dtype=dtype)
        x.sum()
        best = max(best, size / min(_timed(x.sum) for _ in range(repeats)) / 1e9)
    return best


def _timed(work: Any) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def figure(seconds: float, count: FlopCount, peak_gflops: float, exps_per_s: float | None = None, read_gb_per_s: float | None = None) -> dict[str, Any]:
    floor = count.total / (peak_gflops * 1e9)
    with_exp: dict[str, Any] = {}
    exp_floor = count.exps / exps_per_s if exps_per_s else 0.0
    if exps_per_s:
        with_exp = {"gexps": round(count.exps / 1e9, 2), "exp_floor_s": round(exp_floor, 2), "floor_with_exp_s": round(floor + exp_floor, 2), "distance_with_exp": round(seconds / (floor + exp_floor), 2)}
    if read_gb_per_s:
        roofline = count.roofline_s(peak_gflops, read_gb_per_s) + exp_floor
        with_exp |= {"roofline_s": round(roofline, 2), "distance_to_roofline": round(seconds / roofline, 2) if roofline else None}
    return {
        "seconds": round(seconds, 2),
        "tflops": round(count.total / 1e12, 3),
        "tflops_inference": round(count.inference / 1e12, 3),
        "tflops_training": round(count.training / 1e12, 3),
        "tokens": dict(count.tokens),
        "floor_s": round(floor, 2),
        "distance": round(seconds / floor, 2) if floor else None,
        "effective_gflops": round(count.total / seconds / 1e9, 1),
        **with_exp,
    }


def phases(row: dict[str, Any], count: FlopCount, peak_gflops: float) -> dict[str, Any]:
    """A step's rollout (the forwards that began before its end) and update (the rest): seconds,
    TFLOPs and share of the matmul peak, from the step's `row`."""
    rollout_s, rollout_flops = row["rollout_time_s"], row["rollout_tflops"] * 1e12
    split = {"rollout": (rollout_s, rollout_flops), "update": (row["step_time_s"] - rollout_s, count.total - rollout_flops)}
    return {
        name: {"seconds": round(seconds, 2), "tflops": round(flops / 1e12, 3), "effective_gflops": round(flops / seconds / 1e9, 1), "of_peak": round(flops / seconds / 1e9 / peak_gflops, 3)}
        for name, (seconds, flops) in split.items()
        if seconds > 0
    }


def grpo_steps(model: str, steps: int, out: Path, draft_tokens: int = LOOKUP_TOKENS, *, lora_r: int = 16, env_kwargs: dict[str, Any] = ENV_KWARGS) -> tuple[list[float], list[FlopCount], list[dict[str, Any]]]:
    """`steps` GRPO steps of 4 tasks x 8 on ApiReport after one warm-up step, the rollouts
    drafting `draft_tokens` ids per step once few rows are left; LoRA rank `lora_r` on every linear
    layer at the training default's rate (0: full fine-tuning at 1e-5)."""
    from cgym.trainer.config import TrainConfig
    from cgym.trainer.grpo import setup, train_step

    rate = {"learning_rate": 1e-5} if lora_r == 0 else {}
    config = TrainConfig(env_id=ENV_ID, env_kwargs=env_kwargs, model=model, out=str(out), group_size=8, tasks_per_step=4, eval_episodes=0, progress=False, lora_r=lora_r, **rate)
    state = setup(config)
    state.policy.draft_tokens = draft_tokens
    base = state.model.get_base_model() if lora_r else state.model  # peft's wrapper calls the base model's forward
    times, counts, rows = [], [], []
    for step in range(1, steps + 2):
        with counting_flops(type(base)) as count:
            start = time.perf_counter()
            row = train_step(state, step)
            elapsed = time.perf_counter() - start
        if step > 1:
            times.append(elapsed)
            counts.append(count)
            row["rollout_tflops"] = count.flops_before(start + row["rollout_time_s"]) / 1e12
            rows.append({k: row[k] for k in ("step_time_s", "rollout_time_s", "rollout_tflops", "train_tokens", "trained_rows", "success_rate", "memory/peak_after_sampling_gb", "memory/peak_gb") if k in row})
    return times, counts, rows


def greedy_eval(model: str, episodes: int, draft_tokens: int, env_kwargs: dict[str, Any] = ENV_KWARGS) -> tuple[float, FlopCount, float]:
    from cgym.agents.eval.evaluate import EvalConfig, evaluate
    from cgym.agents.local.hf import HFPolicy
    from cgym.trainer.grpo import EVAL_SEED

    policy = HFPolicy.from_pretrained(model, draft_tokens=draft_tokens, sampling=SamplingOptions(temperature=0.0), inference_only=True)  # as `cgym eval` loads it
    with counting_flops(type(policy.model)) as count:
        start = time.perf_counter()
        summary, _ = evaluate(policy, EvalConfig(ENV_ID, {**env_kwargs, "split": "test"}, episodes=episodes, seed=EVAL_SEED))  # cgym eval's batch size
        elapsed = time.perf_counter() - start
    return elapsed, count, summary["success_rate"]


def run(model: str, *, steps: int, episodes: int, draft_tokens: int = LOOKUP_TOKENS, lora_r: int = 16, difficulty: str = "easy") -> dict[str, Any]:
    from cgym.agents.local.allocator import keep_freed_memory
    from cgym.agents.local.precision import compute_dtype
    from cgym.trainer.embedded import prepare_models

    prepare_models(model)
    load = round(os.getloadavg()[0], 2)
    before = {d: matmul_peak_gflops(d) for d in peak_dtypes()}
    exps_before = exp_rate_per_s()
    read_before = read_gb_per_s()
    env_kwargs = {**ENV_KWARGS, "difficulty": difficulty}
    eval_s, eval_count, success, eval_rss = 0.0, FlopCount(), None, None
    if episodes:
        eval_s, eval_count, success = greedy_eval(model, episodes, draft_tokens, env_kwargs)
        eval_rss = peak_rss_gb()
    times, counts, rows = [], [], []
    if steps:
        with tempfile.TemporaryDirectory(prefix="cgym-floors-") as tmp:
            times, counts, rows = grpo_steps(model, steps, Path(tmp), draft_tokens, lora_r=lora_r, env_kwargs=env_kwargs)
    # the best of a measurement before and after the work: one taken first in a process once read 194 GFLOP/s against ~405
    after = {d: matmul_peak_gflops(d) for d in before}
    peaks = {str(d).removeprefix("torch."): round(max(best, after[d]), 1) for d, best in before.items()}
    # both, to show the host's drift over the run (a 2-core VM's fp32 peak moved 236-371 between runs)
    drift = {str(d).removeprefix("torch."): [round(best, 1), round(after[d], 1)] for d, best in before.items()}
    peak = peaks[str(compute_dtype()).removeprefix("torch.")]
    exps_per_s = max(exps_before, exp_rate_per_s())
    read = max(read_before, read_gb_per_s())
    median = sorted(range(len(times)), key=times.__getitem__)[len(times) // 2] if times else None
    result: dict[str, Any] = {
        "machine": machine(),  # the floors were set on one kind of machine: a figure says which it came from
        "model": model,
        "env": ENV_ID,
        "env_kwargs": env_kwargs,
        "lora_r": lora_r,
        "threads": torch.get_num_threads(),
        "compute_dtype": str(compute_dtype()).removeprefix("torch."),
        "matmul_peak_gflops": peaks,
        "matmul_peak_before_after_gflops": drift,
        "exp_rate_g_per_s": round(exps_per_s / 1e9, 2),
        "read_gb_per_s": round(read, 1),
        "draft_tokens": draft_tokens,
        "peak_rss_gb_after_eval": eval_rss,  # the process's high-water mark: run --steps 0 or --episodes 0 to see one phase alone
        "load_avg_1min": {"start": load},
    }
    if episodes:
        result["eval"] = {"episodes": episodes, "success_rate": success, **figure(eval_s, eval_count, peak, exps_per_s, read)}
    if median is not None:
        result["grpo_step"] = {
            "tasks_x_group": "4 x 8",
            "steps_timed": len(times),
            "steps_s": [round(t, 2) for t in times],
            "rows": rows,
            **figure(times[median], counts[median], peak, exps_per_s, read),
            "phases": phases(rows[median], counts[median], peak),
        }
    result["load_avg_1min"]["end"] = round(os.getloadavg()[0], 2)
    result["peak_rss_gb"] = peak_rss_gb()
    result["malloc_keeps_freed_memory"] = keep_freed_memory()
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="an SFT'd model directory (or a short name)")
    parser.add_argument("--steps", type=int, default=3, help="timed GRPO steps, after one warm-up step (0: the eval alone)")
    parser.add_argument("--episodes", type=int, default=100, help="greedy eval episodes (0: the GRPO steps alone)")
    parser.add_argument("--lora-r", type=int, default=16, help="LoRA rank of the GRPO steps, the training default (0: full fine-tuning)")
    parser.add_argument("--difficulty", default="easy", choices=["easy", "medium", "hard"], help="ApiReport difficulty")
    parser.add_argument("--draft-tokens", type=int, default=LOOKUP_TOKENS, help="prompt-lookup drafts per step, in the greedy eval and the GRPO rollouts (0: off)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    from cgym import envs  # noqa: F401 - registers the built-in envs

    if args.steps < 0 or args.episodes < 0 or args.lora_r < 0 or not (args.steps or args.episodes):
        parser.error("--steps, --episodes and --lora-r take counts >= 0, and one of --steps and --episodes must be > 0")
    emit(run(args.model, steps=args.steps, episodes=args.episodes, draft_tokens=args.draft_tokens, lora_r=args.lora_r, difficulty=args.difficulty), args.json)


if __name__ == "__main__":
    main()
