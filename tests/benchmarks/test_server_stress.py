"""The server stress benchmark: a small run of its CLI writes the JSON it documents."""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import pytest

pytest.importorskip("openenv.core")
pytest.importorskip("mcp")

from cgym.benchmarks.server_stress import main  # noqa: E402
from cgym.envs.integrations.openenv import cap_malloc_arenas  # noqa: E402


def test_small_run_cycles_every_route_and_fills_every_slot_after(tmp_path: Path) -> None:
    out = tmp_path / "server_stress.json"
    main(["--cycles", "8", "--max-sessions", "2", "--warmup", "4", "--note", "test", "--json", str(out)])
    result = json.loads(out.read_text())
    routes = result["openenv"]["routes"]
    assert set(routes) == {"/ws", "/health", "/metadata", "/schema"}
    assert result["openenv"]["warmup"]["cycles"] == 4 and len(result["openenv"]["warmup"]["rss_mb"]) == 2
    assert routes["/ws"]["requests"] == 16 and all(len(route["rss_mb"]) == 5 for route in routes.values())
    assert result["openenv"]["every_slot_opened_after_the_cycles"] and isinstance(result["openenv"]["per_session_mb"], float)
    assert result["mcp"]["requests"] == 8 and result["mcp"]["warmup"]["requests"] == 4 and len(result["mcp"]["rss_mb"]) == 5
    assert result["note"] == "test"
    assert isinstance(result["every_reply_within_1s"], bool)  # a figure, not a timed assertion


def test_the_arena_cap_takes_where_the_c_library_is_glibc() -> None:
    assert cap_malloc_arenas() is (sys.platform == "linux" and platform.libc_ver()[0] == "glibc")
