"""What a benchmark result says of the machine it ran on (`benchmarks.output.machine`)."""

from __future__ import annotations

import builtins
import io
from typing import Any

import pytest
from cgym.benchmarks import output

ZEN5 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC
flags\t\t: fpu avx2 avx512f

processor\t: 1
cpu family\t: 99
model\t\t: 99
model name\t: another
"""


def _reading(text: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    real = builtins.open

    def fake(path: Any, *args: Any, **kwargs: Any) -> Any:
        if str(path) != "/proc/cpuinfo":
            return real(path, *args, **kwargs)
        if text is None:
            raise PermissionError(path)
        return io.StringIO(text)

    monkeypatch.setattr(builtins, "open", fake)


def test_the_machine_names_the_first_cpus_family_and_model(monkeypatch: pytest.MonkeyPatch) -> None:
    _reading(ZEN5, monkeypatch)
    seen = output.machine()
    assert (seen["cpu"], seen["family"], seen["model"]) == ("AMD EPYC", 26, 2)
    assert seen["kernels"] in ("avx512", "avx2", None) and seen["cores"] >= 1 and seen["compute_dtype"] in ("bfloat16", "float32")


def test_a_machine_without_cpuinfo_still_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    _reading(None, monkeypatch)
    seen = output.machine()
    assert seen["family"] is None and seen["model"] is None and isinstance(seen["cpu"], str)
