"""A real `transformers serve` on 127.0.0.1 with the tiny model: OpenAIPolicy against it, and
training whose rollouts it samples, with the weights pushed to it every step (`trainer.samplers.served`).

Needs fastapi, uvicorn and openai (the serving extra; the test extra has them through
openenv-core) and `trainer.tiny`; skips with the reason otherwise. Offline, CPU only. One server,
started without a model, serves every test: each request names the model directory it wants.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import ClassVar

import httpx
import numpy as np
import pytest
import torch
from cgym.agents.base import Conversation, Turn
from cgym.agents.options import SamplingOptions
from cgym.agents.remote.openai_client import OpenAIPolicy
from cgym.envs.core import AgentEnv, SimpleTask
from cgym.envs.episode import Episode
from cgym.envs.rubric import Check, CheckResult, Rubric
from cgym.trainer.samplers.served import ServedPolicy
from transformers import AutoModelForCausalLM, AutoTokenizer

pytestmark = pytest.mark.slow

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
    if importlib.util.find_spec("cgym.trainer.tiny") is None:
        return "trainer.tiny (the embedded tiny model) is not available yet"
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


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    """(tiny model directory, base URL) of a `transformers serve` that loads models by path."""
    reason = _missing_requirements()
    if reason:
        pytest.skip(reason)
    from cgym.trainer.tiny import build_tiny

    root = tmp_path_factory.mktemp("serve")
    started = time.monotonic()
    model_dir = build_tiny(
        root / "tiny", CORPUS, vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        max_positions=512, seed=0,
    )
    port = _free_port()
    log = root / "serve.log"
    env = os.environ | {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_DISABLE_UPDATE_CHECK": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HOME": str(root / "hf_home"),
        "OMP_NUM_THREADS": "1",
    }
    command = [
        sys.executable, "-m", "transformers.cli.transformers", "serve",
        "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--dtype", "float32",
    ]  # fmt: skip
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        _wait_healthy(process, f"http://127.0.0.1:{port}/health", started + STARTUP_BUDGET_S, log)
        yield model_dir, f"http://127.0.0.1:{port}/v1"
    finally:
        _stop(process)
    assert process.poll() is not None


def test_openai_policy_against_transformers_serve(server) -> None:
    model_dir, base_url = server
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
    with OpenAIPolicy(str(model_dir), base_url, sampling=SamplingOptions(max_new_tokens=12), timeout_s=REQUEST_TIMEOUT_S, max_retries=0) as policy:
        turns = policy.act([plain, with_tools])
    assert len(turns) == 2
    assert all(isinstance(turn, Turn) and isinstance(turn.text, str) for turn in turns)
    assert all(turn.token_ids == () for turn in turns)  # a remote policy keeps no token ledger


def test_pushed_weights_reach_the_server(server, tmp_path: Path) -> None:
    """Greedy replies follow each push: the starting weights talk, a model whose head scores every
    token alike picks id 0 (a special token, which the reply's text leaves out) and says nothing,
    and the starting weights talk again."""
    model_dir, base_url = server
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    served = ServedPolicy(tokenizer, base_url, sampling=SamplingOptions(temperature=0.0, max_new_tokens=8), timeout_s=REQUEST_TIMEOUT_S)
    start = {name: p.detach().clone() for name, p in model.named_parameters()}

    def reply(step: int) -> str:
        served.push(model, step, tmp_path / "served")
        return served.act([Conversation(messages=[{"role": "user", "content": CORPUS[0]}])])[0].text

    assert tokenizer.convert_ids_to_tokens(0) in tokenizer.all_special_tokens
    first = reply(0)
    with torch.no_grad():
        model.get_output_embeddings().weight.zero_()
    silent = reply(1)
    model.load_state_dict(start, strict=False)
    again = reply(2)
    served.close()
    assert first and silent == "" and again == first
    assert served.prompt_mismatches == 0  # the server tokenized each prompt to the ledger's length
    assert sorted(p.name for p in (tmp_path / "served").iterdir()) == ["step-2"]


class _OneWord(AgentEnv):
    """One turn; the reward is the share of 'a' characters in the answer."""

    system_prompt: ClassVar[str] = "Answer."
    rubric = Rubric([Check("share_of_a", lambda episode: CheckResult((share := _share_of_a(episode)) >= 0.5, share), 1.0)])

    def __init__(self, **kwargs: object) -> None:
        super().__init__(max_turns=1)

    def sample_task(self, rng: np.random.Generator, *, seed: int | None, options: dict | None) -> SimpleTask:
        return SimpleTask(id="word", prompt="Write a word.")


def _share_of_a(episode: Episode) -> float:
    text = episode.final_answer or ""
    return text.count("a") / max(len(text), 1)


def test_training_samples_from_the_server_and_pushes_each_step(server, tmp_path: Path) -> None:
    """`TrainConfig.served`: rollouts come from the server, the weights move, every step's
    rollouts used the previous step's weights, and only the newest version stays on disk."""
    from cgym.trainer.config import TrainConfig
    from cgym.trainer.grpo import train

    model_dir, base_url = server
    out = tmp_path / "run"
    config = TrainConfig(
        env_id="one-word", model=str(model_dir), out=str(out), steps=2, group_size=4, tasks_per_step=2, learning_rate=3e-3,
        sampling=SamplingOptions(max_new_tokens=6), eval_episodes=0, progress=False, served=base_url, lora_r=0,
    )  # fmt: skip
    train(config, make_env=lambda split: _OneWord())

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["served/weights_step"] for r in rows] == [0, 1]
    assert [r["served/staleness"] for r in rows] == [0, 0]
    assert all(r["served/prompt_mismatches"] == 0 and r["served/push_s"] > 0 and r["train_tokens"] > 0 for r in rows)
    assert sorted(p.name for p in (out / "served").iterdir()) == ["step-2"]
    trained = AutoModelForCausalLM.from_pretrained(out / "final").state_dict()
    start = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert any(not torch.equal(trained[k], start[k]) for k in start)
