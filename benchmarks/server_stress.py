"""Can clients wear a server down? Open-and-drop cycles on every route, reply times, memory.

Usage: python -m cgym.benchmarks.server_stress --cycles 1000 --warmup 1000 --json benchmarks/results/server_stress.json

`cgym serve` (OpenEnv) runs as a child process. After `--warmup` cycles on `/ws`, on each route
it names (`/ws`, `/health`, `/metadata`, `/schema`) a client opens a connection, makes one request
(on `/ws` a reset and one turn), and drops it, half the time without a close frame; the server's
resident memory is read from `/proc` every quarter of the cycles. Then every session slot must
still open (none leaked), and the per-session memory is measured with every slot holding an
episode of `max_turns` turns of the longest action the env keeps whole (the bound a client can
reach). `cgym serve --mcp` gets the same number of requests (reads, bad calls, bad lines) on its
one episode, after as many warm-up requests. Every reply's time is kept: the floor is that none takes over a second.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cgym.benchmarks.output import emit

ENV = "cgym/ApiReport-v0"
KWARGS = {"difficulty": "easy"}
HTTP_ROUTES = ("/health", "/metadata", "/schema")


def rss_mb(pid: int) -> float:
    """Resident memory of process `pid` (Linux `/proc`)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_openenv(port: int, max_sessions: int) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "cgym", "serve", ENV, "--env-kwargs", json.dumps(KWARGS), "--port", str(port), "--max-sessions", str(max_sessions)]
    server = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server
        except OSError:
            time.sleep(0.2)
    server.kill()
    raise RuntimeError(f"cgym serve did not listen on port {port}: {server.stderr.read().decode()[-2000:] if server.stderr else ''}")


def http_get(port: int, path: str, drop: bool) -> float:
    """One GET on a fresh connection; seconds to the reply's first bytes. `drop`: close before reading it all."""
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n".encode())
        head = sock.recv(64)
        took = time.perf_counter() - start
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"GET {path}: {head!r}")
        if not drop:
            while sock.recv(65536):
                pass
    return took


REFUSED = {"count": 0}  # session opens refused (403) while the server was still freeing dropped sessions


def open_session(port: int, patience_s: float = 30.0) -> Any:
    """A new /ws connection; a refusal (every slot this client may hold still busy) is waited out and counted."""
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    deadline = time.monotonic() + patience_s
    while True:
        try:
            return connect(f"ws://127.0.0.1:{port}/ws", max_size=None, open_timeout=30)
        except InvalidStatus:
            REFUSED["count"] += 1
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def ws_episode(port: int, drop: bool, turn: str = "hello") -> list[float]:
    """Reset and one turn on a fresh /ws session; the seconds each reply took. `drop`: no close frame."""
    times = []
    ws = open_session(port)
    for message in ({"type": "reset", "data": {"seed": 0}}, {"type": "step", "data": {"text": turn}}):
        start = time.perf_counter()
        ws.send(json.dumps(message))
        reply = json.loads(ws.recv(timeout=30))
        times.append(time.perf_counter() - start)
        if reply["type"] != "observation":
            raise RuntimeError(f"/ws {message['type']}: {reply}")
    if drop:  # gone without a close frame, as a killed client goes (the kernel still ends the TCP stream)
        ws.socket.shutdown(socket.SHUT_RDWR)
        ws.socket.close()
    else:
        ws.close()
    return times


def cycles(pid: int, n: int, one: Callable[[bool], list[float]]) -> dict[str, Any]:
    """`n` open-and-drop cycles of `one`; reply times and the server's memory every quarter."""
    times: list[float] = []
    memory = [round(rss_mb(pid), 1)]
    for i in range(n):
        times += one(i % 2 == 1)
        if (i + 1) % max(n // 4, 1) == 0:
            memory.append(round(rss_mb(pid), 1))
    times.sort()
    return {"cycles": n, "requests": len(times), "max_reply_s": round(times[-1], 4), "p99_reply_s": round(times[int(0.99 * (len(times) - 1))], 4), "rss_mb": memory}


def every_slot_opens(port: int, max_sessions: int, turn: str, turns: int) -> list[Any]:
    """Fill every session slot at once with an episode of `turns` turns (a leaked session would refuse one)."""
    from websockets.sync.client import connect

    time.sleep(2)  # let the last dropped sessions go
    sockets = [connect(f"ws://127.0.0.1:{port}/ws", max_size=None, open_timeout=30) for _ in range(max_sessions)]
    for ws in sockets:
        ws.send(json.dumps({"type": "reset", "data": {"seed": 0}}))
        reply = json.loads(ws.recv(timeout=30))
        if reply["type"] != "observation":
            raise RuntimeError(f"a session slot did not open after the cycles: {reply}")
        for _ in range(turns):
            ws.send(json.dumps({"type": "step", "data": {"text": turn}}))
            json.loads(ws.recv(timeout=30))
    return sockets


def openenv(n: int, max_sessions: int, warmup: int = 20) -> dict[str, Any]:
    from cgym.envs.core import MAX_ACTION_CHARS
    from cgym.envs.registration import make

    max_turns = make(ENV, **KWARGS).unwrapped.max_turns
    port = free_port()
    server = start_openenv(port, max_sessions)
    try:
        fresh = rss_mb(server.pid)
        for i in range(warmup):  # warm up: imports, first envs and sessions, the allocator's pools
            ws_episode(port, drop=i % 2 == 1)
        warmed = {"cycles": warmup, "rss_mb": [round(fresh, 1), round(rss_mb(server.pid), 1)]}
        routes = {"/ws": cycles(server.pid, n, lambda drop: ws_episode(port, drop))}
        for path in HTTP_ROUTES:
            routes[path] = cycles(server.pid, n, lambda drop, path=path: [http_get(port, path, drop)])
        idle = rss_mb(server.pid)
        longest = "x" * (MAX_ACTION_CHARS - 1)  # kept whole: the largest turn a session stores
        held = every_slot_opens(port, max_sessions, longest, max_turns - 1)  # the last turn would end the episode
        full = rss_mb(server.pid)
        for ws in held:
            ws.close()
        return {
            "warmup": warmed,
            "max_sessions": max_sessions,
            "max_turns": max_turns,
            "max_action_chars": MAX_ACTION_CHARS,
            "routes": routes,
            "every_slot_opened_after_the_cycles": True,
            "opens_refused_while_freeing": REFUSED["count"],
            "rss_idle_mb": round(idle, 1),
            "rss_every_slot_full_mb": round(full, 1),
            "per_session_mb": round((full - idle) / max_sessions, 2),
        }
    finally:
        server.terminate()
        server.wait(timeout=30)


def mcp(n: int, warmup: int = 0) -> dict[str, Any]:
    """`n` requests to one `cgym serve --mcp` episode (after `warmup` more): reads, a bad tool call, an unreadable line."""
    server = subprocess.Popen([sys.executable, "-m", "cgym", "serve", ENV, "--mcp", "--env-kwargs", json.dumps(KWARGS)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert server.stdin is not None and server.stdout is not None
    kinds = [
        {"method": "tools/list"},
        {"method": "resources/read", "params": {"uri": "cgym://episode/result"}},
        {"method": "tools/call", "params": {"name": "no_such_tool", "arguments": {"x": "y" * 10_000}}},
        None,  # a line that is not JSON
    ]

    def ask(i: int) -> list[float]:
        kind = kinds[i % len(kinds)]
        start = time.perf_counter()
        server.stdin.write(("not json " * 100 if kind is None else json.dumps({"jsonrpc": "2.0", "id": i + 1, **kind})) + "\n")  # type: ignore[union-attr]
        server.stdin.flush()  # type: ignore[union-attr]
        server.stdout.readline()  # type: ignore[union-attr]
        return [time.perf_counter() - start]

    init = {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "stress", "version": "0"}}
    server.stdin.write(json.dumps({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": init}) + "\n")
    server.stdin.flush()
    server.stdout.readline()
    try:
        fresh = rss_mb(server.pid)
        for i in range(warmup):
            ask(i)
        warmed = {"requests": warmup, "rss_mb": [round(fresh, 1), round(rss_mb(server.pid), 1)]}
        count = iter(range(warmup, warmup + n))
        measured = cycles(server.pid, n, lambda _drop: ask(next(count)))
    finally:
        server.stdin.close()
        server.wait(timeout=30)
    return {"warmup": warmed, **measured}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=1000, help="open-and-drop cycles per route (and MCP requests)")
    parser.add_argument("--max-sessions", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=20, help="/ws open-and-drop cycles before the measured ones (memory is read before and after)")
    parser.add_argument("--note", default="", help="a note kept in the JSON (e.g. the machine's load)")
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    result: dict[str, Any] = {"env": ENV, "env_kwargs": KWARGS, "cpus": os.cpu_count(), "openenv": openenv(args.cycles, args.max_sessions, args.warmup), "mcp": mcp(args.cycles, args.warmup)}
    replies = [route["max_reply_s"] for route in result["openenv"]["routes"].values()] + [result["mcp"]["max_reply_s"]]
    result["every_reply_within_1s"] = max(replies) < 1.0
    result["wall_s"] = round(time.perf_counter() - started, 1)
    if args.note:
        result["note"] = args.note
    emit(result, args.json)


if __name__ == "__main__":
    main()
