"""Per-step metrics: JSONL log, the reward-hacking monitor, and the learning-curve plot."""

from __future__ import annotations

import json
import resource
import sys
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from cgym.trainer.rollout import Trajectory

HACKING_THRESHOLD = 0.5
HACKING_PATIENCE = 3
_MAXRSS_UNIT = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux


def peak_rss_gb() -> float:
    """This process's resident-memory high-water mark so far, in GiB (it never goes down)."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * _MAXRSS_UNIT / 2**30, 2)


@dataclass(frozen=True)
class Outcome:
    """What the metrics read of one trajectory: small and picklable, so torchrun ranks can
    gather every rank's outcomes and log metrics of the whole global batch."""

    reward: float
    success: bool
    truncated: bool
    refined: bool = False
    env_id: str = ""
    breakdown: dict[str, float] = field(default_factory=dict)
    codes: tuple[str, ...] = ()

    @classmethod
    def of(cls, t: Trajectory, env_id: str = "") -> Outcome:
        breakdown, codes = (dict(t.result.breakdown), tuple(t.result.codes)) if t.result else ({}, ())
        return cls(t.reward, t.success, t.truncated, t.refined, env_id, breakdown, codes)


def rollout_metrics(trajectories: Sequence[Trajectory | Outcome], group_size: int) -> dict[str, Any]:
    """Reward, success, per-check means, critique codes and group statistics of initial attempts."""
    initial = [t if isinstance(t, Outcome) else Outcome.of(t) for t in trajectories if not t.refined]
    rewards = np.array([t.reward for t in initial])
    groups = rewards.reshape(-1, group_size)
    checks = sorted({name for t in initial for name in t.breakdown})
    codes = Counter(code for t in initial for code in t.codes)
    return {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "success_rate": float(np.mean([t.success for t in initial])),
        "frac_zero_std": float(np.mean(groups.std(axis=1) == 0)),
        "checks": {c: float(np.mean([t.breakdown.get(c, 0.0) for t in initial])) for c in checks},
        "critique_codes": dict(codes.most_common()),
        "truncated_rate": float(np.mean([t.truncated for t in initial])),
        "hacking/top_quartile_failed": top_quartile_failed(initial),
        "hacking/failed_outscoring": failed_outscoring(initial),
    }


def env_metrics(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """`env/<id>/...`: each env's share of the initial attempts, their success and mean reward."""
    initial = [o for o in outcomes if not o.refined]
    row: dict[str, Any] = {}
    for env_id in dict.fromkeys(o.env_id for o in initial):
        own = [o for o in initial if o.env_id == env_id]
        row[f"env/{env_id}/share"] = len(own) / len(initial)
        row[f"env/{env_id}/success_rate"] = float(np.mean([o.success for o in own]))
        row[f"env/{env_id}/reward_mean"] = float(np.mean([o.reward for o in own]))
    return row


def top_quartile_failed(trajectories: Sequence[Trajectory | Outcome]) -> float:
    """Share of top-quartile-reward trajectories that did not succeed (high score, wrong answer)."""
    if not trajectories:
        return 0.0
    rewards = np.array([t.reward for t in trajectories])
    cut = np.quantile(rewards, 0.75)
    top = [t for t in trajectories if t.reward >= cut]
    return float(np.mean([not t.success for t in top]))


def failed_outscoring(trajectories: Sequence[Trajectory | Outcome]) -> float:
    """Share of failed trajectories whose reward reaches the lowest successful one (0 without successes).

    A rubric that gates correctness keeps this at 0 even when successes are rare and the top
    quartile is all near misses; above 0, wrong answers are paid like right ones.
    """
    wins = [t.reward for t in trajectories if t.success]
    losses = [t.reward for t in trajectories if not t.success]
    if not wins or not losses:
        return 0.0
    return float(np.mean(np.array(losses) >= min(wins)))


class HackingMonitor:
    """Warns loudly when high-reward, unsuccessful trajectories persist: fix the reward first.

    It fires after `patience` steps in a row where more than `threshold` of the top-quartile
    trajectories failed *and* some failure scored as high as a success; a top quartile of near
    misses that the reward still ranks below every success is not hacking.
    """

    def __init__(self, threshold: float = HACKING_THRESHOLD, patience: int = HACKING_PATIENCE) -> None:
        self.threshold = threshold
        self.patience = patience
        self.streak = 0

    def update(self, share: float, outscoring: float) -> str | None:
        """Returns the warning text when it fires (after `patience` steps in a row)."""
        self.streak = self.streak + 1 if share > self.threshold and outscoring > 0 else 0
        if self.streak < self.patience:
            return None
        message = (
            f"reward hacking? for {self.streak} steps, {share:.0%} of top-quartile-reward trajectories did not succeed "
            f"and {outscoring:.0%} of failures scored as high as a success: "
            "check that high-scoring answers meet the goal and fix the rubric before training longer"
        )
        warnings.warn(message, stacklevel=2)
        return message


class MetricsLog:
    """Appends one JSON object per step to OUT/metrics.jsonl (resumed runs append)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, row: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(row, default=float) + "\n")

    def rows(self) -> list[dict[str, Any]]:
        """Every readable row, in order; a line that does not parse (torn by a crash) is skipped."""
        if not self.path.exists():
            return []
        return [row for line in self.path.read_text(errors="replace").splitlines() if isinstance(row := _parse(line), dict)]


def _parse(line: str) -> Any:
    try:
        return json.loads(line)
    except ValueError:
        return None


def rolling_mean(values: Sequence[float], window: int) -> list[float]:
    """Mean of the last `window` values at each position (fewer at the start)."""
    sums = np.cumsum(np.concatenate([[0.0], np.asarray(values, dtype=float)]))
    return [float((sums[i + 1] - sums[max(0, i + 1 - window)]) / min(i + 1, window)) for i in range(len(values))]


def plot_curve(rows: Sequence[dict[str, Any]], path: Path, *, title: str = "training") -> Path:
    """Train reward/success per step, and test success at each evaluation, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in rows if "reward_mean" in r]
    steps = [r["step"] for r in train]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, key, label in ((left, "reward_mean", "train reward (mean)"), (right, "success_rate", "train success")):
        values = [r[key] for r in train]
        ax.plot(steps, values, color="C0", alpha=0.3, label=label, marker="o" if len(steps) < 10 else None)  # a short run still shows its points
        if len(values) >= 10:
            ax.plot(steps, rolling_mean(values, 10), color="C0", label=f"{label}, mean of 10 steps")
    left.set_xlabel("step")
    left.set_ylabel("reward")
    left.grid(alpha=0.3)
    left.legend(loc="upper left", fontsize=8)
    evals = [r for r in rows if "eval/success_rate" in r]
    if evals:
        right.plot([r["step"] for r in evals], [r["eval/success_rate"] for r in evals], "o-", color="C1", label="test success (greedy)")
    right.set_ylim(-0.02, 1.02)
    right.set_xlabel("step")
    right.set_ylabel("success rate")
    right.grid(alpha=0.3)
    right.legend(loc="upper left", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
