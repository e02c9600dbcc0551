"""`keep_freed_memory`: large freed tensors stay with the process for reuse (no page faults on
the next one), and `CGYM_MALLOC=default` opts out; `release_freed_memory` hands them back."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
from cgym.agents.local.allocator import keep_freed_memory

glibc = pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")

RELEASED = """
import sys, torch
from cgym.agents.local.allocator import keep_freed_memory, release_freed_memory
print(keep_freed_memory(), file=sys.stderr)
def resident(): return int(open("/proc/self/statm").read().split()[1]) * 4096
x = [torch.ones(64 << 20, dtype=torch.uint8)]
if "cycle" in sys.argv:
    x.append(x)  # freed by the collector, not when the last name goes
before = resident()
del x
if "release" in sys.argv:
    release_freed_memory()
print(before - resident())
"""


def released_bytes(env: dict[str, str], *args: str) -> int:
    """Resident bytes a child process gives back when it drops a 64 MiB tensor (held in a
    reference cycle with "cycle"; then released with "release")."""
    done = subprocess.run([sys.executable, "-c", RELEASED, *args], capture_output=True, text=True, check=True, env=env)
    return int(done.stdout.strip())


@glibc
def test_freed_tensors_stay_with_the_process() -> None:
    base = {k: v for k, v in os.environ.items() if k != "CGYM_MALLOC"}
    assert released_bytes(base) < 1 << 20  # kept for the next allocation
    assert released_bytes({**base, "CGYM_MALLOC": "default"}) > 60 << 20  # glibc's default: unmapped at once


@glibc
def test_released_memory_goes_back_to_the_os() -> None:
    """A phase's garbage, cycles too, leaves the process's resident size when it is released."""
    base = {k: v for k, v in os.environ.items() if k != "CGYM_MALLOC"}
    assert released_bytes(base, "cycle") < 1 << 20
    assert released_bytes(base, "cycle", "release") > 60 << 20


def test_opt_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CGYM_MALLOC", "default")
    keep_freed_memory.cache_clear()
    try:
        assert keep_freed_memory() is False
    finally:
        keep_freed_memory.cache_clear()
