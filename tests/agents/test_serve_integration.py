"""OpenAIPolicy against a real `transformers serve` (OpenAI-compatible) running the tiny model.

Needs the serving extra (`pip install 'critique-gym[serving]'`: fastapi, uvicorn, openai) and
`agents.tiny`; skips with the reason otherwise. Everything runs offline on CPU, on 127.0.0.1.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from agents.base import Conversation, Turn
from agents.openai_server import OpenAIPolicy

SERVE_PACKAGES = ("fastapi", "uvicorn", "openai")  # what transformers' is_serve_available() checks
STARTUP_BUDGET_S = 60.0
REQUEST_TIMEOUT_S = 20.0

CORPUS = [
    "Find the customer Ada Lovelace and report her open orders as JSON.",
    '<tool_call>{"name": "search_customers", "arguments": {"query": "Ada"}}</tool_call>',
    '<tool_response>[{"id": 7, "name": "Ada Lovelace"}]</tool_response>',
    '{"customer_id": 7, "open_orders": 2, "total": 41.5}',
] * 10

SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search_customers",
        "description": "Search customers by name.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}


def _missing_requirements() -> str | None:
    missing = [name for name in SERVE_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        return f"`transformers serve` needs {', '.join(missing)}: pip install 'critique-gym[serving]'"
    if importlib.util.find_spec("transformers.cli.serve") is None:
        return "this transformers version has no `transformers serve` CLI"
    if importlib.util.find_spec("agents.tiny") is None:
        return "agents.tiny (the embedded tiny model) is not available yet"
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(process: subprocess.Popen, url: str, deadline: float, log: Path) -> None:
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"transformers serve exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    pytest.fail(f"transformers serve was not healthy within {STARTUP_BUDGET_S:.0f}s:\n{log.read_text()[-3000:]}")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)


@pytest.mark.slow
def test_openai_policy_against_transformers_serve(tmp_path: Path) -> None:
    reason = _missing_requirements()
    if reason:
        pytest.skip(reason)
    from agents.tiny import build_tiny

    started = time.monotonic()
    model_dir = build_tiny(
        tmp_path / "tiny", CORPUS, vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        max_positions=512, seed=0,
    )
    port = _free_port()
    log = tmp_path / "serve.log"
    env = os.environ | {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_DISABLE_UPDATE_CHECK": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HOME": str(tmp_path / "hf_home"),
    }
    command = [
        sys.executable, "-m", "transformers.cli.transformers", "serve", str(model_dir),
        "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--dtype", "float32",
    ]
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        _wait_healthy(process, f"http://127.0.0.1:{port}/health", started + STARTUP_BUDGET_S, log)
        plain = Conversation(messages=[{"role": "user", "content": "Find the customer Ada."}])
        with_tools = Conversation(
            messages=[
                {"role": "system", "content": "You are a shop agent."},
                {"role": "user", "content": "Find the customer Ada."},
                {"role": "assistant", "content": CORPUS[1]},
                {"role": "tool", "name": "search_customers", "content": '[{"id": 7}]'},
            ],
            tools=[SEARCH_TOOL],
        )
        with OpenAIPolicy(
            str(model_dir), f"http://127.0.0.1:{port}/v1", max_tokens=12, timeout_s=REQUEST_TIMEOUT_S, max_retries=0
        ) as policy:
            turns = policy.act([plain, with_tools])
        assert len(turns) == 2
        assert all(isinstance(turn, Turn) and isinstance(turn.text, str) for turn in turns)
        assert all(turn.token_ids == () for turn in turns)  # a remote policy keeps no token ledger
    finally:
        _stop(process)
    assert process.poll() is not None
