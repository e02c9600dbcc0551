"""Time per GRPO step: our trainer vs TRL's `GRPOTrainer`, same model, task and batch, one process.

Usage: python -m cgym.benchmarks.trainer_vs_trl --steps 5 --json out.json (also `cgym bench trainer
--vs trl`). Needs the optional `bench` extra (`pip install 'critique-gym[bench]'`: trl, datasets).

Both sides train a copy of the same tiny model (built here, or `--model DIR`) on single-turn
`cgym/SqlQuery-v0` (easy, `max_turns=1`): the same tasks in the same order, the same prompt ids,
the env's reward, the same group size, tasks per step, max new tokens (both stop at `<|im_end|>`),
loss type, learning rate, AdamW, rows per forward/backward pass (`--micro-batch`; default the whole
batch), beta 0, fp32, CPU.
They alternate in one process: TRL step k, then our step k (run from a TRL callback), so machine
noise hits both. What is timed, per optimizer step:
- ours: `trainer.grpo.train_step` (rollout with generation and env rewards, advantages,
  forward/backward, clipping, optimizer step, step metrics);
- TRL: `on_step_begin` to `on_step_end` (generation, reward function, advantages,
  forward/backward, clipping, optimizer and scheduler step); its dataloader fetch before and
  logging after are outside the window (logging is off).
The first step of each side is a warm-up and not counted; medians of the rest are reported.
Differences left, by design of each trainer: TRL gets the prompts as pre-rendered text (its
chat path renders only callable tools, which it would then execute); its `generate` keeps
finished rows in the batch; it computes token entropies in the loss pass; ours makes a fresh
env per episode. With a random-init model nearly every completion runs to max new tokens.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from cgym.agents.local.precision import compute_dtype
from cgym.agents.pretrained import resolve_model
from cgym.benchmarks.output import emit
from cgym.envs.registration import make
from cgym.trainer.embedded import TINY_SIZES
from cgym.trainer.losses import LossType, check_loss_type
from cgym.trainer.metrics import peak_rss_gb

ENV_ID = "cgym/SqlQuery-v0"
ENV_KWARGS: dict[str, Any] = {"difficulty": "easy", "max_turns": 1}
WARMUP_STEPS = 1


@dataclass(frozen=True)
class BenchConfig:
    """What both trainers share. Every field is fixed once parsed."""

    group_size: int = 8
    """Completions per prompt (GRPO's n; TRL's num_generations)."""
    tasks_per_step: int = 2
    """Prompts per optimizer step."""
    max_new_tokens: int = 64
    """Tokens per completion (TRL's max_completion_length)."""
    loss_type: LossType = "dapo"
    """Loss aggregation, a type both trainers implement."""
    learning_rate: float = 2e-4
    """Constant AdamW learning rate."""
    micro_batch: int = 0
    """Rows per forward/backward pass on both sides (0: the whole batch in one pass). TRL gets it as
    `per_device_train_batch_size` with `gradient_accumulation_steps` making up the batch (one
    generation per optimizer step either way); ours as `micro_batch_size` (which also caps rows by
    their length). SmolLM2 with LoRA and 16 rows of ~540 tokens a pass, in fp32, was OOM-killed at 24.4 GB."""
    lora_r: int = 0
    """0: every weight trains on both sides; R: LoRA rank R on every linear layer (alpha 2R) on
    both, ours through `--lora-r`, TRL's through `peft_config`."""
    model: str | None = None
    """A model directory to start from; None builds the embedded tiny model (random init)."""
    sizes: dict[str, int] = field(default_factory=lambda: dict(TINY_SIZES))
    """`build_tiny` sizes when the model is built here."""
    demo_episodes: int = 200
    """SQL demonstrations whose text trains the tiny tokenizer (plus a quarter as many API ones)."""
    threads: int = 2
    """torch CPU threads, for both."""
    trl_bf16: bool = False
    """Give TRL its `bf16=True` (autocast on CPU); ours runs bf16 where the CPU has it either way."""
    seed: int = 0
    """Seeds the task draw, sampling and TRL's trainer."""
    every_row: bool = True
    """Our loss pass runs every row, as TRL's does. Training skips rows whose every token has
    advantage 0 (a group that all passed or all failed): with a start that fails (or passes)
    every task, that skips our whole loss pass while TRL still runs its, and the ratio compares
    different work. False times ours as it trains."""

    def __post_init__(self) -> None:
        check_loss_type(self.loss_type)
        if self.group_size < 2 or self.tasks_per_step < 1 or self.max_new_tokens < 1:
            raise ValueError("need group_size >= 2, tasks_per_step >= 1 and max_new_tokens >= 1")
        if self.micro_batch < 0 or (self.micro_batch and self.batch % self.micro_batch):
            raise ValueError(f"micro_batch must divide the batch of {self.batch} rows (or be 0: the whole batch), got {self.micro_batch}")

    @property
    def batch(self) -> int:
        return self.group_size * self.tasks_per_step

    @property
    def rows_per_pass(self) -> int:
        return self.micro_batch or self.batch


# -- shared inputs --------------------------------------------------------------------------------
def build_model(out: Path, config: BenchConfig) -> Path:
    """The embedded tiny model (random init), tokenizer trained on SQL and API transcripts."""
    from cgym.agents.demos import corpus, demonstrations
    from cgym.trainer.tiny import build_tiny

    demos = demonstrations(ENV_ID, {"difficulty": "easy"}, episodes=config.demo_episodes, seed=config.seed)
    demos += demonstrations("cgym/ApiReport-v0", {"difficulty": "easy"}, episodes=max(config.demo_episodes // 4, 1), seed=config.seed)
    return build_tiny(out, corpus(demos), seed=config.seed, **config.sizes)


def task_seeds(config: BenchConfig, steps: int) -> list[int]:
    """The task seeds `train_step` draws at steps 1..steps, in order (checked after the run)."""
    seeds: list[int] = []
    for step in range(1, steps + 1):
        rng = np.random.default_rng([config.seed, step])
        seeds += [int(s) for s in rng.integers(0, 2**31 - 1, config.tasks_per_step)]
    return seeds


def train_env(split: str = "train") -> gym.Env:
    return make(ENV_ID, **{**ENV_KWARGS, "split": split})


class SeedLog(gym.Wrapper):
    """Records every reset seed, to check that both trainers saw the same tasks."""

    def __init__(self, env: gym.Env, seen: list[int | None]) -> None:
        super().__init__(env)
        self.seen = seen

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        self.seen.append(seed)
        return self.env.reset(seed=seed, options=options)


def prompt_rows(seeds: list[int], tokenizer: Any) -> list[dict[str, Any]]:
    """One dataset row per task: the chat template's text for the env's opening messages and tools.

    TRL renders conversational prompts with its own `tools` (callables it then executes in a
    tool loop), so the prompt goes in pre-rendered, exactly as our ledger renders it.
    """
    from cgym.agents.ledger import ChatEncoder

    encoder, env, rows = ChatEncoder(tokenizer), train_env(), []
    for seed in seeds:
        _, info = env.reset(seed=seed)
        rows.append({"prompt": encoder.render(info["messages"], info["tools"], generation_prompt=True), "seed": seed})
    env.close()
    return rows


def same_prompt_ids(rows: list[dict[str, Any]], tokenizer: Any) -> bool:
    """Our ledger's prompt ids equal the ids TRL gets from `processing_class(text=prompts)`."""
    from cgym.agents.ledger import ChatEncoder

    encoder = ChatEncoder(tokenizer)
    texts = [r["prompt"] for r in rows]
    return tokenizer(text=texts)["input_ids"] == [encoder.encode_text(t) for t in texts]


def env_reward(tokens: list[int]) -> Callable[..., list[float]]:
    """TRL reward function: replay each completion as the single turn of its row's env episode.

    Appends the number of completion tokens of every call to `tokens`.
    """
    env = train_env()

    def sql_env_reward(completions: list[str], completion_ids: list[list[int]], seed: list[int], **_: Any) -> list[float]:
        tokens.append(sum(len(ids) for ids in completion_ids))
        rewards = []
        for text, s in zip(completions, seed, strict=True):
            env.reset(seed=s)
            rewards.append(float(env.step(text)[1]))
        return rewards

    return sql_env_reward


# -- the two trainers -------------------------------------------------------------------------
def our_state(config: BenchConfig, model_dir: Path, out: Path, seen: list[int | None]) -> Any:
    from cgym.agents.options import SamplingOptions
    from cgym.trainer.config import TrainConfig
    from cgym.trainer.grpo import setup

    train_config = TrainConfig(
        env_id=ENV_ID, env_kwargs=ENV_KWARGS, model=str(model_dir), out=str(out),
        group_size=config.group_size, tasks_per_step=config.tasks_per_step,
        sampling=SamplingOptions(temperature=1.0, top_p=1.0, max_new_tokens=config.max_new_tokens), loss_type=config.loss_type,
        learning_rate=config.learning_rate, micro_batch_size=config.rows_per_pass, beta=0.0, num_iterations=1, seed=config.seed, progress=False, lora_r=config.lora_r,  # as TRL's side
    )  # fmt: skip
    return setup(train_config, make_env=lambda split: SeedLog(train_env(split), seen))


def trl_trainer(config: BenchConfig, model_dir: Path, out: Path, rows: list[dict[str, Any]], reward: Callable[..., list[float]], callback: Any) -> Any:
    """TRL's GRPOTrainer with our settings; one optimizer step = tasks_per_step x group_size."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(out), max_steps=len(rows) // config.tasks_per_step,
        per_device_train_batch_size=config.rows_per_pass, gradient_accumulation_steps=config.batch // config.rows_per_pass,
        num_generations=config.group_size, max_completion_length=config.max_new_tokens,
        loss_type=config.loss_type, beta=0.0, num_iterations=1, epsilon=0.2, scale_rewards="group",
        learning_rate=config.learning_rate, lr_scheduler_type="constant", warmup_steps=0,
        optim="adamw_torch", weight_decay=0.0, max_grad_norm=1.0,
        temperature=1.0, top_p=1.0, top_k=0, shuffle_dataset=False, seed=config.seed,
        use_cpu=True, bf16=config.trl_bf16, fp16=False, gradient_checkpointing=False,
        report_to=[], logging_strategy="no", save_strategy="no", eval_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    from cgym.agents.local.lora import lora_config

    trainer = GRPOTrainer(
        model=model, reward_funcs=[reward], args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer, callbacks=[callback],
        peft_config=lora_config(config.lora_r) if config.lora_r else None,  # the same adapters as ours
    )
    trainer.remove_callback(PrinterCallback)  # its end-of-training summary would go to stdout
    return trainer


def alternate(ours: Any) -> Any:
    """A TRL callback that times each TRL optimizer step, then runs and times one of ours."""
    from cgym.trainer.grpo import train_step
    from transformers import TrainerCallback

    class Alternate(TrainerCallback):
        def __init__(self) -> None:
            self.trl_s: list[float] = []
            self.ours_s: list[float] = []
            self.ours_tokens: list[int] = []
            self.ours_rollout_s: list[float] = []
            self.ours_trained_rows: list[int] = []
            self._began = 0.0

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self._began = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.trl_s.append(time.perf_counter() - self._began)
            began = time.perf_counter()
            row = train_step(ours, state.global_step)
            self.ours_s.append(time.perf_counter() - began)
            self.ours_tokens.append(int(row["tokens/initial"]))
            self.ours_rollout_s.append(float(row["rollout_time_s"]))
            self.ours_trained_rows.append(int(row.get("trained_rows", 0)))

    return Alternate()


# -- the run ----------------------------------------------------------------------------------
@contextmanager
def every_row_trained(on: bool) -> Iterator[None]:
    """Within the block (when `on`), our GRPO update runs its loss pass on every row, as TRL does,
    instead of only the rows with a nonzero advantage (`rollout.rows_with_signal`)."""
    import cgym.trainer.grpo as grpo

    chosen = grpo.rows_with_signal
    if on:
        grpo.rows_with_signal = lambda batch, *, with_kl=False: chosen(batch, with_kl=True)  # its every-row branch
    try:
        yield
    finally:
        grpo.rows_with_signal = chosen


def run(*, vs: str = "trl", steps: int = 5, **kw: Any) -> dict[str, Any]:
    """Median seconds per GRPO step for ours and TRL, alternating, after one warm-up step each.

    `kw` are `BenchConfig` fields. Returns at least `ours_step_s`, `trl_step_s` and `ratio`
    (ours / TRL; below 1 means ours is faster). On a busy machine also read `paired_ratio` (median
    of step-by-step ratios, each pair run back to back) and `min_ratio` (fastest steps).
    """
    if vs != "trl":
        raise ValueError(f"vs={vs!r}: only 'trl' is supported")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if kw.get("lora_r", 0) < 0:
        raise ValueError(f"lora_r must be >= 0, got {kw['lora_r']}")
    try:
        import trl  # noqa: F401
    except ImportError as exc:
        raise ImportError("the trainer benchmark needs TRL: pip install 'critique-gym[bench]'") from exc
    config = BenchConfig(**kw)
    torch.set_num_threads(config.threads)
    load_start = round(os.getloadavg()[0], 2)
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="cgym-bench-trl-") as tmp:
        root = Path(tmp)
        model_dir = Path(resolve_model(config.model)) if config.model else build_model(root / "model", config)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        seeds = task_seeds(config, steps + WARMUP_STEPS)
        rows = prompt_rows(seeds, tokenizer)
        seen: list[int | None] = []
        trl_tokens: list[int] = []
        callback = alternate(our_state(config, model_dir, root / "ours", seen))
        trainer = trl_trainer(config, model_dir, root / "trl", rows, env_reward(trl_tokens), callback)
        with every_row_trained(config.every_row):
            trainer.train()
    ours_s, trl_s = callback.ours_s[WARMUP_STEPS:], callback.trl_s[WARMUP_STEPS:]
    ours, theirs = statistics.median(ours_s), statistics.median(trl_s)
    return {
        "ours_step_s": round(ours, 4),
        "trl_step_s": round(theirs, 4),
        "ratio": round(ours / theirs, 4),
        "speedup": round(theirs / ours, 3),
        "paired_ratio": round(statistics.median(o / t for o, t in zip(ours_s, trl_s)), 4),
        "min_ratio": round(min(ours_s) / min(trl_s), 4),
        "steps": steps,
        "warmup_steps": WARMUP_STEPS,
        "ours_steps_s": [round(s, 4) for s in ours_s],
        "trl_steps_s": [round(s, 4) for s in trl_s],
        "ours_rollout_s": round(statistics.median(callback.ours_rollout_s[WARMUP_STEPS:]), 4),
        "ours_tokens_per_step": statistics.mean(callback.ours_tokens[WARMUP_STEPS:]),
        "ours_trained_rows": callback.ours_trained_rows[WARMUP_STEPS:],  # of config.batch a step: fewer where flat rows were skipped
        "trl_tokens_per_step": statistics.mean(trl_tokens[WARMUP_STEPS:]),
        "prompt_tokens_mean": round(statistics.mean(len(tokenizer.encode(r["prompt"], add_special_tokens=False)) for r in rows), 1),
        "same_prompt_ids": same_prompt_ids(rows, tokenizer),
        "same_tasks": seen == [s for s in seeds for _ in range(config.group_size)],
        "env": ENV_ID,
        "env_kwargs": ENV_KWARGS,
        "config": {**asdict(config), "model": config.model or "embedded tiny (random init)"},
        "torch_threads": torch.get_num_threads(),
        "ours_dtype": f"{str(compute_dtype()).removeprefix('torch.')} sampling and autocast, fp32 master weights",
        "trl_dtype": "bf16 autocast, fp32 master weights" if config.trl_bf16 else "float32",
        "load_avg_1min": {"start": load_start, "end": round(os.getloadavg()[0], 2)},
        "peak_rss_gb": peak_rss_gb(),  # both trainers in one process: their models, optimizers and largest passes
        "versions": {name: importlib.metadata.version(name) for name in ("trl", "transformers", "torch")},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per trainer (after one warm-up)")
    parser.add_argument("--model", help="start from this model (a directory or a short name such as smollm2-135m) instead of a random-init tiny one")
    parser.add_argument("--group-size", type=int, default=BenchConfig.group_size)
    parser.add_argument("--tasks-per-step", type=int, default=BenchConfig.tasks_per_step)
    parser.add_argument("--max-new-tokens", type=int, default=BenchConfig.max_new_tokens)
    parser.add_argument("--loss-type", default=BenchConfig.loss_type)
    parser.add_argument("--threads", type=int, default=BenchConfig.threads, help="torch CPU threads for both")
    parser.add_argument("--trl-bf16", action="store_true", help="give TRL its bf16 option (autocast on CPU)")
    parser.add_argument("--lora-r", type=int, default=0, help="LoRA rank on both sides, every linear layer (0: every weight trains)")
    parser.add_argument("--micro-batch", type=int, default=0, help="rows per forward/backward pass on both sides (0: the whole batch)")
    parser.add_argument("--skip-flat-rows", action="store_true", help="ours skips rows with no advantage, as training does (TRL runs them: not the same work)")
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args(argv)
    from cgym import envs  # noqa: F401 - registers the built-in envs

    result = run(
        steps=args.steps, model=args.model, group_size=args.group_size, tasks_per_step=args.tasks_per_step,
        max_new_tokens=args.max_new_tokens, loss_type=args.loss_type, threads=args.threads,
        trl_bf16=args.trl_bf16, lora_r=args.lora_r, micro_batch=args.micro_batch, every_row=not args.skip_flat_rows,
    )  # fmt: skip
    emit(result, args.json)


if __name__ == "__main__":
    main()
