"""GRPO and Critique-GRPO for multi-turn, tool-using policies, readable top to bottom.

One step: rollout (tasks x group, batched, token-exact) -> rewards (the env's rubric) ->
Critique-GRPO refinements for failed groups -> advantages (one baseline per group) ->
update epochs over micro-batches -> log. See `trainer.losses` for the math.

Under torchrun every rank draws the same tasks (from (seed, step)) and rolls out its own slice
of whole groups; advantages, the loss normaliser and the metrics are global, and gradients are
summed across ranks before each optimizer step (see `trainer.distributed`). Rank 0 writes the
metrics and checkpoints and runs the evaluations. Several envs (`TrainConfig.envs`) mix in one
run: each group's env is drawn by weight, and metrics and evaluations are reported per env. With
`TrainConfig.served`, rollouts and refinements come from a server (`trainer.samplers.served`) or an
in-process vLLM engine (`trainer.samplers.vllm_sampler`) that the trainer pushes its weights to; the update
and the evaluations stay with the trainer's model, on `TrainConfig.device`.
"""

from __future__ import annotations

import copy
import json
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import gymnasium as gym
import numpy as np
import torch
from cgym.agents.critics import run_refinements
from cgym.agents.eval.episodes import run_episodes
from cgym.agents.eval.evaluate import EvalConfig, evaluate
from cgym.agents.local.hf import HFPolicy
from cgym.agents.local.lora import lean_adapters, merged, with_lora
from cgym.agents.local.precision import autocast, frozen_weights_cast
from cgym.agents.local.prefix_tree import takes_trees, tree_logprobs, tree_size
from cgym.agents.local.sampling import sequence_logprobs
from cgym.agents.local.training_ops import fused_training_ops
from cgym.agents.options import SamplingOptions
from cgym.agents.pretrained import resolve_model
from cgym.envs.credit import critiqued_turns, turn_rewards
from cgym.envs.errors import ConfigError, first_line
from cgym.envs.registration import make
from cgym.trainer.checkpoint import CheckpointError, good_checkpoints, load_state, save_checkpoint
from cgym.trainer.config import VLLM_IN_PROCESS, TrainConfig
from cgym.trainer.distributed import World, check_divisible, close_world, global_normalizer, init_world, training_device
from cgym.trainer.embedded import prepare_models
from cgym.trainer.finite import check_finite
from cgym.trainer.heads import batch_head
from cgym.trainer.losses import policy_loss, rft_weights, turn_advantages, unified_advantages
from cgym.trainer.metrics import HackingMonitor, MetricsLog, Outcome, env_metrics, peak_rss_gb, plot_curve, rollout_metrics
from cgym.trainer.recompute import recomputed_past_budget
from cgym.trainer.refine import rebase, sample_subset, select_refinements, should_refine
from cgym.trainer.rollout import (
    Batch,
    Trajectory,
    group_micro_batches,
    pack,
    rows_with_signal,
    slice_batch,
    spread_over_tokens,
    tree_budget,
    tree_micro_batches,
)
from cgym.trainer.run_folder import CONFIG_FILE, check_out, check_same_run, clear_run
from cgym.trainer.samplers.served import PushedSampler, ServedPolicy
from rich.console import Console

EnvFactory = Callable[[str], gym.Env]  # split -> env
EVAL_SEED = 10_000
T = TypeVar("T")


@dataclass
class TrainState:
    """What the loop carries between steps (built once in `setup`)."""

    config: TrainConfig
    policy: HFPolicy
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    factories: dict[str, EnvFactory]  # env id -> (split -> env)
    reference: torch.nn.Module | None
    critic: Any
    log: MetricsLog
    monitor: HackingMonitor
    max_completion_length: int
    start_step: int = 0
    world: World = field(default_factory=World)
    pools: dict[str, list[gym.Env]] = field(default_factory=dict)  # train-split envs reused across steps
    served: PushedSampler | None = None  # what samples rollouts when TrainConfig.served is set: a server or in-process vLLM

    @property
    def model(self) -> torch.nn.Module:
        return self.policy.model

    @property
    def sampler(self) -> HFPolicy | PushedSampler:
        """What samples rollouts and refinements: the server or vLLM, or the trainer's own policy."""
        return self.served or self.policy

    def make_env(self, split: str, env_id: str | None = None) -> gym.Env:
        return self.factories[env_id or self.config.env_ids[0]](split)

    def pool(self, env_id: str) -> list[gym.Env]:
        return self.pools.setdefault(env_id, [])


def setup(config: TrainConfig, *, make_env: EnvFactory | None = None, resume: bool = False, world: World | None = None) -> TrainState:
    """Load the model (or the latest checkpoint), optimizer, scheduler, reference and critic.

    `make_env` replaces the registry for a single-env run (tests use a toy env).
    """
    world = world or World(device=training_device(config.device))
    check_divisible(config.tasks_per_step, world)
    if make_env is not None and len(config.env_ids) > 1:
        raise ConfigError(f"make_env builds one env, but the config mixes {list(config.env_ids)}")
    out = Path(config.out)
    torch.manual_seed(config.seed)
    prepare_models(config.model, config.critique.removeprefix("model:") if config.critique.startswith("model:") else None)
    policy, optimizer, scheduler, start = _resume(config, out, world) if resume else _load(config, None, world)
    world.broadcast_parameters(policy.model)
    if world.is_main:
        rewind_metrics(out / "metrics.jsonl", start)
    factories = {config.env_ids[0]: make_env} if make_env else {e: _registry_factory(config, e) for e in config.env_ids}
    max_turns = max(_max_turns(factory) for factory in factories.values())
    reference = copy.deepcopy(policy.model).eval().requires_grad_(False) if config.beta > 0 else None
    log = MetricsLog(out / "metrics.jsonl")
    served = _served(config, policy, start, world)
    return TrainState(config, policy, optimizer, scheduler, factories, reference, _critic(config), log, HackingMonitor(), config.sampling.max_new_tokens * max_turns, start, world, served=served)


def _resume(config: TrainConfig, out: Path, world: World) -> tuple[HFPolicy, torch.optim.Optimizer, Any, int]:
    """The newest checkpoint that verifies, is this run's, and loads; an older one where a newer is refused."""
    for checkpoint in good_checkpoints(out):
        check_same_run(checkpoint / CONFIG_FILE, config)
        try:
            return _load(config, checkpoint, world)
        except CheckpointError as exc:
            warnings.warn(f"skipping a checkpoint that does not load: {exc}", stacklevel=3)
    if any((out / "checkpoints").glob("step-*")):
        raise CheckpointError(f"no checkpoint under {out / 'checkpoints'} loads; --overwrite starts over")
    warnings.warn(f"resume: no checkpoint under {out / 'checkpoints'} yet; starting from step 0", stacklevel=3)
    return _load(config, None, world)


def _load(config: TrainConfig, checkpoint: Path | None, world: World) -> tuple[HFPolicy, torch.optim.Optimizer, Any, int]:
    """Policy, optimizer and scheduler from the starting model, or as `checkpoint` left them."""
    # a LoRA checkpoint holds only the adapter: the base comes from the starting model
    weights = config.model_path if config.lora_r > 0 or checkpoint is None else checkpoint
    try:
        policy = HFPolicy.from_pretrained(weights, device=world.device, dtype=torch.float32, sampling=config.sampling)
        if config.lora_r > 0:
            policy.model = with_lora(policy.model, config.lora_r, adapter=checkpoint)
    except Exception as exc:  # whatever a damaged or planted weights file raises: try the previous checkpoint
        if checkpoint is None:
            raise
        raise CheckpointError(f"{checkpoint}: its weights do not load ({type(exc).__name__}: {first_line(exc)})") from None
    freeze_except(policy.model, config.trainable)
    params = [p for p in policy.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=config.weight_decay)
    warmup = max(config.warmup_steps, 1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    start = load_state(checkpoint, optimizer=optimizer, scheduler=scheduler) if checkpoint else 0
    return policy, optimizer, scheduler, start


def _served(config: TrainConfig, policy: HFPolicy, step: int, world: World) -> PushedSampler | None:
    """The server's (or in-process vLLM's) sampler, holding the starting weights (or the resumed checkpoint's)."""
    if not config.served:
        return None
    if world.size > 1:
        raise ConfigError(f"served rollouts run in one process (this run has {world.size}): drop --served or torchrun")
    served: PushedSampler
    if config.served == VLLM_IN_PROCESS:
        from cgym.trainer.samplers.vllm_sampler import VLLMSampler  # vLLM is optional: imported only when asked for

        served = VLLMSampler(policy.tokenizer, resolve_model(config.model_path), lora_r=config.lora_r, gpu_memory_utilization=config.vllm_memory, sampling=config.sampling)
    else:
        served = ServedPolicy(policy.tokenizer, config.served, engine=config.served_engine, sampling=config.sampling)
    served.push(policy.model, step, Path(config.out) / "served")
    return served


def _registry_factory(config: TrainConfig, env_id: str) -> EnvFactory:
    return lambda split: make(env_id, **config.kwargs_for(env_id, split))


def _max_turns(factory: EnvFactory) -> int:
    probe = factory("train")
    turns = int(getattr(probe.unwrapped, "max_turns", 1))
    probe.close()
    return turns


def rewind_metrics(path: Path, step: int) -> list[int]:
    """Keep the metrics rows up to `step` (none at 0), so the steps a resume re-runs are logged once.

    Every readable row up to `step` is kept, whatever lines around it fail to parse (a row torn by
    a crash, a stray line): those are skipped and their 1-based line numbers returned (and
    warned about). Nothing is lost: the file as it was is kept beside it as `metrics.jsonl.N.bak`.
    """
    if not path.exists():
        return []
    if step == 0:
        path.unlink()
        return []
    lines = path.read_text(errors="replace").splitlines()
    kept: list[str] = []
    bad: list[int] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if not isinstance(row, dict) or not isinstance(row.get("step", 0), int):
            bad.append(number)
        elif row.get("step", 0) <= step:
            kept.append(line + "\n")
    if len(kept) == len(lines):
        return bad
    backup = next(candidate for n in range(1, 10_000) if not (candidate := path.with_name(f"{path.name}.{n}.bak")).exists())
    path.replace(backup)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    tmp.replace(path)
    if bad:
        warnings.warn(f"{path}: skipped unreadable line(s) {bad[:10]}{' ...' if len(bad) > 10 else ''}; the file as it was is kept as {backup.name}", stacklevel=2)
    return bad


def _critic(config: TrainConfig) -> Any:
    if not config.critique.startswith("model:"):
        return None
    from cgym.agents.critics import ModelCritic
    from cgym.agents.spec import load_policy

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


# -- one step ---------------------------------------------------------------------------------
def train_step(state: TrainState, step: int) -> dict[str, Any]:
    cfg, world = state.config, state.world
    started = time.perf_counter()
    rng = np.random.default_rng([cfg.seed, step])  # tasks and envs depend only on (seed, step): every rank draws the same
    seeds, envs = _draw_tasks(cfg, rng, cfg.tasks_per_step), _draw_envs(cfg, rng, cfg.tasks_per_step)

    # 1. rollout: this rank's whole groups, `rollout_groups` at a time
    state.model.eval()
    trajectories = _rollout_groups(state, seeds, envs, step)
    rollout_s = world.max([time.perf_counter() - started])[0]
    outcomes = [o for part in world.gather([Outcome.of(t, envs[t.group]) for t in trajectories]) for o in part]
    metrics = rollout_metrics(outcomes, cfg.group_size) | (env_metrics(outcomes) if len(cfg.env_ids) > 1 else {})

    # 2. Critique-GRPO: refine the groups where (nearly) every attempt failed
    refined, refine_counts = _refine(state, trajectories, envs, step) if cfg.critique != "none" else ([], None)
    batch_trajs = trajectories + refined
    sampled_rss = peak_rss_gb()
    state.policy.drop_caches()  # the rollout's per-turn keys/values: stale after the update, memory during it

    # 3. advantages: one baseline per group over initial + refined rewards (global, for scale="batch")
    advantages, rewards, groups = _advantages(state, batch_trajs)
    keep = _keep_rows(batch_trajs, rewards, groups, cfg)
    batch_trajs = [t for t, k in zip(batch_trajs, keep) if k]
    advantages = advantages[torch.tensor(keep, dtype=torch.bool)]

    # 4. update: num_iterations passes over micro-batches, one optimizer step per pass
    per_token = _turn_credit(batch_trajs, advantages, cfg) if cfg.credit == "turn" else None
    update = _update(state, batch_trajs, advantages, step, per_token) if world.sum([len(batch_trajs)])[0] else {"loss": 0.0}
    update |= _push(state, step) if state.served else {}
    elapsed = time.perf_counter() - started
    initial, extra = world.sum([sum(t.sampled_tokens for t in trajectories), sum(t.sampled_tokens for t in refined)])

    # 5. log
    row = {"step": step, **metrics, **(_refine_metrics(world.sum(refine_counts)) if refine_counts else {}), **update}
    row.update(tokens_per_s=(initial + extra) / max(rollout_s, 1e-9), step_time_s=elapsed, rollout_time_s=rollout_s, lr=state.scheduler.get_last_lr()[0])
    row["tokens/initial"], row["tokens/refined"] = int(initial), int(extra)
    row["memory/peak_after_sampling_gb"], row["memory/peak_gb"] = world.max([sampled_rss, peak_rss_gb()])  # high-water marks: where the peak came
    warning = state.monitor.update(metrics["hacking/top_quartile_failed"], metrics["hacking/failed_outscoring"])
    if warning:
        row["hacking/warning"] = warning
    return row


def _push(state: TrainState, step: int) -> dict[str, Any]:
    """Send the new weights to the server every `push_every` steps; how stale this step's rollouts were."""
    served = state.served
    assert served is not None and served.weights_step is not None
    row = {"served/weights_step": served.weights_step, "served/staleness": step - 1 - served.weights_step, "served/prompt_mismatches": served.prompt_mismatches}
    if step % state.config.push_every == 0:
        row["served/push_s"] = served.push(state.model, step, Path(state.config.out) / "served")
    return row


def _rollout_groups(state: TrainState, seeds: list[int], envs: list[str], step: int) -> list[Trajectory]:
    """This rank's groups (global indices, in order); flat ones redrawn once under zero_std="resample"."""
    cfg = state.config
    share = cfg.tasks_per_step // state.world.size
    mine = range(state.world.rank * share, (state.world.rank + 1) * share)
    trajectories = _play(state, [(g, envs[g], seeds[g]) for g in mine], step)
    if cfg.zero_std == "resample":
        by_group = {g: trajectories[i * cfg.group_size : (i + 1) * cfg.group_size] for i, g in enumerate(mine)}
        flat = [g for g, grp in by_group.items() if len({t.reward for t in grp}) == 1]
        if flat:  # one more draw for the groups that taught nothing, each from its own (seed, step, group)
            fresh = [_draw_tasks(cfg, np.random.default_rng([cfg.seed, step, 1, g]), 1)[0] for g in flat]
            redo = _play(state, [(g, envs[g], s) for g, s in zip(flat, fresh)], step, resampled=True)
            by_group.update({g: redo[i * cfg.group_size : (i + 1) * cfg.group_size] for i, g in enumerate(flat)})
            trajectories = [t for g in mine for t in by_group[g]]
    return trajectories


def _draw_tasks(cfg: TrainConfig, rng: np.random.Generator, n: int) -> list[int]:
    """Env seeds of `n` tasks: anywhere in the train split, or from the first `task_pool` seeds."""
    if cfg.task_pool:
        return [int(s) for s in rng.integers(0, cfg.task_pool, n)]
    return [int(s) for s in rng.integers(0, 2**31 - 1, n)]


def _draw_envs(cfg: TrainConfig, rng: np.random.Generator, n: int) -> list[str]:
    """Each of `n` groups' env, drawn by `env_probabilities` (one env: no draw, the rng is untouched)."""
    if len(cfg.env_ids) == 1:
        return [cfg.env_ids[0]] * n
    return [cfg.env_ids[i] for i in rng.choice(len(cfg.env_ids), size=n, p=cfg.env_probabilities)]


def _play(state: TrainState, jobs: list[tuple[int, str, int]], step: int, *, resampled: bool = False) -> list[Trajectory]:
    """(group, env, task seed) jobs -> their group_size trajectories each, in job order."""
    g = state.config.group_size
    done: dict[int, list[Trajectory]] = {}
    for env_id, first, part in _batches(state.config, jobs, group=lambda job: job[0], env=lambda job: job[1]):
        _seed_sampler(state, step, first, salt=int(resampled))
        seeds = [seed for _, _, seed in part for _ in range(g)]
        results = run_episodes(partial(state.make_env, "train", env_id), state.sampler, seeds, batch_size=len(seeds), pool=state.pool(env_id), workers=state.config.workers)
        for i, (group, _, _) in enumerate(part):
            done[group] = [Trajectory.from_result(r, group) for r in results[i * g : (i + 1) * g]]
    return [t for group, _, _ in jobs for t in done[group]]


def _batches(cfg: TrainConfig, items: list[T], *, group: Callable[[T], int], env: Callable[[T], str]) -> Iterator[tuple[str, int, list[T]]]:
    """Items split by env, then into batches of `rollout_groups` groups (0: one batch per env);
    each comes with its env and first group."""
    for env_id in dict.fromkeys(map(env, items)):
        own = [x for x in items if env(x) == env_id]
        groups = list(dict.fromkeys(map(group, own)))
        size = cfg.rollout_groups or len(groups)
        for start in range(0, len(groups), size):
            chosen = set(groups[start : start + size])
            yield env_id, groups[start], [x for x in own if group(x) in chosen]


def _seed_sampler(state: TrainState, step: int, first_group: int, *, salt: int) -> None:
    """Seed a rollout batch's sampler by (seed, step, what it samples, its first group), never by
    rank: with `rollout_groups` 1 a group samples the same under any number of processes."""
    state.sampler.reseed(state.config.seed * 1_000_003 + step + (salt << 32) + (first_group << 34))


def _refine(state: TrainState, trajectories: list[Trajectory], envs: list[str], step: int) -> tuple[list[Trajectory], list[float]]:
    """Refinements kept for this rank's triggered groups, and the counts `_refine_metrics` reads.

    Which failures get a critique and which refinements are kept are drawn per group, from
    (seed, step, group), and refinements sample in `rollout_groups` batches like the rollout, so
    none of it depends on how groups are split over ranks.
    """
    cfg = state.config
    by_group = [trajectories[i : i + cfg.group_size] for i in range(0, len(trajectories), cfg.group_size)]
    triggered = [grp for grp in by_group if should_refine(grp, cfg.refine_fail_fraction)]
    rngs = {grp[0].group: np.random.default_rng([cfg.seed, step, 2, grp[0].group]) for grp in triggered}
    failed = [t for grp in triggered for t in sample_subset([t for t in grp if not t.success], cfg.refine_attempts, rngs[grp[0].group])]
    critiques = _critiques(state, failed)
    todo = [(t, c) for t, c in zip(failed, critiques) if c]
    refined: list[Trajectory] = []
    for env_id, first, own in _batches(cfg, todo, group=lambda item: item[0].group, env=lambda item: envs[item[0].group]):
        _seed_sampler(state, step, first, salt=2)
        results = run_refinements(partial(state.make_env, "train", env_id), state.sampler, [(t.result, c) for t, c in own], pool=state.pool(env_id))
        refined += [Trajectory.from_result(r, t.group, refined=True) for r, (t, _) in zip(results, own)]
    kept: list[Trajectory] = []
    prompts = {t.group: t.ids[: t.result.conversation.prompt_len] for grp in triggered for t in grp}
    for group in sorted({t.group for t in refined}):
        chosen = select_refinements([t for t in refined if t.group == group], cfg.refine_k, rngs[group])
        kept += [rebase(t, prompts[group]) for t in chosen]
    rescued = len({t.group for t in kept if t.success})
    return kept, [len(triggered), len(by_group), len(todo), sum(t.success for t in refined), rescued, len(kept)]


def _refine_metrics(counts: list[float]) -> dict[str, Any]:
    triggered, groups, attempts, successes, rescued, kept = counts
    return {
        "refine/trigger_rate": triggered / max(groups, 1),
        "refine/attempts": int(attempts),
        "refine/success_rate": successes / attempts if attempts else 0.0,
        "refine/rescued_groups": int(rescued),
        "refine/kept": int(kept),
    }


def _advantages(state: TrainState, trajs: list[Trajectory]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's advantages, rewards and group ids; the baselines see every rank's rows."""
    parts = state.world.gather([(t.reward, t.group) for t in trajs])
    offset = sum(len(p) for p in parts[: state.world.rank])
    rewards = torch.tensor([r for p in parts for r, _ in p], dtype=torch.float32)
    groups = torch.tensor([g for p in parts for _, g in p], dtype=torch.long)
    rows = slice(offset, offset + len(trajs))
    if state.config.algo == "rft":  # no baseline: each verified success weighs 1, failures are dropped in _keep_rows
        return rft_weights(torch.tensor([t.success for t in trajs], dtype=torch.bool)), rewards[rows], groups[rows]
    advantages = unified_advantages(rewards, groups, state.config.scale) if len(rewards) else rewards
    return advantages[rows], rewards[rows], groups[rows]


def _critiques(state: TrainState, failed: list[Trajectory]) -> list[str | None]:
    style = state.config.critique
    if state.critic is not None:
        return state.critic.critique([t.result for t in failed])
    return [t.result.critique(style) for t in failed]  # type: ignore[arg-type]


def _keep_rows(trajs: list[Trajectory], rewards: torch.Tensor, groups: torch.Tensor, cfg: TrainConfig) -> list[bool]:
    keep = [True] * len(trajs)
    if cfg.algo == "rft":
        keep = [t.success for t in trajs]
    elif cfg.zero_std == "drop":
        flat = {int(g) for g in torch.unique(groups) if rewards[groups == g].std(unbiased=False) == 0}
        keep = [t.group not in flat for t in trajs]
    if cfg.mask_truncated:
        keep = [k and not t.truncated for k, t in zip(keep, trajs)]
    return keep


def _turn_credit(trajs: list[Trajectory], advantages: torch.Tensor, cfg: TrainConfig) -> list[list[float] | None]:
    """Each sampled token's advantage under turn credit; None for a row that keeps its episode
    advantage (a refinement, or a ledger its turns do not line up with)."""
    results = [None if t.refined else t.result for t in trajs]
    rewards = [turn_rewards(len(r.turns), critiqued_turns(r.critiques)) if r else [] for r in results]
    per_turn = turn_advantages(advantages.tolist(), rewards, [t.group for t in trajs], gamma=cfg.turn_gamma, weight=cfg.turn_weight)
    return [spread_over_tokens(t.mask, [len(turn.token_ids) for turn in r.turns], values) if r else None for t, r, values in zip(trajs, results, per_turn)]


def _update(state: TrainState, trajs: list[Trajectory], advantages: torch.Tensor, step: int, per_token: list[list[float] | None] | None = None) -> dict[str, Any]:
    """num_iterations optimizer steps on this rank's rows; with torchrun, every rank calls it
    (one left with no rows too) and the gradients are summed across ranks before each step."""
    cfg, world = state.config, state.world
    state.model.train()
    pad = state.policy.tokenizer.pad_token_id or 0
    batch = pack(trajs, advantages, pad_id=pad, token_advantages=per_token).to(world.device) if trajs else None
    normalizer = global_normalizer(batch.mask if batch else None, cfg.loss_type, state.max_completion_length, world)
    params = [p for p in state.model.parameters() if p.requires_grad]
    totals: dict[str, float] = {"loss": 0.0, "clip_frac_low": 0.0, "clip_frac_high": 0.0, "kl": 0.0, "sampler/logp_diff_max": 0.0}
    # A bf16 sampler's log-probs differ from the training pass's by up to ~0.2 nats (measured on
    # SmolLM2), which the clip would treat as policy change, and a server's may be missing or
    # stale: then the old log-probs are the training pass's own, so the first iteration's ratio is exactly 1.
    own_old = state.served is not None or state.policy.sampling_weights.separate
    fixed_old: dict[int, torch.Tensor] = {}
    n_micro = 0
    # Rows whose every sampled token has advantage 0 (a group that all passed or all failed) add
    # nothing to the loss or its gradient while nothing else (a KL term) pulls on them: they are
    # counted in the normalizer above and metrics below, and never run.
    learning = rows_with_signal(batch, with_kl=cfg.beta > 0) if batch is not None else []
    moving = slice_batch(batch, learning) if batch is not None and learning else None
    tree = takes_trees(state.model)  # each micro-batch's rows merged into one prefix tree, each shared id run once
    ids, groups = [trajs[row].ids for row in learning], [trajs[row].group for row in learning]
    chunks = tree_micro_batches(ids, groups, tree_budget(state.model)) if tree else group_micro_batches(ids, groups, cfg.micro_batch_size)  # a group's rows together; sized by tokens, like SFT's
    logprobs = tree_logprobs if tree else sequence_logprobs
    # frozen LoRA base weights cast once per update, not per call; fp32 adapters summed in one product; fp32 norms and gates one C pass each
    with frozen_weights_cast(state.model), lean_adapters(state.model), fused_training_ops(state.model):
        for iteration in range(cfg.num_iterations):
            head = batch_head(state.model, moving.ids, moving.attention, moving.mask) if moving is not None else None  # run once per optimizer step
            for chunk, rows in enumerate(chunks):
                assert moving is not None
                mb = slice_batch(moving, rows)
                tokens = tree_size([ids[row][head.length if head else 0 :] for row in rows]) if tree else mb.ids.numel()
                with autocast(state.model), recomputed_past_budget(state.model, tokens):  # logits only at sampled positions; log-softmax in fp32
                    logp = logprobs(state.model, mb.ids, mb.attention, cfg.sampling.temperature, mask=mb.mask, head=head)
                    ref = None
                    if state.reference is not None:
                        with torch.no_grad():
                            ref = (tree_logprobs if takes_trees(state.reference) else sequence_logprobs)(state.reference, mb.ids, mb.attention, cfg.sampling.temperature, mask=mb.mask)
                old = mb.old_logp
                if own_old:
                    if iteration == 0:
                        fixed_old[chunk] = logp.detach()
                        sampled = mb.mask.bool() & ~mb.shaped[:, None]  # a refinement was sampled under another prompt
                        if sampled.any() and (state.served is None or state.served.returns_logprobs):
                            totals["sampler/logp_diff_max"] = max(totals["sampler/logp_diff_max"], float((logp.detach() - mb.old_logp)[sampled].abs().max()))
                    old = fixed_old[chunk]
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
            if head is not None:
                head.backward()
            world.sum_gradients(params)
            grad_norm = torch.nn.utils.clip_grad_norm_(state.model.parameters(), cfg.max_grad_norm)
            check_finite("gradient norm", grad_norm, step=step)
            state.optimizer.step()
            state.scheduler.step()
            state.optimizer.zero_grad(set_to_none=True)
    return {**_update_metrics(world, batch, totals, n_micro, cfg.num_iterations, float(grad_norm)), "trained_rows": int(world.sum([len(learning)])[0])}


def _update_metrics(world: World, batch: Batch | None, totals: dict[str, float], n_micro: int, iterations: int, grad_norm: float) -> dict[str, Any]:
    """The update's figures over every rank: the loss summed (each rank's is a share of the
    global one), clip fractions and KL averaged over micro-batches, entropy over tokens."""
    sampled = batch.mask.bool() if batch is not None else torch.zeros(0, dtype=torch.bool)
    surprisal = float(-batch.old_logp[sampled].sum()) if batch is not None else 0.0
    loss, low, high, kl, micro, nats, tokens = world.sum([totals["loss"], totals["clip_frac_low"], totals["clip_frac_high"], totals["kl"], n_micro, surprisal, float(sampled.sum())])
    return {
        "loss": loss / iterations,
        "clip_frac_low": low / max(micro, 1),
        "clip_frac_high": high / max(micro, 1),
        "kl": kl / max(micro, 1),
        "sampler/logp_diff_max": world.max([totals["sampler/logp_diff_max"]])[0],
        "entropy": nats / tokens if tokens else 0.0,
        "grad_norm": grad_norm,
        "train_tokens": int(tokens),
    }


# -- evaluation, checkpoints, the run ----------------------------------------------------------
def evaluate_model(state: TrainState, *, episodes: int | None = None) -> dict[str, Any]:
    """Test-split success of the current weights (same seeds every time); with several envs,
    the mean over them and each one's summary under `per_env`."""
    per_env = {env_id: _evaluate_env(state, env_id, episodes) for env_id in state.config.env_ids}
    if len(per_env) == 1:
        return next(iter(per_env.values()))
    means = {k: float(np.mean([s[k] for s in per_env.values()])) for k in ("success_rate", "mean_reward")}
    return {**means, "per_env": per_env}


def _evaluate_env(state: TrainState, env_id: str, episodes: int | None) -> dict[str, Any]:
    cfg = state.config
    policy = HFPolicy(state.model, state.policy.tokenizer, device=state.world.device, sampling=SamplingOptions(temperature=cfg.eval_temperature, top_p=1.0, max_new_tokens=cfg.sampling.max_new_tokens, seed=EVAL_SEED))
    was_training = state.model.training
    state.model.eval()
    config = EvalConfig(env_id, cfg.kwargs_for(env_id, "test"), episodes=episodes or cfg.eval_episodes, seed=EVAL_SEED, workers=cfg.workers)
    summary, _ = evaluate(policy, config)
    state.model.train(was_training)
    return summary


def _eval_row(summary: dict[str, Any]) -> dict[str, Any]:
    row = {"eval/success_rate": summary["success_rate"], "eval/mean_reward": summary["mean_reward"]}
    for env_id, s in summary.get("per_env", {}).items():
        row |= {f"eval/{env_id}/success_rate": s["success_rate"], f"eval/{env_id}/mean_reward": s["mean_reward"]}
    return row


def _has_final_eval(rows: list[dict[str, Any]], step: int) -> bool:
    """Whether the log ends with an evaluation-only row at `step`."""
    return bool(rows) and rows[-1].get("step") == step and "eval/success_rate" in rows[-1] and "step_time_s" not in rows[-1]


def _main_only(state: TrainState, work: Callable[[], Any]) -> Any:
    """Rank 0 runs `work` while the others wait at a barrier; they get None."""
    result = work() if state.world.is_main else None
    state.world.barrier()
    return result


def save(state: TrainState, step: int, directory: Path, *, merge: bool = False) -> Path:
    """A checkpoint of the run; `merge` folds LoRA adapters into the weights (the final model loads
    anywhere a model does, without peft), while step checkpoints keep the adapter `--resume` needs."""
    model = merged(state.model) if merge else state.model
    return save_checkpoint(directory, model=model, tokenizer=state.policy.tokenizer, optimizer=state.optimizer, scheduler=state.scheduler, step=step, config=state.config.to_dict())


def train(config: TrainConfig, *, make_env: EnvFactory | None = None, resume: bool = False, overwrite: bool = False, console: Console | None = None) -> dict[str, Any]:
    """Run GRPO (Critique-GRPO when `config.critique` is set); returns before/after figures.

    A `config.out` that holds a run is continued (`resume`, which refuses a different run) or
    replaced (`overwrite`); without either it is refused. Under torchrun (WORLD_SIZE > 1) this
    process joins the process group and trains its share.
    """
    check_out(config, resume=resume, overwrite=overwrite)
    world = init_world(training_device(config.device))
    try:
        if overwrite and world.is_main:
            clear_run(Path(config.out))
        world.barrier()
        return _train(config, world, make_env=make_env, resume=resume, console=console or Console())
    finally:
        close_world(world)


def _train(config: TrainConfig, world: World, *, make_env: EnvFactory | None, resume: bool, console: Console) -> dict[str, Any]:
    from cgym.agents.eval.progress import step_progress

    state = setup(config, make_env=make_env, resume=resume, world=world)
    out = Path(config.out)
    if world.is_main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "train_config.json").write_text(json.dumps(config.to_dict(), indent=2, default=str))
    evaluating = make_env is None and config.eval_episodes > 0
    before = None
    if state.start_step == 0 and evaluating:
        before = _main_only(state, lambda: evaluate_model(state))
        if before:
            state.log.write({"step": 0, **_eval_row(before)})
    started = time.perf_counter()
    last = state.start_step
    with step_progress(console, config.steps, "train", enabled=config.progress and world.is_main, start=state.start_step) as advance:
        for step in range(state.start_step + 1, config.steps + 1):
            row = train_step(state, step)
            if config.eval_every and step % config.eval_every == 0 and step < config.steps and evaluating:
                row.update(_eval_row(ev) if (ev := _main_only(state, lambda: evaluate_model(state))) else {})
            if world.is_main:
                state.log.write(row)
            advance(row)
            last = step
            if config.save_every and step % config.save_every == 0:
                _main_only(state, partial(save, state, step, out / "checkpoints" / f"step-{step}"))
            over = bool(config.time_budget_s) and time.perf_counter() - started > config.time_budget_s
            if world.max([float(over)])[0]:  # every rank stops after the same step
                console.print(f"time budget of {config.time_budget_s:.0f}s reached after step {step}")
                break
    after = None
    if evaluating:
        after = _main_only(state, lambda: evaluate_model(state))
        if after and not _has_final_eval(state.log.rows(), last):  # a resumed finished run was evaluated already
            state.log.write({"step": last, **_eval_row(after)})
    final = out / "final"
    if world.is_main:
        save(state, last, final, merge=True)
        envs = " + ".join(config.env_ids)
        plot_curve(state.log.rows(), out / "curve.png", title=f"{envs} {config.env_kwargs} ({'critique: ' + config.critique if config.critique != 'none' else 'GRPO'})")
    if state.served:
        state.served.close()
    world.barrier()
    return {"steps": last, "train_time_s": time.perf_counter() - started, "before": before, "after": after, "final": str(final), "rank": world.rank}
