"""`cgym serve` over OpenEnv, and `openenv/Remote-v0`: a served env scores the same turns as the local one.

The server runs in a thread on a loopback port. Scripted agents need the typed task, which stays on
the server, so each agent plays locally and its turns are replayed against the served env.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("openenv.core")

import httpx
import uvicorn
from cgym.agents.base import Conversation, Turn
from cgym.agents.eval.episodes import EpisodeResult, run_episodes
from cgym.agents.scripted import ScriptedPolicy
from cgym.envs.core import ResetNeeded
from cgym.envs.errors import InvalidEnvKwargError
from cgym.envs.integrations.openenv import REMOTE_ENV_ID, RemoteEnvError, build_app
from cgym.envs.registration import takes_kwarg
from gymnasium.utils.env_checker import check_env
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from cgym import envs
from cgym.cli import main

ENV = "cgym/ApiReport-v0"
KWARGS = {"difficulty": "medium"}
SEEDS = [0, 1, 2]


@dataclass
class Served:
    url: str
    server: Any  # openenv's HTTPEnvServer

    def sessions_become(self, n: int, timeout_s: float = 10.0) -> int:
        """The server's session count once it equals `n` (or whatever it is at the timeout)."""
        deadline = time.monotonic() + timeout_s
        while self.server.active_sessions != n and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.server.active_sessions


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    yield from _serve(build_app(ENV, env_kwargs=KWARGS, max_sessions=8))


@pytest.fixture(scope="module")
def guarded() -> Iterator[Served]:
    """A server with a token whose clients may hold two sessions each."""
    yield from _serve(build_app(ENV, env_kwargs=KWARGS, max_sessions=8, sessions_per_client=2, token=TOKEN))


TOKEN = "s3cret-t0ken"


def _serve(app: Any) -> Iterator[Served]:
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "the OpenEnv server did not start"
    yield Served(f"http://127.0.0.1:{sock.getsockname()[1]}", app.state.env_server)
    server.should_exit = True
    thread.join(timeout=10)


class Replay:
    """Plays recorded turns again: the n-th turn of the episode whose task has that id."""

    name = "replay"

    def __init__(self, results: Sequence[EpisodeResult]) -> None:
        self.turns = {r.task_id: [t.text for t in r.turns] for r in results}

    def act(self, batch: Sequence[Conversation]) -> list[Turn]:
        return [Turn(self.turns[conv.task.id][sum(m["role"] == "assistant" for m in conv.messages)]) for conv in batch]


def local_results(agent: str) -> list[EpisodeResult]:
    return run_episodes(lambda: envs.make(ENV, split="test", **KWARGS), ScriptedPolicy(agent), SEEDS)


def remote(served: Served, **kwargs: Any) -> Any:
    return envs.make(REMOTE_ENV_ID, url=served.url, split="test", **kwargs)


@pytest.mark.parametrize("agent", ["oracle", "wrong_field", "missing_argument"])
def test_replayed_turns_score_as_they_do_locally(served: Served, agent: str) -> None:
    local = local_results(agent)
    remote_results = run_episodes(lambda: remote(served), Replay(local), SEEDS, batch_size=len(SEEDS))  # one session each, at once
    for here, there in zip(local, remote_results, strict=True):
        assert (there.task_id, there.reward, there.success, there.truncated) == (here.task_id, here.reward, here.success, here.truncated)
        assert (there.breakdown, there.passed, there.critiques) == (here.breakdown, here.passed, here.critiques)
        assert there.conversation.messages == here.conversation.messages
        for style in ("indicative", "ground_truth", "step"):
            assert there.critique(style) == here.critique(style)
    assert agent == "oracle" or any(r.critiques for r in remote_results), "a flawed agent's critiques must cross the wire"
    assert served.sessions_become(0) == 0


def test_two_sessions_play_at_once_and_each_has_its_own_env(served: Served) -> None:
    local = {r.seed: r for r in local_results("oracle")[:2]}
    first, second = remote(served), remote(served)
    assert served.sessions_become(2) == 2
    (_, info_a), (_, info_b) = first.reset(seed=0), second.reset(seed=1)
    assert (info_a["task_id"], info_b["task_id"]) == (local[0].task_id, local[1].task_id)
    rewards: dict[int, float] = {}
    for turn in range(max(len(r.turns) for r in local.values())):  # interleave the two episodes turn by turn
        for seed, env in ((0, first), (1, second)):
            if turn < len(local[seed].turns):
                _, reward, terminated, truncated, _ = env.step(local[seed].turns[turn].text)
                if terminated or truncated:
                    rewards[seed] = reward
    assert rewards == {0: local[0].reward, 1: local[1].reward}
    first.close()
    second.close()
    assert served.sessions_become(0) == 0


def test_a_dropped_client_frees_its_session(served: Served) -> None:
    with connect(served.url.replace("http://", "ws://") + "/ws") as ws:
        ws.send(json.dumps({"type": "reset", "data": {"seed": 0}}))
        assert json.loads(ws.recv(timeout=10))["type"] == "observation"
        assert served.sessions_become(1) == 1
        ws.socket.shutdown(socket.SHUT_RDWR)  # gone without a close message or a close frame
        assert served.sessions_become(0) == 0


def test_remote_env_passes_gymnasiums_check_env(served: Served) -> None:
    env = remote(served)
    check_env(env.unwrapped)
    env.close()
    assert served.sessions_become(0) == 0


def test_split_reaches_the_server(served: Served) -> None:
    def task_id(env: Any) -> str:
        _, info = env.reset(seed=0)
        env.close()
        return info["task_id"]

    local_train = task_id(envs.make(ENV, split="train", **KWARGS))
    assert task_id(envs.make(REMOTE_ENV_ID, url=served.url, split="train")) == local_train
    assert task_id(remote(served)) != local_train
    with closing(remote(served)) as there, closing(envs.make(ENV, **KWARGS)) as here:
        assert there.unwrapped.max_turns == here.unwrapped.max_turns  # the trainer sizes its token budget by it
    assert takes_kwarg(REMOTE_ENV_ID, "split")  # so `cgym eval` and `cgym train` pass theirs


def test_episodes_run_over_websocket_sessions_only(served: Served) -> None:
    assert httpx.get(f"{served.url}/health").json() == {"status": "healthy"}
    assert httpx.get(f"{served.url}/metadata").json()["name"] == ENV
    assert httpx.post(f"{served.url}/step", json={"action": {"text": "hi"}}).status_code == 404  # a fresh env per request holds no episode
    request = {"jsonrpc": "2.0", "id": 1, "method": "openenv/session/create", "params": {}}
    assert httpx.post(f"{served.url}/mcp", json=request).status_code in (404, 405)  # sessions that never expired came from here
    with pytest.raises(Exception):  # noqa: B017 - the handshake is refused, however websockets words it
        connect(served.url.replace("http://", "ws://") + "/mcp", open_timeout=5).close()
    assert served.sessions_become(0) == 0


def _eventually(attempt: Any, timeout_s: float = 10.0, refused: type[Exception] = RemoteEnvError) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return attempt()
        except refused:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_a_token_guards_every_route_but_health(guarded: Served) -> None:
    assert httpx.get(f"{guarded.url}/health").status_code == 200
    refused = httpx.get(f"{guarded.url}/metadata")
    assert refused.status_code == 401 and "token" in refused.json()["error"]["message"]
    assert httpx.get(f"{guarded.url}/metadata", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    assert httpx.get(f"{guarded.url}/metadata", params={"token": TOKEN + "x"}).status_code == 401
    with pytest.raises(RemoteEnvError):
        envs.make(REMOTE_ENV_ID, url=guarded.url)
    with closing(envs.make(REMOTE_ENV_ID, url=guarded.url, token=TOKEN)) as env:
        _, info = env.reset(seed=0)
        assert info["task_id"]
    assert guarded.sessions_become(0) == 0


def test_one_client_cannot_take_more_than_its_share_and_cycles_leave_nothing(guarded: Served) -> None:
    first, second = (envs.make(REMOTE_ENV_ID, url=guarded.url, token=TOKEN) for _ in range(2))
    with pytest.raises(RemoteEnvError):
        envs.make(REMOTE_ENV_ID, url=guarded.url, token=TOKEN)
    first.close()
    assert guarded.sessions_become(1) == 1
    third = _eventually(lambda: envs.make(REMOTE_ENV_ID, url=guarded.url, token=TOKEN))  # the slot frees as the handler ends
    second.close(), third.close()
    ws_url = guarded.url.replace("http://", "ws://") + f"/ws?token={TOKEN}"
    for _ in range(300):  # open and drop; a slot frees once the server's handler has ended, so a refusal waits for it
        with _eventually(lambda: connect(ws_url, open_timeout=5), refused=InvalidStatus) as ws:
            ws.send(json.dumps({"type": "reset", "data": {"seed": 0}}))
    assert guarded.sessions_become(0) == 0
    assert httpx.get(f"{guarded.url}/metadata", params={"token": TOKEN}).status_code == 200  # still answering


def test_errors_name_the_cause(served: Served) -> None:
    with pytest.raises(InvalidEnvKwargError, match="url='127.0.0.1:8000'"):
        envs.make(REMOTE_ENV_ID, url="127.0.0.1:8000")
    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]
    threads = threading.active_count()
    with pytest.raises(RemoteEnvError, match=f"could not connect to the env server at http://127.0.0.1:{port}"):
        envs.make(REMOTE_ENV_ID, url=f"http://127.0.0.1:{port}")
    assert threading.active_count() == threads  # the client's event-loop thread is stopped too
    env = envs.make(REMOTE_ENV_ID, url=served.url, split="val")
    with pytest.raises(ResetNeeded):
        env.unwrapped.step("hello")
    with pytest.raises(RemoteEnvError, match="split='val'"):
        env.reset(seed=0)
    env.close()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(["serve", ENV, "--seed", "1"], "--seed is only used with --mcp", id="mcp-flag-without-mcp"),
        pytest.param(["serve", ENV, "--mcp", "--port", "1"], "--port is not used with --mcp", id="openenv-flag-with-mcp"),
        pytest.param(["serve", ENV, "--port", "{busy}"], "cannot listen on 127.0.0.1:", id="port-in-use"),
        pytest.param(["serve", "cgym/ApiReprt-v0"], "Did you mean 'cgym/ApiReport-v0'", id="unknown-env"),
        pytest.param(["serve", ENV, "--env-kwargs", '{"rubric": "x"}'], "rubric='x' does not fit", id="kwarg-of-the-wrong-type"),
        pytest.param(["serve", ENV, "--mcp", "--token", "t"], "--token is not used with --mcp", id="token-with-mcp"),
    ],
)
def test_serve_errors_are_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.create_server(("127.0.0.1", 0)) as busy:
        code = main([a.replace("{busy}", str(busy.getsockname()[1])) for a in argv])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and err.count("\n") == 1


@pytest.mark.parametrize(("host", "loopback"), [("127.0.0.1", True), ("127.3.0.1", True), ("::1", True), ("localhost", True), ("0.0.0.0", False), ("::", False), ("10.0.0.2", False), ("example.org", False)])
def test_which_hosts_count_as_this_machine_only(host: str, loopback: bool) -> None:
    from cgym.commands import _is_loopback

    assert _is_loopback(host) is loopback


def test_turn_rewards_cross_the_wire(served: Served) -> None:
    turns = ['<tool_call>{"name": "no_such_tool", "arguments": {}}</tool_call>', '{"answer": "a guess"}']
    infos = []
    for env in (envs.make(ENV, split="test", **KWARGS), remote(served)):
        with closing(env):
            env.reset(seed=1)
            infos.append([env.step(turn)[-1] for turn in turns])
    here, there = infos
    assert [i["turn_reward"] for i in there] == [i["turn_reward"] for i in here] and here[0]["turn_reward"] == -1.0
    assert there[-1]["turn_rewards"] == here[-1]["turn_rewards"] and len(here[-1]["turn_rewards"]) == 2


@pytest.mark.parametrize(
    ("frame", "said"),
    [
        ("42", "got a JSON int"),
        ('["reset"]', "got a JSON list"),
        ("{not json", "not valid JSON"),
        ('{"type": "reset", "data": "x"}', "'data' must be a JSON object"),
        ('{"type": 7}', "'type' must be a string"),
        ('{"type": "reset", "data": ' + "[" * 5000 + "]" * 5000 + "}", "not valid JSON"),
        ('{"type": "reset", "data": {"seed": "abc"}}', "'seed' must be a non-negative integer or null, got a string"),
        ('{"type": "reset", "data": {"seed": -3}}', "got an integer (-3)"),
        ('{"type": "reset", "data": {"options": [1]}}', "'options' must be a JSON object or null, got an array"),
    ],
    ids=["scalar", "list", "not-json", "data-not-object", "type-not-string", "nested-deeply", "seed-string", "seed-negative", "options-array"],
)
def test_a_malformed_frame_is_answered_by_name_and_the_session_goes_on(served: Served, frame: str, said: str) -> None:
    with connect(served.url.replace("http://", "ws://") + "/ws") as ws:
        ws.send(frame)
        reply = json.loads(ws.recv(timeout=10))
        assert reply["type"] == "error" and said in reply["data"]["message"] and "attribute" not in reply["data"]["message"]
        ws.send(json.dumps({"type": "reset", "data": {"seed": 0}}))
        assert json.loads(ws.recv(timeout=10))["type"] == "observation"
    assert served.sessions_become(0) == 0


def test_an_episode_crosses_the_wire_with_every_critique_of_each_turn() -> None:
    from cgym.envs.core import SimpleTask
    from cgym.envs.critique import Critique
    from cgym.envs.episode import Episode, StepRecord
    from cgym.envs.integrations.openenv import episode_from_dict, episode_to_dict

    two = [Critique(1, "invalid_tool_call", "unreadable", got="not json"), Critique(1, "missing_argument", "b is required", expected=["b"])]
    episode = Episode(SimpleTask("t", "p", "g"), [StepRecord(1, "a", critiques=two), StepRecord(2, "done", final=True)], final_answer="done")
    back = episode_from_dict(json.loads(json.dumps(episode_to_dict(episode))))
    assert back.steps[0].critiques == two and back.steps[0].critique == two[0] and back.steps[1].critiques == []
    old_wire = episode_to_dict(episode)
    for step in old_wire["steps"]:
        del step["critiques"]  # a server from before the list: its one critique still arrives
    assert episode_from_dict(old_wire).steps[0].critiques == two[:1]


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
_TYPE = st.sampled_from(["reset", "step", "state", "mcp"]) | st.text(max_size=10)
_FRAME = st.one_of(
    st.text(max_size=300),  # any text at all
    _JSON.map(json.dumps),  # any JSON value
    st.builds(lambda kind, data: json.dumps({"type": kind, "data": data}), _TYPE, _JSON),  # OpenEnv's shape, any data
    st.builds(lambda text: json.dumps({"type": "step", "data": {"text": text}}), st.text(max_size=300)),  # any turn
    st.builds(lambda seed, options: json.dumps({"type": "reset", "data": {"seed": seed, "options": options}}), _JSON, _JSON),
    st.builds(  # OpenEnv's MCP-over-WebSocket messages, the session routes included
        lambda method, params: json.dumps({"type": "mcp", "data": {"jsonrpc": "2.0", "id": 1, "method": method, "params": params}}),
        st.sampled_from(["openenv/session/create", "tools/list", "tools/call"]) | st.text(max_size=12),
        _JSON,
    ),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture], derandomize=True)
@given(frames=st.lists(_FRAME, min_size=1, max_size=6))
def test_fuzzed_frames_are_each_answered_and_leave_no_session_behind(served: Served, frames: list[str]) -> None:
    """A Hypothesis fuzz of the WebSocket handler: every frame gets one well-formed reply that names
    no Python internals, the server stays up, and a dropped client's session is freed."""
    assume(not any('"close"' in frame for frame in frames))  # `close` is answered by closing
    with connect(served.url.replace("http://", "ws://") + "/ws", max_size=None) as ws:
        for frame in frames:
            ws.send(frame)
            reply = json.loads(ws.recv(timeout=30))
            assert reply["type"] in ("observation", "state", "mcp", "error"), reply
            message = str(reply.get("data", {}).get("message", "")) if reply["type"] == "error" else ""
            assert not any(internal in message for internal in ("Traceback", "object has no attribute", "<class ", "Error:")), message
    assert served.sessions_become(0) == 0
    assert httpx.get(served.url + "/health", timeout=10).status_code == 200


def _serve_cli(*args: str, env: dict[str, str] | None = None) -> tuple[Any, str]:
    """`cgym serve ENV ... --port 0` as a child; the process and what it printed up to the URL line."""
    import os
    import subprocess
    import sys

    process = subprocess.Popen(
        [sys.executable, "-m", "cgym", "serve", ENV, "--port", "0", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "COLUMNS": "400", **(env or {})},
    )  # fmt: skip
    said = ""
    assert process.stdout is not None
    for line in process.stdout:
        said += line
        if "serving " in line:
            return process, said
    process.kill()
    raise AssertionError(f"cgym serve did not start: {said}")


def _url_in(said: str) -> str:
    found = re.search(r"at (http://\S+) ", said)
    assert found, said
    return found.group(1)


def test_serve_listens_on_ipv6_and_takes_its_token_from_the_environment() -> None:
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError:
        pytest.skip("this machine has no IPv6 loopback")
    process, said = _serve_cli("--host", "::1", env={"CGYM_SERVE_TOKEN": TOKEN})
    try:
        url = _url_in(said)
        assert url.startswith("http://[::1]:") and "warning" not in said  # loopback: no warning
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        assert httpx.get(url + "/schema", timeout=10).status_code == 401  # the token from $CGYM_SERVE_TOKEN guards it
        assert httpx.get(url + "/schema", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10).status_code == 200
    finally:
        process.kill()
        process.wait(timeout=30)


def test_serve_warns_when_it_listens_beyond_this_machine_without_a_token() -> None:
    process, said = _serve_cli("--host", "0.0.0.0")
    process.kill()
    process.wait(timeout=30)
    assert "warning" in said and "beyond this machine, with no token" in said and "--token" in said
    process, said = _serve_cli("--host", "0.0.0.0", "--token", TOKEN)
    process.kill()
    process.wait(timeout=30)
    assert "warning" not in said


def test_the_openenv_release_under_test() -> None:
    """.ci/run runs this file a second time on `openenv` 0.10 (CGYM_OPENENV_VERSION says so): check that it really does."""
    import importlib.metadata
    import os

    import openenv

    wanted = os.environ.get("CGYM_OPENENV_VERSION")
    if not wanted:
        pytest.skip("the default run: whichever OpenEnv the interop extra installed")
    assert importlib.metadata.version("openenv") == wanted
    assert any(openenv.__file__.startswith(path) for path in os.environ.get("PYTHONPATH", "").split(os.pathsep) if path)
