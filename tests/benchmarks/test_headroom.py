"""The headroom benchmark's split option."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.headroom import SPLITS, parse_split


def test_split_names_env_and_difficulty() -> None:
    assert parse_split("api:medium") == ("cgym/ApiReport-v0", "medium")
    assert parse_split("sql:hard") == ("cgym/SqlQuery-v0", "hard")
    assert len({parse_split(s) for s in SPLITS}) == len(SPLITS)


@pytest.mark.parametrize("bad", ["api", "api:", "web:easy", ":easy"])
def test_bad_split_is_a_usage_error(bad: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="--split"):
        parse_split(bad)
