"""The training configuration: one typed, validated, frozen dataclass."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from cgym.agents.options import SamplingOptions
from cgym.agents.spec import SERVED_ENGINES, ServedEngine
from cgym.envs.errors import ConfigError, did_you_mean

LossType = Literal["grpo", "bnpo", "dapo", "dr_grpo"]
LOSS_TYPES: tuple[str, ...] = get_args(LossType)
AdvantageScale = Literal["group", "batch", "none"]
ADVANTAGE_SCALES: tuple[str, ...] = get_args(AdvantageScale)
ZeroStd = Literal["keep", "drop", "resample"]
ZERO_STD: tuple[str, ...] = get_args(ZeroStd)
Algo = Literal["grpo", "rft"]
Credit = Literal["episode", "turn"]
CREDITS: tuple[str, ...] = get_args(Credit)
ALGOS: tuple[str, ...] = get_args(Algo)
Trainable = Literal["all", "attention", "no_embeddings"]
TRAINABLE: tuple[str, ...] = get_args(Trainable)
CRITIQUE_STYLES = ("none", "indicative", "ground_truth", "step")
VLLM_IN_PROCESS = "vllm:"  # TrainConfig.served for rollouts from in-process vLLM
DEVICE = re.compile(r"cpu|cuda(:\d+)?")


@dataclass(frozen=True)
class TrainConfig:
    """GRPO / Critique-GRPO on one env or a mix of envs. Every field is fixed once parsed."""

    env_id: str = "cgym/ApiReport-v0"
    """The env to train on (its train split), when `envs` is empty."""
    envs: tuple[str, ...] = ()
    """Several envs mixed in one run (replaces env_id): each group's env is drawn by `env_weights`."""
    env_weights: tuple[float, ...] = ()
    """Relative weight of each of `envs` when drawing a group's env (empty: equal weights)."""
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra env kwargs as JSON (difficulty, faults, ...) for every env; with several envs, a JSON
    object keyed by every env id ({"cgym/SqlQuery-v0": {"difficulty": "easy"}, ...}) gives each its
    own. `split` is set by the trainer."""
    model: str = ""
    """The starting model: smollm2-135m, tiny, a local directory, a .gguf file or a hub name (hf: prefix accepted)."""
    out: str = "runs/grpo"
    """Output directory: metrics.jsonl, curve.png, checkpoints/, final/."""
    steps: int = 20
    """Optimizer steps (each: one rollout of tasks_per_step x group_size episodes)."""
    group_size: int = 8
    """Trajectories per task (n in GRPO)."""
    tasks_per_step: int = 4
    """Tasks drawn from the train split per step."""
    task_pool: int = 0
    """Draw tasks from a fixed pool of this many train-split seeds (0: the whole split)."""
    learning_rate: float = 2e-4
    """AdamW learning rate (constant after warm-up). 2e-4 is the LoRA rate (about 10x the full
    fine-tuning optimum, LoRA Without Regret); with lora_r=0 use about 1e-5 for SmolLM2 (2e-4 took a
    fully fine-tuned SmolLM2 on SqlQuery easy from 38% to 0% in 5 steps)."""
    warmup_steps: int = 0
    """Linear warm-up steps."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient clipping."""
    algo: Algo = "grpo"
    """grpo: group-relative advantages (with critiques, Critique-GRPO); rft: rejection-sampling
    fine-tuning, the verifier-only baseline: the same rollouts, trained only on the verified
    successes, each with weight 1 (RAFT, arXiv 2504.11343; expert iteration, arXiv 2403.04642)."""
    loss_type: LossType = "dapo"
    """Loss aggregation over tokens."""
    scale: AdvantageScale = "group"
    """Advantage std: per group, per batch, or none (only centred)."""
    epsilon_low: float = 0.2
    """Lower clip range of the importance ratio."""
    epsilon_high: float = 0.2
    """Upper clip range of the importance ratio (DAPO's clip-higher when larger)."""
    beta: float = 0.0
    """KL (k3) weight to the frozen starting model; 0 disables it and the reference model."""
    num_iterations: int = 1
    """Updates per rollout batch (old log-probs are the stored sampling ones)."""
    micro_batch_size: int = 4
    """Most trajectories per forward/backward, longest first and fewer for long ones (rows x width
    and rows x width^2 within `trainer.rollout.TOKEN_BUDGET` and `ATTENTION_BUDGET`, as in SFT);
    the loss does not depend on it. A model whose loss pass runs rows as a prefix tree (Llama and
    Qwen2 layouts: `agents.local.prefix_tree`) sizes GRPO's micro-batches by tree nodes alone,
    within `TOKEN_BUDGET`, and SFT's by this."""
    zero_std: ZeroStd = "keep"
    """Groups whose rewards are all equal: keep, drop, or resample once."""
    mask_truncated: bool = False
    """Exclude trajectories with a turn cut at max_new_tokens from the loss."""
    sampling: SamplingOptions = SamplingOptions(max_new_tokens=96)
    """How rollouts and refinements sample (log-probs use its temperature); its max_new_tokens is
    96 here, shorter turns being faster, and its seed is always the run's `seed`. Flags and flat
    dicts (`TrainConfig.from_dict`) name its fields directly: --temperature, --top-p, --max-new-tokens."""
    critique: str = "none"
    """Critique-GRPO: none | indicative | ground_truth | step | model:<policy-spec>."""
    refine_k: int = 2
    """Refinements kept per triggered group (correct ones first)."""
    refine_attempts: int = 4
    """Failed attempts per triggered group that get a critique and a refinement rollout."""
    refine_fail_fraction: float = 1.0
    """Trigger refinement when at least this share of a group failed (1.0 = all failed)."""
    gamma: float = 0.1
    """Policy-shaping constant of Critique-GRPO: ratio p / (p + gamma) on refinements."""
    shaping: bool = True
    """Use shaped ratios on refinements (off: the plain clipped ratio, for ablations)."""
    credit: Credit = "episode"
    """episode: every token of an episode gets its group-relative advantage; turn: plus the turn's
    own credit from the env's step critiques (`trainer.losses.turn_advantages`)."""
    turn_weight: float = 1.0
    """With credit="turn": the weight of the standardised turn return beside the episode advantage."""
    turn_gamma: float = 0.9
    """With credit="turn": the discount of later turns' rewards in a turn's return, in [0, 1]."""
    eval_every: int = 0
    """Evaluate on the test split every N steps (0: only before and after)."""
    eval_episodes: int = 50
    """Test episodes per evaluation; 0 skips test evaluation (before/after come back as None)."""
    eval_temperature: float = 0.0
    """Temperature for evaluations (0 = greedy)."""
    save_every: int = 0
    """Checkpoint every N steps (0: only the final one)."""
    time_budget_s: float = 0.0
    """Stop after this many seconds of training (0: no limit)."""
    seed: int = 0
    """Seeds tasks, sampling and initialisation."""
    rollout_groups: int = 0
    """Groups sampled together in one batch, for rollouts and refinements alike (0: all of a
    process's groups of an env at once). Each batch's sampler is seeded by (seed, step, its first
    group), so with 1 a run samples the same under any number of torchrun processes."""
    workers: int = 1
    """Threads stepping a batch's envs, in rollouts and evaluations (pays when tools wait on I/O; 1: inline)."""
    device: str = "cpu"
    """Where the trainer's fp32 weights live and the update runs: cpu, cuda or cuda:N. Under
    torchrun, cuda puts each rank on cuda:LOCAL_RANK and the gradients go over NCCL."""
    served: str = ""
    """Sample rollouts and refinements from this OpenAI-compatible server (its /v1 base URL, e.g.
    http://127.0.0.1:8000/v1) instead of in process. The trainer pushes its weights there every
    push_every steps, saved under OUT/served/ (a path the server must be able to read); the
    evaluations still run in process. `vllm:` samples from an in-process vLLM engine on this
    machine's GPU instead (the vllm extra). Empty: sample with the trainer's own model."""
    vllm_memory: float = 0.3
    """With served='vllm:': the share of the GPU's memory vLLM may take (the trainer's model shares the GPU)."""
    served_engine: ServedEngine = "transformers"
    """The server behind `served`: transformers (transformers serve; each push saves a full
    checkpoint that the server loads by path) or vllm (vllm serve --enable-lora; each push
    hot-loads a LoRA adapter, so it needs lora_r > 0)."""
    push_every: int = 1
    """With `served`: push the weights every N optimizer steps; rollouts in between sample from
    weights up to N-1 steps old (metrics log `served/staleness`)."""
    lora_r: int = 16
    """LoRA rank via peft on every linear layer, the CPU default for RL (0: full fine-tuning)."""
    trainable: Trainable = "all"
    """Which weights GRPO updates: all, only the attention projections, or all but the embeddings."""
    progress: bool = True
    """Show a progress bar."""

    def __post_init__(self) -> None:
        sampling = SamplingOptions(**self.sampling) if isinstance(self.sampling, dict) else self.sampling  # as to_dict writes it
        object.__setattr__(self, "sampling", dataclasses.replace(sampling, seed=self.seed))
        for name, choices in (("algo", ALGOS), ("loss_type", LOSS_TYPES), ("scale", ADVANTAGE_SCALES), ("zero_std", ZERO_STD), ("trainable", TRAINABLE), ("served_engine", SERVED_ENGINES), ("credit", CREDITS)):
            _choice(name, getattr(self, name), choices)
        if not (self.critique in CRITIQUE_STYLES or self.critique.startswith("model:")):
            raise ConfigError(f"critique={self.critique!r}: choose one of {list(CRITIQUE_STYLES)} or 'model:<policy-spec>'.{did_you_mean(self.critique, CRITIQUE_STYLES)}")
        if not self.model:
            raise ConfigError("model is required (a local directory or hub name)")
        for ok, message in self._range_checks():
            if not ok:
                raise ConfigError(message)
        self._check_envs()

    def _check_envs(self) -> None:
        if len(set(self.envs)) != len(self.envs):
            raise ConfigError(f"envs={list(self.envs)}: an env is listed twice; raise its weight in env_weights instead")
        if self.env_weights and len(self.env_weights) != len(self.env_ids):
            raise ConfigError(f"env_weights has {len(self.env_weights)} values for {len(self.env_ids)} envs ({list(self.env_ids)}): give one weight per env")
        if any(not w > 0 for w in self.env_weights):
            raise ConfigError(f"env_weights must all be > 0, got {list(self.env_weights)}")
        if self._per_env_kwargs and (missing := [e for e in self.env_ids if e not in self.env_kwargs]):
            raise ConfigError(f"env_kwargs is keyed by env id but lacks {missing[0]!r}; give every env an entry (an empty {{}} is fine)")

    def _range_checks(self) -> list[tuple[bool, str]]:
        at_least_one = ("steps", "tasks_per_step", "micro_batch_size", "num_iterations", "refine_attempts", "workers", "push_every")
        at_least_zero = ("rollout_groups", "task_pool", "eval_episodes", "eval_every", "save_every", "warmup_steps", "seed", "lora_r", "refine_k", "time_budget_s", "weight_decay", "beta", "eval_temperature", "epsilon_low", "epsilon_high")
        return [
            *((getattr(self, n) >= 1, f"{n} must be >= 1, got {getattr(self, n)}") for n in at_least_one),
            *((getattr(self, n) >= 0, f"{n} must be >= 0, got {getattr(self, n)}") for n in at_least_zero),
            (self.group_size >= 2, f"group_size must be >= 2, got {self.group_size}: GRPO compares trajectories within a group"),
            (self.learning_rate > 0, f"learning_rate must be > 0, got {self.learning_rate}"),
            (self.max_grad_norm > 0, f"max_grad_norm must be > 0, got {self.max_grad_norm}"),
            (self.gamma > 0, f"gamma must be > 0, got {self.gamma}"),
            (0 < self.refine_fail_fraction <= 1, f"refine_fail_fraction must be in (0, 1], got {self.refine_fail_fraction}"),
            (0 <= self.turn_gamma <= 1, f"turn_gamma must be in [0, 1], got {self.turn_gamma}"),
            (self.turn_weight >= 0, f"turn_weight must be >= 0, got {self.turn_weight}"),
            (self.algo == "grpo" or self.credit == "episode", "credit='turn' adds to GRPO's advantages; algo='rft' has none"),
            (not self.served or self.served == VLLM_IN_PROCESS or self.served.startswith(("http://", "https://")), f"served must be an http(s) base URL such as http://127.0.0.1:8000/v1, or {VLLM_IN_PROCESS!r} for in-process vLLM, got {self.served!r}"),
            (0 < self.vllm_memory <= 1, f"vllm_memory must be in (0, 1], got {self.vllm_memory}"),
            (DEVICE.fullmatch(self.device) is not None, f"device must be cpu, cuda or cuda:N, got {self.device!r}"),
            (self.algo == "grpo" or self.critique == "none", f"algo='rft' trains on the policy's own verified successes only; critique={self.critique!r} needs algo='grpo'"),
            (self.served == VLLM_IN_PROCESS or not self.served or self.served_engine != "vllm" or self.lora_r > 0, "served_engine='vllm' hot-loads LoRA adapters each push: set lora_r > 0 (or serve with transformers serve)"),
        ]

    @property
    def model_path(self) -> str:
        return self.model.removeprefix("hf:")

    @property
    def env_ids(self) -> tuple[str, ...]:
        """The envs this run trains on, in order (`envs`, or just `env_id`)."""
        return self.envs or (self.env_id,)

    @property
    def env_probabilities(self) -> tuple[float, ...]:
        """`env_weights` normalised to sum to 1 (equal without weights)."""
        weights = self.env_weights or (1.0,) * len(self.env_ids)
        return tuple(w / sum(weights) for w in weights)

    @property
    def _per_env_kwargs(self) -> bool:
        return keyed_by_env(self.env_kwargs, self.env_ids)

    def kwargs_for(self, env_id: str, split: str) -> dict[str, Any]:
        """The kwargs `env_id` is built with for `split`."""
        return {**env_kwargs_for(self.env_kwargs, self.env_ids, env_id), "split": split}

    @property
    def train_env_kwargs(self) -> dict[str, Any]:
        return self.kwargs_for(self.env_ids[0], "train")

    @property
    def test_env_kwargs(self) -> dict[str, Any]:
        return self.kwargs_for(self.env_ids[0], "test")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        """A config from flat values, as JSON overrides write them: the sampling settings may be
        named directly (``{"temperature": 0.7}``) or nested (``{"sampling": {...}}``)."""
        names = {f.name for f in dataclasses.fields(cls)}
        sampling_names = {f.name for f in dataclasses.fields(SamplingOptions)} - {"seed"}
        if unknown := sorted(set(values) - names - sampling_names):
            raise ConfigError(f"TrainConfig has no field {unknown[0]!r}.{did_you_mean(unknown[0], sorted(names | sampling_names))}")
        flat = {k: values[k] for k in sampling_names if k in values}
        nested = values.get("sampling", cls.sampling)
        sampling = dataclasses.replace(SamplingOptions(**nested) if isinstance(nested, dict) else nested, **flat)
        return cls(**{k: v for k, v in values.items() if k in names} | {"sampling": sampling})


# How long, how often, where and how fast a run goes: a resume may change these, not what it learns.
RESUME_MAY_CHANGE = frozenset({
    "steps", "time_budget_s", "progress", "eval_every", "eval_episodes", "eval_temperature", "save_every", "out",
    "workers", "device", "served", "served_engine", "push_every", "vllm_memory", "micro_batch_size", "rollout_groups",
})  # fmt: skip


def resume_conflicts(saved: Mapping[str, Any], config: TrainConfig) -> list[str]:
    """How `config` differs from the run it would resume (`saved`, as `TrainConfig.to_dict` wrote
    it), outside `RESUME_MAY_CHANGE`: one line per field, empty when it is the same run."""
    try:
        before = _as_json(TrainConfig.from_dict(dict(saved)).to_dict())
    except (ConfigError, TypeError, ValueError) as exc:
        return [f"its saved config does not load ({exc})"]
    now = _as_json(config.to_dict())
    return [f"{name} was {before[name]!r}, now {value!r}" for name, value in now.items() if name not in RESUME_MAY_CHANGE and before.get(name) != value]


def _as_json(values: dict[str, Any]) -> dict[str, Any]:
    """As a JSON file holds it (tuples as lists), so a saved config and a live one compare equal."""
    return json.loads(json.dumps(values, default=str))


def keyed_by_env(env_kwargs: dict[str, Any], env_ids: tuple[str, ...] | list[str]) -> bool:
    """Whether `env_kwargs` gives each env its own kwargs: several envs, every key one of them."""
    return len(env_ids) > 1 and bool(env_kwargs) and all(k in env_ids and isinstance(v, dict) for k, v in env_kwargs.items())


def env_kwargs_for(env_kwargs: dict[str, Any], env_ids: tuple[str, ...] | list[str], env_id: str) -> dict[str, Any]:
    """`env_id`'s own kwargs (see TrainConfig.env_kwargs), without the split."""
    return dict(env_kwargs.get(env_id, {})) if keyed_by_env(env_kwargs, env_ids) else dict(env_kwargs)


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r}: choose one of {list(choices)}.{did_you_mean(value, choices)}")


__all__ = ["LOSS_TYPES", "ConfigError", "TrainConfig", "ZeroStd", "env_kwargs_for", "keyed_by_env"]
