"""GRPO and Critique-GRPO for multi-turn, tool-using policies, readable top to bottom.

One step: rollout (tasks x group, batched, token-exact) -> rewards (the env's rubric) ->
Critique-GRPO refinements for failed groups -> advantages (one baseline per group) ->
update epochs over micro-batches -> log. See `trainer.losses` for the math.
"""

from __future__ import annotations

import copy
import json
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from rich.console import Console

from agents.critics import run_refinements
from agents.episodes import run_episodes
from agents.evaluate import EvalConfig, evaluate
from agents.hf import HFPolicy
from agents.precision import autocast
from agents.sampling import sequence_logprobs
from envs.registration import make
from trainer.checkpoint import latest_checkpoint, load_state, save_checkpoint
from trainer.config import TrainConfig
from trainer.finite import check_finite
from trainer.losses import policy_loss, token_normalizer, unified_advantages
from trainer.metrics import HackingMonitor, MetricsLog, plot_curve, rollout_metrics
from trainer.refine import rebase, sample_subset, select_refinements, should_refine
from trainer.rollout import Trajectory, pack, slice_batch

EnvFactory = Callable[[str], gym.Env]  # split -> env
EVAL_SEED = 10_000


@dataclass
class TrainState:
    """What the loop carries between steps (built once in `setup`)."""

    config: TrainConfig
    policy: HFPolicy
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    make_env: EnvFactory
    reference: torch.nn.Module | None
    critic: Any
    log: MetricsLog
    monitor: HackingMonitor
    max_completion_length: int
    start_step: int = 0
    pool: list[gym.Env] = field(default_factory=list)  # train-split envs reused across steps

    @property
    def model(self) -> torch.nn.Module:
        return self.policy.model


def setup(config: TrainConfig, *, make_env: EnvFactory | None = None, resume: bool = False) -> TrainState:
    """Load the model (or the latest checkpoint), optimizer, scheduler, reference and critic."""
    out = Path(config.out)
    checkpoint = latest_checkpoint(out) if resume else None
    if resume and checkpoint is None:
        warnings.warn(f"resume: no checkpoint under {out / 'checkpoints'} yet; starting from step 0", stacklevel=2)
    torch.manual_seed(config.seed)
    policy = HFPolicy.from_pretrained(checkpoint or config.model_path, temperature=config.temperature, top_p=config.top_p, max_new_tokens=config.max_new_tokens, seed=config.seed)
    if config.lora_r > 0:
        policy.model = _with_lora(policy.model, config.lora_r)
    freeze_except(policy.model, config.trainable)
    params = [p for p in policy.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=config.weight_decay)
    warmup = max(config.warmup_steps, 1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    start = load_state(checkpoint, optimizer=optimizer, scheduler=scheduler) if checkpoint else 0
    rewind_metrics(out / "metrics.jsonl", start)
    factory = make_env or (lambda split: make(config.env_id, **{**config.env_kwargs, "split": split}))
    probe = factory("train")
    max_turns = int(getattr(probe.unwrapped, "max_turns", 1))
    probe.close()
    reference = copy.deepcopy(policy.model).eval().requires_grad_(False) if config.beta > 0 else None
    return TrainState(config, policy, optimizer, scheduler, factory, reference, _critic(config), MetricsLog(out / "metrics.jsonl"), HackingMonitor(), config.max_new_tokens * max_turns, start)


def rewind_metrics(path: Path, step: int) -> None:
    """Keep the metrics rows up to `step` (none at 0), so the steps a resume re-runs are logged once.

    A row torn by a crash mid-write is dropped with the rest of the tail.
    """
    if step == 0 or not path.exists():
        path.unlink(missing_ok=True)
        return
    kept: list[str] = []
    for line in filter(str.strip, path.read_text().splitlines()):
        try:
            row = json.loads(line)
        except ValueError:
            break
        if row.get("step", 0) <= step:
            kept.append(line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    tmp.replace(path)


def _critic(config: TrainConfig) -> Any:
    if not config.critique.startswith("model:"):
        return None
    from agents.critics import ModelCritic
    from agents.spec import load_policy

    return ModelCritic(load_policy(config.critique.removeprefix("model:")))


def freeze_except(model: torch.nn.Module, trainable: str) -> None:
    """Stop gradients to every weight outside `trainable` (see TrainConfig.trainable)."""
    if trainable == "all":
        return
    for name, param in model.named_parameters():
        if trainable == "attention" and "self_attn" not in name:
            param.requires_grad_(False)
        elif trainable == "no_embeddings" and ("embed_tokens" in name or "lm_head" in name):
            param.requires_grad_(False)


def _with_lora(model: torch.nn.Module, rank: int) -> torch.nn.Module:
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise ImportError("lora_r > 0 needs peft: pip install 'critique-gym[lora]'") from exc
    return get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", task_type="CAUSAL_LM"))


# -- one step ---------------------------------------------------------------------------------
def train_step(state: TrainState, step: int) -> dict[str, Any]:
    cfg = state.config
    started = time.perf_counter()
    rng = np.random.default_rng([cfg.seed, step])  # tasks and selection depend only on (seed, step)
    state.policy.generator.manual_seed(cfg.seed * 1_000_003 + step)

    # 1. rollout: every task's group samples together, in one batch
    state.model.eval()
    trajectories = _rollout_groups(state, rng)
    rollout_s = time.perf_counter() - started
    metrics = rollout_metrics(trajectories, cfg.group_size)

    # 2. Critique-GRPO: refine the groups where (nearly) every attempt failed
    refined, refine_metrics = _refine(state, trajectories, rng) if cfg.critique != "none" else ([], {})
    batch_trajs = trajectories + refined

    # 3. advantages: one baseline per group over initial + refined rewards
    rewards = torch.tensor([t.reward for t in batch_trajs])
    groups = torch.tensor([t.group for t in batch_trajs])
    advantages = unified_advantages(rewards, groups, cfg.scale)
    keep = _keep_rows(batch_trajs, rewards, groups, cfg)
    batch_trajs = [t for t, k in zip(batch_trajs, keep) if k]
    advantages = advantages[torch.tensor(keep, dtype=torch.bool)]

    # 4. update: num_iterations passes over micro-batches, one optimizer step per pass
    update = _update(state, batch_trajs, advantages, step) if batch_trajs else {"loss": 0.0}
    elapsed = time.perf_counter() - started
    sampled = sum(t.sampled_tokens for t in trajectories + refined)

    # 5. log
    row = {"step": step, **metrics, **refine_metrics, **update}
    row.update(tokens_per_s=sampled / max(rollout_s, 1e-9), step_time_s=elapsed, rollout_time_s=rollout_s, lr=state.scheduler.get_last_lr()[0])
    row["tokens/initial"] = sum(t.sampled_tokens for t in trajectories)
    row["tokens/refined"] = sum(t.sampled_tokens for t in refined)
    warning = state.monitor.update(metrics["hacking/top_quartile_failed"], metrics["hacking/failed_outscoring"])
    if warning:
        row["hacking/warning"] = warning
    return row


def _rollout_groups(state: TrainState, rng: np.random.Generator) -> list[Trajectory]:
    cfg = state.config
    task_seeds = _draw_tasks(cfg, rng, cfg.tasks_per_step)
    trajectories = _play(state, task_seeds, group_offset=0)
    if cfg.zero_std == "resample":
        flat = [i for i in range(cfg.tasks_per_step) if len({t.reward for t in trajectories[i * cfg.group_size : (i + 1) * cfg.group_size]}) == 1]
        if flat:  # one more draw for the groups that taught nothing
            fresh = _draw_tasks(cfg, rng, len(flat))
            redo = _play(state, fresh, group_offset=0)
            for slot, i in enumerate(flat):
                group = redo[slot * cfg.group_size : (slot + 1) * cfg.group_size]
                for t in group:
                    t.group = i
                trajectories[i * cfg.group_size : (i + 1) * cfg.group_size] = group
    return trajectories


def _draw_tasks(cfg: TrainConfig, rng: np.random.Generator, n: int) -> list[int]:
    """Env seeds of `n` tasks: anywhere in the train split, or from the first `task_pool` seeds."""
    if cfg.task_pool:
        return [int(s) for s in rng.integers(0, cfg.task_pool, n)]
    return [int(s) for s in rng.integers(0, 2**31 - 1, n)]


def _play(state: TrainState, task_seeds: list[int], group_offset: int) -> list[Trajectory]:
    g = state.config.group_size
    seeds = [s for s in task_seeds for _ in range(g)]
    results = run_episodes(lambda: state.make_env("train"), state.policy, seeds, batch_size=len(seeds), pool=state.pool)
    return [Trajectory.from_result(r, group_offset + i // g) for i, r in enumerate(results)]


def _refine(state: TrainState, trajectories: list[Trajectory], rng: np.random.Generator) -> tuple[list[Trajectory], dict[str, Any]]:
    cfg = state.config
    by_group = [trajectories[i : i + cfg.group_size] for i in range(0, len(trajectories), cfg.group_size)]
    triggered = [grp for grp in by_group if should_refine(grp, cfg.refine_fail_fraction)]
    failed = [t for grp in triggered for t in sample_subset([t for t in grp if not t.success], cfg.refine_attempts, rng)]
    critiques = _critiques(state, failed)
    todo = [(t, c) for t, c in zip(failed, critiques) if c]
    kept: list[Trajectory] = []
    successes = 0
    if todo:
        results = run_refinements(lambda: state.make_env("train"), state.policy, [(t.result, c) for t, c in todo], pool=state.pool)
        refined = [Trajectory.from_result(r, t.group, refined=True) for r, (t, _) in zip(results, todo)]
        successes = sum(t.success for t in refined)
        prompts = {t.group: t.ids[: t.result.conversation.prompt_len] for grp in triggered for t in grp}
        for group in sorted({t.group for t in refined}):
            chosen = select_refinements([t for t in refined if t.group == group], cfg.refine_k, rng)
            kept += [rebase(t, prompts[group]) for t in chosen]
    rescued = len({t.group for t in kept if t.success})
    return kept, {
        "refine/trigger_rate": len(triggered) / max(len(by_group), 1),
        "refine/attempts": len(todo),
        "refine/success_rate": successes / len(todo) if todo else 0.0,
        "refine/rescued_groups": rescued,
        "refine/kept": len(kept),
    }


def _critiques(state: TrainState, failed: list[Trajectory]) -> list[str | None]:
    style = state.config.critique
    if state.critic is not None:
        return state.critic.critique([t.result for t in failed])
    return [t.result.critique(style) for t in failed]  # type: ignore[arg-type]


def _keep_rows(trajs: list[Trajectory], rewards: torch.Tensor, groups: torch.Tensor, cfg: TrainConfig) -> list[bool]:
    keep = [True] * len(trajs)
    if cfg.zero_std == "drop":
        flat = {int(g) for g in torch.unique(groups) if rewards[groups == g].std(unbiased=False) == 0}
        keep = [t.group not in flat for t in trajs]
    if cfg.mask_truncated:
        keep = [k and not t.truncated for k, t in zip(keep, trajs)]
    return keep


def _update(state: TrainState, trajs: list[Trajectory], advantages: torch.Tensor, step: int) -> dict[str, Any]:
    cfg = state.config
    state.model.train()
    pad = state.policy.tokenizer.pad_token_id or 0
    batch = pack(trajs, advantages, pad_id=pad)
    normalizer = token_normalizer(batch.mask, cfg.loss_type, state.max_completion_length)
    totals: dict[str, float] = {"loss": 0.0, "clip_frac_low": 0.0, "clip_frac_high": 0.0, "kl": 0.0, "sampler/logp_diff_max": 0.0}
    # A bf16 sampler's log-probs differ from the training pass's by up to ~0.2 nats (measured on
    # SmolLM2), which the clip would treat as policy change: then the old log-probs are the
    # training pass's own, so the first iteration's ratio is exactly 1.
    own_old = state.policy.sampling_weights.separate
    fixed_old: dict[int, torch.Tensor] = {}
    n_micro = 0
    for iteration in range(cfg.num_iterations):
        for start in range(0, len(trajs), cfg.micro_batch_size):
            mb = slice_batch(batch, slice(start, start + cfg.micro_batch_size))
            with autocast(state.model):  # logits only at sampled positions; log-softmax in fp32
                logp = sequence_logprobs(state.model, mb.ids, mb.attention, cfg.temperature, mask=mb.mask)
                ref = None
                if state.reference is not None:
                    with torch.no_grad():
                        ref = sequence_logprobs(state.reference, mb.ids, mb.attention, cfg.temperature, mask=mb.mask)
            old = mb.old_logp
            if own_old:
                if iteration == 0:
                    fixed_old[start] = logp.detach()
                    sampled = mb.mask.bool() & ~mb.shaped[:, None]  # a refinement was sampled under another prompt
                    if sampled.any():
                        totals["sampler/logp_diff_max"] = max(totals["sampler/logp_diff_max"], float((logp.detach() - mb.old_logp)[sampled].abs().max()))
                old = fixed_old[start]
            loss, stats = policy_loss(
                logp, old, mb.advantages, mb.mask,
                loss_type=cfg.loss_type, epsilon_low=cfg.epsilon_low, epsilon_high=cfg.epsilon_high,
                max_completion_length=state.max_completion_length, ref_logp=ref, beta=cfg.beta,
                shaped=mb.shaped if cfg.shaping else None, gamma=cfg.gamma, normalizer=normalizer,
            )  # fmt: skip
            check_finite("loss", loss.detach(), step=step)
            loss.backward()
            totals["loss"] += loss.item()
            for key in ("clip_frac_low", "clip_frac_high", "kl"):
                totals[key] += float(stats[key])
            n_micro += 1
        grad_norm = torch.nn.utils.clip_grad_norm_(state.model.parameters(), cfg.max_grad_norm)
        check_finite("gradient norm", grad_norm, step=step)
        state.optimizer.step()
        state.scheduler.step()
        state.optimizer.zero_grad(set_to_none=True)
    sampled = batch.mask.bool()
    return {
        "loss": totals["loss"] / cfg.num_iterations,
        "clip_frac_low": totals["clip_frac_low"] / n_micro,
        "clip_frac_high": totals["clip_frac_high"] / n_micro,
        "kl": totals["kl"] / n_micro,
        "sampler/logp_diff_max": totals["sampler/logp_diff_max"],
        "entropy": float(-batch.old_logp[sampled].mean()) if sampled.any() else 0.0,
        "grad_norm": float(grad_norm),
        "train_tokens": int(sampled.sum()),
    }


# -- evaluation, checkpoints, the run ----------------------------------------------------------
def evaluate_model(state: TrainState, *, episodes: int | None = None) -> dict[str, Any]:
    """Test-split success of the current weights (same seeds every time)."""
    cfg = state.config
    policy = HFPolicy(state.model, state.policy.tokenizer, temperature=cfg.eval_temperature, top_p=1.0, max_new_tokens=cfg.max_new_tokens, seed=EVAL_SEED)
    was_training = state.model.training
    state.model.eval()
    config = EvalConfig(cfg.env_id, cfg.test_env_kwargs, episodes=episodes or cfg.eval_episodes, seed=EVAL_SEED, batch_size=64)
    summary, _ = evaluate(policy, config)
    state.model.train(was_training)
    return summary


def save(state: TrainState, step: int, directory: Path) -> Path:
    return save_checkpoint(directory, model=state.model, tokenizer=state.policy.tokenizer, optimizer=state.optimizer, scheduler=state.scheduler, step=step, config=state.config.to_dict())


def train(config: TrainConfig, *, make_env: EnvFactory | None = None, resume: bool = False, console: Console | None = None) -> dict[str, Any]:
    """Run GRPO (Critique-GRPO when `config.critique` is set); returns before/after figures."""
    from trainer.progress import step_progress

    console = console or Console()
    state = setup(config, make_env=make_env, resume=resume)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_config.json").write_text(json.dumps(config.to_dict(), indent=2, default=str))
    evaluating = make_env is None and config.eval_episodes > 0
    before = None
    if state.start_step == 0 and evaluating:
        before = evaluate_model(state)
        state.log.write({"step": 0, "eval/success_rate": before["success_rate"], "eval/mean_reward": before["mean_reward"]})
    started = time.perf_counter()
    last = state.start_step
    with step_progress(console, config.steps, "train", enabled=config.progress, start=state.start_step) as advance:
        for step in range(state.start_step + 1, config.steps + 1):
            row = train_step(state, step)
            if config.eval_every and step % config.eval_every == 0 and step < config.steps and evaluating:
                ev = evaluate_model(state)
                row.update({"eval/success_rate": ev["success_rate"], "eval/mean_reward": ev["mean_reward"]})
            state.log.write(row)
            advance(row)
            last = step
            if config.save_every and step % config.save_every == 0:
                save(state, step, out / "checkpoints" / f"step-{step}")
            if config.time_budget_s and time.perf_counter() - started > config.time_budget_s:
                console.print(f"time budget of {config.time_budget_s:.0f}s reached after step {step}")
                break
    after = None
    if evaluating:
        after = evaluate_model(state)
        state.log.write({"step": last, "eval/success_rate": after["success_rate"], "eval/mean_reward": after["mean_reward"]})
    final = save(state, last, out / "final")
    plot_curve(state.log.rows(), out / "curve.png", title=f"{config.env_id} {config.env_kwargs} ({'critique: ' + config.critique if config.critique != 'none' else 'GRPO'})")
    return {"steps": last, "train_time_s": time.perf_counter() - started, "before": before, "after": after, "final": str(final)}
