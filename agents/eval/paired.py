"""Paired comparisons of two arms on the same test episodes: the per-episode difference in
success with a bootstrap interval, so +5 points can be told from noise.

Two arms evaluated on the same seeds differ only where their outcomes differ; pairing removes
the episodes' own difficulty from the variance (Efron and Tibshirani, "An Introduction to the
Bootstrap", 1993, ch. 13: percentile intervals). With several training seeds, each resample
draws seeds and then episodes with replacement (a two-level bootstrap), so the interval carries
the seed-to-seed spread as well as the episodes'.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

RESAMPLES = 10_000
CONFIDENCE = 0.95


@dataclass(frozen=True)
class PairedDifference:
    """`after - before` in success rate over paired episodes (fractions; x100 for points)."""

    mean: float
    """Mean per-episode difference (averaged over seeds)."""
    low: float
    """Lower end of the bootstrap interval."""
    high: float
    """Upper end of the bootstrap interval."""
    confidence: float
    """The interval's coverage (0.95: a 95% interval)."""
    episodes: int
    """Paired episodes per seed."""
    seeds: int
    """Training seeds (rows) pooled."""
    gained: int
    """Episodes (over all seeds) that only `after` solved."""
    lost: int
    """Episodes (over all seeds) that only `before` solved."""

    @property
    def differing(self) -> int:
        """Episodes where the two arms' outcomes differ (all of them, whatever a report shows)."""
        return self.gained + self.lost

    def points(self) -> str:
        """'+12.0 points [+5.0, +19.0]' (95% interval)."""
        return f"{100 * self.mean:+.1f} points [{100 * self.low:+.1f}, {100 * self.high:+.1f}]"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"differing": self.differing}


def paired_difference(
    before: Sequence[float] | Sequence[Sequence[float]],
    after: Sequence[float] | Sequence[Sequence[float]],
    *,
    resamples: int = RESAMPLES,
    confidence: float = CONFIDENCE,
    seed: int = 0,
) -> PairedDifference:
    """Outcomes (1 success, 0 failure; or any score) of two arms on the same episodes, as
    (episodes,) or (seeds, episodes) arrays -> the mean of `after - before` and its percentile
    bootstrap interval."""
    a, b = _as_grid(before), _as_grid(after)
    if a.shape != b.shape:
        raise ValueError(f"before and after must pair up episode by episode; got shapes {a.shape} and {b.shape}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    diff = b - a  # (S, E)
    means = _bootstrap_means(diff, resamples, np.random.default_rng(seed))
    tail = (1 - confidence) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return PairedDifference(
        mean=float(diff.mean()), low=float(low), high=float(high), confidence=confidence,
        episodes=diff.shape[1], seeds=diff.shape[0], gained=int((diff > 0).sum()), lost=int((diff < 0).sum()),
    )  # fmt: skip


def _as_grid(values: Sequence[float] | Sequence[Sequence[float]]) -> np.ndarray:
    grid = np.asarray(values, dtype=np.float64)
    if grid.ndim == 1:
        grid = grid[None, :]
    if grid.ndim != 2 or grid.shape[1] == 0:
        raise ValueError(f"outcomes must be (episodes,) or (seeds, episodes) with at least one episode, got shape {grid.shape}")
    return grid


def _bootstrap_means(diff: np.ndarray, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """(S, E) differences -> (resamples,) means, each over seeds then episodes drawn with replacement."""
    seeds, episodes = diff.shape
    rows = rng.integers(0, seeds, size=(resamples, seeds)) if seeds > 1 else np.zeros((resamples, 1), dtype=np.int64)
    cols = rng.integers(0, episodes, size=(resamples, seeds, episodes))
    return diff[rows[:, :, None], cols].mean(axis=(1, 2))
