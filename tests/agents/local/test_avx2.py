"""Which build of the kernels a CPU gets (`agents.local.kernels.isa`). On a CPU without AVX-512
every kernel test runs the AVX2 build (`agents.local.avx2`)."""

from __future__ import annotations

import pytest
from cgym.agents.local import kernels
from cgym.agents.local.kernels import ISA_ENV

ZEN4 = "fpu sse2 avx avx2 fma f16c avx512f avx512dq avx512bw avx512vl avx512_bf16"
ZEN3 = "fpu sse2 avx avx2 fma f16c bmi2"


@pytest.mark.parametrize(
    ("flags", "forced", "isa", "has"),
    [
        (ZEN4, "", "avx512", ["-mavx512f", "-mavx512bf16"]),
        (ZEN4.replace(" avx512_bf16", ""), "", "avx512", ["-mavx512f"]),
        (ZEN4, "avx2", "avx2", ["-mavx2", "-mf16c"]),
        (ZEN3, "", "avx2", ["-mavx2", "-mfma", "-mf16c"]),
        (ZEN3, "avx512", "avx2", ["-mavx2"]),  # only AVX2 can be asked for
        ("fpu sse2 avx", "", None, []),
    ],
    ids=["zen4", "ice-lake", "zen4-asked-avx2", "zen3", "zen3-asked-avx512", "no-avx2"],
)
def test_the_build_follows_the_cpu_flags(monkeypatch: pytest.MonkeyPatch, flags: str, forced: str, isa: str | None, has: list[str]) -> None:
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset(flags.split()))
    monkeypatch.setenv(ISA_ENV, forced)
    assert kernels.isa() == isa and kernels.available() == (isa is not None)
    if isa is not None:
        build = kernels.flags()
        assert all(flag in build for flag in has)
        assert ("-mavx512f" in build) == (isa == "avx512") and ("-mavx512bf16" in build) == (isa == "avx512" and "avx512_bf16" in flags)
