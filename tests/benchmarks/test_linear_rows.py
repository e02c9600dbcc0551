"""The linear-layer timing by rows: SmolLM2's weights, one row of figures per row count."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cgym.benchmarks import linear_rows


def test_a_row_of_figures_per_row_count_and_the_weights_are_smollm2s(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear_rows, "LAYERS", 1)  # one decoder layer keeps the test quick
    monkeypatch.setattr(linear_rows, "matmul_peak_gflops", lambda dtype: 100.0)
    linear_rows.main(["--rows", "1", "3", "--json", str(tmp_path / "out.json")])
    result = json.loads((tmp_path / "out.json").read_text())
    assert [row["rows"] for row in result["rows"]] == [1, 3]
    assert all(row["ms"] > 0 and row["gflops"] > 0 for row in result["rows"])
    assert result["matmul_peak_gflops"] == 100.0 and result["machine"]["cores"] >= 1


def test_a_full_model_s_linear_weights_are_135m_numbers() -> None:
    params = linear_rows.LAYERS * sum(o * i for o, i in linear_rows.layer_shapes()) + linear_rows.VOCAB * linear_rows.HIDDEN
    assert 134e6 < params < 135e6  # SmolLM2-135M without its norms
