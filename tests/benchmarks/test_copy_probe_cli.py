from __future__ import annotations

from pathlib import Path

import pytest
from cgym.benchmarks.copy_probe import probe


@pytest.mark.slow
def test_probe_runs_end_to_end_on_a_saved_model(tiny_chat_model: Path) -> None:
    report = probe([str(tiny_chat_model)], "cgym/ApiReport-v0", {"difficulty": "easy"}, range(10_000, 10_004))
    assert report["episodes"] == 4
    fields = report["models"][str(tiny_chat_model)]
    assert "customer_id" in fields and ({"email", "city"} <= set(fields) or {"tier", "signup_date"} <= set(fields))
    assert all(0.0 <= f["copied"] <= 1.0 and 0.0 <= f["p_value"] <= 1.0 for f in fields.values())
