from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch
from cgym.agents.options import SamplingOptions
from cgym.envs.core import AgentEnv
from cgym.envs.critique import Critique
from cgym.envs.episode import Episode
from cgym.envs.rubric import Check, CheckResult, Rubric
from cgym.trainer.config import TrainConfig
from cgym.trainer.grpo import setup, train, train_step
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.slow


class _Task:
    id = "toy"
    prompt = "Write a word."
    ground_truth = "aaaa"


def _share_of_a(episode: Episode) -> CheckResult:
    text = episode.final_answer or ""
    share = text.count("a") / max(len(text), 1)
    return CheckResult(share >= 0.5, share)


class ToyEnv(AgentEnv):
    """One turn; the reward is the share of 'a' characters in the answer."""

    system_prompt: ClassVar[str] = "Answer."
    rubric = Rubric([Check("share_of_a", _share_of_a, 1.0)])

    def __init__(self, **kwargs) -> None:
        super().__init__(max_turns=1)

    def sample_task(self, rng: np.random.Generator, *, seed: int | None, options: dict | None) -> _Task:
        return _Task()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from cgym.trainer.tiny import build_tiny

    words = ["banana", "apple", "cat", "dog", "tree", "sky", "aaa", "baba", "zzz", "hello", "world", "data"]
    rng = np.random.default_rng(0)
    corpus = [" ".join(rng.choice(words, 12)) for _ in range(400)]
    return build_tiny(tmp_path_factory.mktemp("tiny"), corpus, vocab_size=300, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, max_positions=512)


def _config(model: Path, out: Path, **overrides) -> TrainConfig:
    base = dict(env_id="toy", model=str(model), out=str(out), steps=10, group_size=8, tasks_per_step=2, learning_rate=3e-3, sampling=SamplingOptions(max_new_tokens=8), micro_batch_size=8, progress=False, seed=0, lora_r=0)
    return TrainConfig(**{**base, **overrides})


def _toy(split: str) -> ToyEnv:
    return ToyEnv()


class _WordyTask(_Task):
    def __init__(self, seed: int) -> None:
        words = ["banana", "apple", "cat", "dog", "tree", "sky", "hello", "world"]
        self.id = f"wordy-{seed}"
        self.prompt = "Write a word after these: " + " ".join(words[(seed + i) % len(words)] for i in range(12))


class WordyToyEnv(ToyEnv):
    """ToyEnv whose tasks differ by seed in a prompt long enough to share within a group."""

    def sample_task(self, rng: np.random.Generator, *, seed: int | None, options: dict | None) -> _Task:
        return _WordyTask(seed or 0)


def test_weights_move_loss_is_finite_and_reward_rises(tiny_model: Path, tmp_path: Path) -> None:
    before = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    config = _config(tiny_model, tmp_path / "run", steps=12)
    train(config, make_env=_toy)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(np.isfinite(r["loss"]) for r in rows)
    rewards = [r["reward_mean"] for r in rows]
    assert np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.05, rewards
    after = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final").state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert (tmp_path / "run" / "curve.png").stat().st_size > 1000
    for key in ("reward_std", "success_rate", "frac_zero_std", "kl", "entropy", "clip_frac_low", "clip_frac_high", "tokens_per_s", "step_time_s", "critique_codes", "checks", "hacking/top_quartile_failed"):
        assert key in rows[0], key
    assert all(0 < r["memory/peak_after_sampling_gb"] <= r["memory/peak_gb"] for r in rows)  # high-water marks only rise
    assert all(a["memory/peak_gb"] <= b["memory/peak_gb"] for a, b in zip(rows, rows[1:]))


def test_the_update_runs_without_the_rollouts_cached_turns(tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sampler's per-conversation keys/values are stale once the weights move, and memory
    while the loss pass runs: the update must find them gone."""
    import cgym.trainer.grpo as grpo

    held: list[int] = []
    update = grpo._update
    monkeypatch.setattr(grpo, "_update", lambda state, *a, **kw: held.append(state.policy.turn_cache.bytes) or update(state, *a, **kw))
    train(_config(tiny_model, tmp_path / "run", steps=2), make_env=_toy)
    assert held == [0, 0]


def test_resume_continues_exactly(tiny_model: Path, tmp_path: Path) -> None:
    straight = _config(tiny_model, tmp_path / "straight", steps=3)
    train(straight, make_env=_toy)
    interrupted = _config(tiny_model, tmp_path / "resumed", steps=2, save_every=2)
    train(interrupted, make_env=_toy)
    resumed = _config(tiny_model, tmp_path / "resumed", steps=3, save_every=2)
    train(resumed, make_env=_toy, resume=True)

    def step3(run: str) -> dict:
        rows = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return next(r for r in rows if r["step"] == 3)

    a, b = step3("straight"), step3("resumed")
    for key in ("reward_mean", "loss", "entropy", "grad_norm", "train_tokens"):
        assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key


def test_env_workers_reach_the_rollout_and_leave_the_step_unchanged(tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`workers` steps the rollout's envs on threads; the step's figures are those of 1 worker."""
    import cgym.trainer.grpo

    seen: list[int] = []
    real = cgym.trainer.grpo.run_episodes

    def spy(*args, **kwargs):
        seen.append(kwargs["workers"])
        return real(*args, **kwargs)

    monkeypatch.setattr(cgym.trainer.grpo, "run_episodes", spy)
    rows = [train_step(setup(_config(tiny_model, tmp_path / f"w{n}", workers=n), make_env=_toy), 1) for n in (1, 3)]
    assert seen == [1, 3]
    for key in ("reward_mean", "loss", "train_tokens"):
        assert rows[0][key] == pytest.approx(rows[1][key], rel=1e-5, abs=1e-6), key


def test_micro_batch_split_does_not_change_the_update(tiny_model: Path, tmp_path: Path) -> None:
    """Same rollout, 1 vs 4 micro-batches: same loss and same gradient (SGD with lr 1 exposes it)."""
    rows = []
    for micro in (16, 4):
        state = setup(_config(tiny_model, tmp_path / f"mb{micro}", micro_batch_size=micro), make_env=_toy)
        start = [p.detach().clone() for p in state.model.parameters()]
        state.optimizer = torch.optim.SGD(state.model.parameters(), lr=1.0)
        state.scheduler = torch.optim.lr_scheduler.LambdaLR(state.optimizer, lambda s: 1.0)
        row = train_step(state, 1)
        rows.append((row, [p.detach() - s for p, s in zip(state.model.parameters(), start)]))
    (row_a, grads_a), (row_b, grads_b) = rows
    assert row_a["train_tokens"] == row_b["train_tokens"]
    assert row_a["loss"] == pytest.approx(row_b["loss"], rel=1e-4, abs=1e-6)
    assert any(g.abs().max() > 0 for g in grads_a)
    assert all(torch.allclose(x, y, atol=1e-5, rtol=1e-4) for x, y in zip(grads_a, grads_b))


def _flat_first_group(state, step):
    """A step's rollout with its first group's rewards made equal: the group then has nothing to learn."""
    import cgym.trainer.grpo as grpo

    trajs = grpo._rollout_groups(state, [0, 1], [state.config.env_id] * 2, step)
    for t in trajs:
        if t.group == 0:
            t.reward = 0.25
    return trajs


@pytest.mark.parametrize("flat_groups", [1, 2], ids=["one-flat-group", "all-flat"])
def test_rows_with_nothing_to_learn_never_run_and_leave_the_update_unchanged(tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flat_groups: int) -> None:
    """A group whose rewards are all equal has advantage 0 on every token: skipping its rows must
    give the update (and loss) of running them, and the loss pass must not see them."""
    import cgym.trainer.grpo as grpo

    fed: list[int] = []
    for name in ("sequence_logprobs", "tree_logprobs"):  # the padded pass, or the prefix tree's
        real = getattr(grpo, name)
        monkeypatch.setattr(grpo, name, lambda model, ids, *a, real=real, **kw: fed.append(ids.shape[0]) or real(model, ids, *a, **kw))
    results = {}
    for skip in (True, False):
        if not skip:
            monkeypatch.setattr(grpo, "rows_with_signal", lambda batch, with_kl=False: list(range(batch.ids.shape[0])))
        state = setup(_config(tiny_model, tmp_path / f"skip{skip}", micro_batch_size=4), make_env=_toy)
        state.optimizer = torch.optim.SGD(state.model.parameters(), lr=1.0)
        state.scheduler = torch.optim.lr_scheduler.LambdaLR(state.optimizer, lambda s: 1.0)
        trajs = _flat_first_group(state, 1)
        if flat_groups == 2:
            for t in trajs:
                t.reward = 0.25
        advantages, _, _ = grpo._advantages(state, trajs)
        start = [p.detach().clone() for p in state.model.parameters()]
        fed.clear()
        row = grpo._update(state, trajs, advantages, 1)
        results[skip] = (row, [p.detach() - s for p, s in zip(state.model.parameters(), start)], sum(fed))
    (row_a, moves_a, fed_a), (row_b, moves_b, fed_b) = results[True], results[False]
    assert fed_b == 16 and fed_a == 16 - 8 * flat_groups
    assert row_a["trained_rows"] == 16 - 8 * flat_groups
    assert row_a["train_tokens"] == row_b["train_tokens"]  # metrics still count every row
    assert row_a["loss"] == pytest.approx(row_b["loss"], rel=1e-4, abs=1e-6)
    assert all(torch.allclose(x, y, atol=1e-6, rtol=1e-4) for x, y in zip(moves_a, moves_b))
    assert any(m.abs().max() > 0 for m in moves_a) == (flat_groups == 1)


def test_a_groups_shared_columns_run_once_to_the_same_update(tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Micro-batches that keep a group's rows together run the columns they share past the
    batch's head once; the update is that of rows sorted by length, each run whole."""
    import cgym.agents.local.sampling as sampling
    import cgym.trainer.grpo as grpo
    from cgym.trainer.rollout import micro_batches

    shared_runs: list[int] = []
    real_shared = sampling._prefix_shared_logprobs

    def spy(model, ids, *args, **kwargs):
        if kwargs["head"] is not None:  # columns past the batch's head
            shared_runs.append(ids.shape[0])
        return real_shared(model, ids, *args, **kwargs)

    monkeypatch.setattr(sampling, "_prefix_shared_logprobs", spy)
    monkeypatch.setattr(grpo, "takes_trees", lambda model: False)  # the padded pass (the prefix tree's: below)
    real_logprobs = grpo.sequence_logprobs
    results = []
    for grouped in (True, False):
        if not grouped:
            monkeypatch.setattr(grpo, "group_micro_batches", lambda ids, groups, most: micro_batches([len(row) for row in ids], most))
            monkeypatch.setattr(grpo, "sequence_logprobs", lambda *a, **kw: real_logprobs(*a, **{**kw, "share_prefix": False}))
        state = setup(_config(tiny_model, tmp_path / f"grouped{grouped}", micro_batch_size=4), make_env=lambda split: WordyToyEnv())
        state.optimizer = torch.optim.SGD(state.model.parameters(), lr=1.0)
        state.scheduler = torch.optim.lr_scheduler.LambdaLR(state.optimizer, lambda s: 1.0)
        trajs = grpo._rollout_groups(state, [0, 1], [state.config.env_id] * 2, 1)
        advantages, _, _ = grpo._advantages(state, trajs)
        start = [p.detach().clone() for p in state.model.parameters()]
        shared_runs.clear()
        row = grpo._update(state, trajs, advantages, 1)
        results.append((row, [p.detach() - s for p, s in zip(state.model.parameters(), start)], list(shared_runs)))
    (row_a, moves_a, runs_a), (row_b, moves_b, runs_b) = results
    assert runs_a and not runs_b  # the grouped update shared columns past the head; the other did not
    assert row_a["loss"] == pytest.approx(row_b["loss"], rel=1e-4, abs=1e-6)
    assert any(m.abs().max() > 0 for m in moves_a)
    assert all(torch.allclose(x, y, atol=1e-6, rtol=1e-4) for x, y in zip(moves_a, moves_b))


def test_the_prefix_tree_update_is_that_of_rows_run_whole(tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The update merges each group's rows into a prefix tree, each micro-batch one forward of
    its nodes: the loss and weights of rows sorted by length, each run whole, and fewer ids run."""
    import cgym.trainer.grpo as grpo
    from cgym.trainer.rollout import micro_batches

    fed: list[int] = []
    results = []
    for tree in (True, False):
        if not tree:
            monkeypatch.setattr(grpo, "takes_trees", lambda model: False)
            monkeypatch.setattr(grpo, "group_micro_batches", lambda ids, groups, most: micro_batches([len(row) for row in ids], most))
            real_logprobs = grpo.sequence_logprobs
            monkeypatch.setattr(grpo, "sequence_logprobs", lambda *a, real_logprobs=real_logprobs, **kw: real_logprobs(*a, **{**kw, "share_prefix": False}))
        state = setup(_config(tiny_model, tmp_path / f"tree{tree}", micro_batch_size=4), make_env=lambda split: WordyToyEnv())
        state.optimizer = torch.optim.SGD(state.model.parameters(), lr=1.0)
        state.scheduler = torch.optim.lr_scheduler.LambdaLR(state.optimizer, lambda s: 1.0)
        trajs = grpo._rollout_groups(state, [0, 1], [state.config.env_id] * 2, 1)
        advantages, _, _ = grpo._advantages(state, trajs)
        start = [p.detach().clone() for p in state.model.parameters()]
        fed.clear()
        body = state.model.get_base_model().model if hasattr(state.model, "get_base_model") else state.model.model
        hook = body.register_forward_pre_hook(lambda _, args, kwargs: fed.append(kwargs["input_ids"].numel()), with_kwargs=True)
        row = grpo._update(state, trajs, advantages, 1)
        hook.remove()
        results.append((row, [p.detach() - s for p, s in zip(state.model.parameters(), start)], sum(fed), len(fed)))
    (row_a, moves_a, ids_a, calls_a), (row_b, moves_b, ids_b, calls_b) = results
    assert ids_a < ids_b and calls_a == 1 + 2  # the head, then one tree per group
    assert row_a["loss"] == pytest.approx(row_b["loss"], rel=1e-4, abs=1e-6)
    assert any(m.abs().max() > 0 for m in moves_a)
    assert all(torch.allclose(x, y, atol=1e-6, rtol=1e-4) for x, y in zip(moves_a, moves_b))


def test_rows_past_the_token_budget_are_recomputed_to_the_same_update(tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a budget every row passes, the head and each micro-batch run under recomputed layers,
    and the step's loss and weights come out as without."""
    import cgym.trainer.recompute as recompute

    entered: list[int] = []
    real = recompute.recomputed_layers

    def spy(model):
        entered.append(1)
        return real(model)

    monkeypatch.setattr(recompute, "recomputed_layers", spy)
    results = []
    for budget in (10**9, 1):
        monkeypatch.setattr(recompute, "TOKEN_BUDGET", budget)
        state = setup(_config(tiny_model, tmp_path / f"budget{budget}", micro_batch_size=4), make_env=_toy)
        state.optimizer = torch.optim.SGD(state.model.parameters(), lr=1.0)
        state.scheduler = torch.optim.lr_scheduler.LambdaLR(state.optimizer, lambda s: 1.0)
        start = [p.detach().clone() for p in state.model.parameters()]
        entered.clear()
        row = train_step(state, 1)
        results.append((row, [p.detach() - s for p, s in zip(state.model.parameters(), start)], len(entered)))
    (row_a, moves_a, entered_a), (row_b, moves_b, entered_b) = results
    assert entered_a == 0 and entered_b >= 2  # the head, then every micro-batch
    assert row_a["loss"] == pytest.approx(row_b["loss"], rel=1e-5, abs=1e-7)
    assert any(m.abs().max() > 0 for m in moves_a)
    assert all(torch.allclose(x, y, atol=1e-6, rtol=1e-4) for x, y in zip(moves_a, moves_b))


@pytest.mark.parametrize("trainable,moved,frozen", [("attention", ("self_attn",), ("mlp", "norm", "embed_tokens")), ("no_embeddings", ("self_attn", "mlp", "norm"), ("embed_tokens",))])
def test_trainable_limits_which_weights_move(tiny_model: Path, tmp_path: Path, trainable: str, moved: tuple[str, ...], frozen: tuple[str, ...]) -> None:
    state = setup(_config(tiny_model, tmp_path / trainable, trainable=trainable), make_env=_toy)
    start = {name: p.detach().clone() for name, p in state.model.named_parameters()}
    train_step(state, 1)
    changed = {name for name, p in state.model.named_parameters() if not torch.equal(p, start[name])}
    assert all(any(part in name for name in changed) for part in moved), sorted(changed)
    assert not any(part in name for name in changed for part in frozen), sorted(changed)


@pytest.mark.parametrize(
    "overrides",
    [{"loss_type": "dapo2"}, {"zero_std": "ignore"}, {"critique": "steps"}, {"group_size": 1}, {"trainable": "mlp"},
     {"served": "ftp://host/v1"}, {"served_engine": "sglang"}, {"push_every": 0}, {"served": "http://127.0.0.1:8000/v1", "served_engine": "vllm", "lora_r": 0}],
    ids=["loss", "zero-std", "critique", "group", "trainable", "served-scheme", "served-engine", "push-every", "vllm-needs-lora"],
)  # fmt: skip
def test_config_is_validated_at_parse_time(tmp_path: Path, overrides: dict) -> None:
    with pytest.raises(ValueError):
        _config(tmp_path, tmp_path, **overrides)


def test_task_pool_draws_from_the_first_seeds_only(tiny_model: Path, tmp_path: Path) -> None:
    from cgym.trainer.grpo import _draw_tasks

    pooled = _config(tiny_model, tmp_path, task_pool=3)
    seeds = _draw_tasks(pooled, np.random.default_rng(0), 200)
    assert set(seeds) == {0, 1, 2}
    assert seeds == _draw_tasks(pooled, np.random.default_rng(0), 200)
    assert len(set(_draw_tasks(_config(tiny_model, tmp_path), np.random.default_rng(0), 200))) == 200
    with pytest.raises(ValueError, match="task_pool"):
        _config(tiny_model, tmp_path, task_pool=-1)
    with pytest.raises(ValueError, match="eval_episodes"):
        _config(tiny_model, tmp_path, eval_episodes=-1)


@pytest.mark.parametrize(("first_scored", "expected"), [(30, 24), (18, 18), (10, None)], ids=["whole-prefix", "cut-at-first-target", "too-short"])
def test_the_batch_head_stops_at_the_shared_prefix_and_the_first_scored_target(monkeypatch: pytest.MonkeyPatch, first_scored: int, expected: int | None) -> None:
    import cgym.trainer.heads as heads

    ids = torch.cat([torch.arange(24).repeat(3, 1), torch.arange(100, 136).reshape(3, 12)], 1)  # rows share 24 ids, then differ
    mask = torch.zeros(3, 35)
    mask[1, first_scored:] = 1
    monkeypatch.setattr(heads, "shared_head", lambda model, head_ids: len(head_ids))
    assert heads.batch_head(torch.nn.Linear(2, 2), ids, torch.ones_like(ids), mask) == expected


def _critiqued_share_of_a(episode: Episode) -> CheckResult:
    share = _share_of_a(episode).score
    return CheckResult(True, share) if share > 0 else CheckResult.fail(Critique(episode.final_step, "no_a", "The answer has no 'a'."))


class CritiquedToy(ToyEnv):
    """ToyEnv that an answer with any 'a' passes and whose failures carry a critique, so turn credit has something to read."""

    rubric = Rubric([Check("share_of_a", _critiqued_share_of_a, 1.0)])


def test_turn_credit_reaches_the_loss(tiny_model: Path, tmp_path: Path) -> None:
    from cgym.trainer.grpo import setup, train_step

    rows = {}
    for credit in ("episode", "turn"):
        state = setup(_config(tiny_model, tmp_path / credit, steps=1, credit=credit, turn_weight=2.0), make_env=lambda split: CritiquedToy())
        rows[credit] = train_step(state, 1)
    assert rows["turn"]["reward_mean"] == rows["episode"]["reward_mean"]  # the same rollouts ...
    assert rows["turn"]["grad_norm"] != pytest.approx(rows["episode"]["grad_norm"])  # ... other advantages
