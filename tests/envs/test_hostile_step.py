"""Hostile actions cost a bounded amount and never make `step` raise (the reported classes of hostile input).

Class 1 (`step` raises): no exception from parsing, tools, checks or the scoring hook escapes;
each becomes a critique. Class 2 (super-linear work): every parser is linear in its input, the
action's length and the calls of a turn are capped, and a turn's slow tools share one time budget.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import numpy as np
import pytest
from cgym.envs import bounded_json
from cgym.envs.api_report.checks import _split_fences, extract_report
from cgym.envs.core import MAX_ACTION_CHARS, MAX_CALLS_PER_TURN, AgentEnv, ResetNeeded
from cgym.envs.episode import Episode
from cgym.envs.rubric import CRASH_SCORE, Check, CheckResult, Rubric
from cgym.envs.sql.lexer import extract_query, is_read_only_form, tokenize
from cgym.envs.toolcall import _unfence, parse_turn
from cgym.envs.tools import Tool
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cgym import envs

STEP_LIMIT_S = 1.0
BUILT_IN = [(env_id, d) for env_id in ("cgym/ApiReport-v0", "cgym/SqlQuery-v0") for d in envs.DIFFICULTIES]
GOOD_CALL = {"cgym/ApiReport-v0": ("search_customers", {"name": "a"}), "cgym/SqlQuery-v0": ("list_tables", {})}


def call(tool: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': tool, 'arguments': arguments})}</tool_call>"


# -- pathological text --------------------------------------------------------------------
RUNS: dict[str, tuple[str, str]] = {  # name -> (prefix, unit repeated after it)
    "fence-then-spaces": ("```", " "),
    "json-fence-then-spaces": ("```json", " "),
    "sql-fence-then-spaces": ("```sql", " \t"),
    "fences": ("", "```"),
    "fence-space": ("", "``` "),
    "backticks": ("", "`"),
    "spaces": ("", " "),
    "brackets": ("", "["),
    "objects": ("", '{"a": '),
    "digits": ("", "1"),
    "escaped-quotes": ('"', '\\"'),
    "backslashes": ('["', "\\"),
    "tool-call-openers": ("", "<tool_call>"),
    "deep-tool-call": ("<tool_call>", "["),
    "deep-bare-call": ('{"name": "a", "arguments": ', "["),
    "deep-call-array": ('[{"name": "a", "arguments": ', "["),
    "call-array": ("[", '{"name": "a", "arguments": {}}, '),
    "sql-comment-openers": ("", "/*"),
    "sql-quotes": ("", "'"),
    "sql-idents": ("", '"'),
}


def run_of(name: str, n: int) -> str:
    """About `n` characters of the named run."""
    prefix, unit = RUNS[name]
    return prefix + unit * (n // len(unit))


def _loads_or_refuses(text: str) -> object:
    try:
        return bounded_json.loads(text)
    except json.JSONDecodeError:
        return None


PARSERS: dict[str, Callable[[str], object]] = {
    "parse_turn": parse_turn,
    "extract_report": extract_report,
    "extract_query": extract_query,
    "bounded_json": _loads_or_refuses,
}


def best_time(fn: Callable[[str], object], text: str, repeats: int = 3) -> float:
    timings = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(text)
        timings.append(time.perf_counter() - start)
    return min(timings)


@pytest.mark.parametrize("run", sorted(RUNS))
@pytest.mark.parametrize("parser", sorted(PARSERS))
def test_parsers_take_200k_pathological_chars_in_well_under_a_second(parser: str, run: str) -> None:
    assert best_time(PARSERS[parser], run_of(run, 200_000)) < 0.25  # best of 3: one stall is not the parser


@pytest.mark.parametrize("run", sorted(RUNS))
@pytest.mark.parametrize("parser", [*sorted(PARSERS), "tokenize"])
def test_parsers_are_linear(parser: str, run: str) -> None:
    fn = tokenize if parser == "tokenize" else PARSERS[parser]
    small, large = best_time(fn, run_of(run, 4_000)), best_time(fn, run_of(run, 32_000))
    # linear is 8x (with cache and GC noise up to ~20x on a busy machine); quadratic would be 64x
    assert large <= 24 * small + 0.01, f"8x the input took {large / max(small, 1e-9):.0f}x the time"


# -- the linear rewrites find what the old patterns found ------------------------------------
OLD_TURN_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)
OLD_REPORT_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL)
OLD_SQL_BLOCK = re.compile(r"```[ \t]*(?:sql|sqlite)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)
FENCE_PIECES = st.lists(st.sampled_from(["```", "`", " ", "\t", "\n", "json", "sql", "SQLite", "SELECT", "{", "}", '"a"', "1"]), max_size=14).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=FENCE_PIECES)
def test_fence_scanning_matches_the_old_patterns_on_short_text(text: str) -> None:
    fences, outside = _split_fences(text)
    assert [f.removeprefix("json").strip() for f in fences] == [f.strip() for f in OLD_REPORT_FENCE.findall(text)]
    assert "".join(outside) == OLD_REPORT_FENCE.sub("", text)
    stripped = text.strip()
    fenced = OLD_TURN_FENCE.match(stripped)
    assert _unfence(stripped) == (fenced.group(1) if fenced else stripped)
    blocks = [b.strip() for b in OLD_SQL_BLOCK.findall(text) if b.strip()]
    assert extract_query(text) == (blocks[-1] if blocks else stripped if stripped and is_read_only_form(stripped) else None)


# -- bounded JSON ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "refusal"),
    [
        ("[" * 64 + "]" * 64, None),
        ("[" * 65 + "]" * 65, "nesting deeper than 64"),
        ('{"a": ' * 65 + "1" + "}" * 65, "nesting deeper than 64"),
        ("9" * 100, None),
        ("9" * 101, "number longer than 100"),
        ("9" * 5_000, "number longer than 100"),
        ('"' + "[" * 1_000 + "9" * 5_000 + '"', None),
        ('{"x": 1e999}', None),
    ],
    ids=["depth-64", "depth-65", "objects-65", "100-digits", "101-digits", "5000-digits", "inside-a-string", "1e999"],
)
def test_bounded_json_refuses_depth_and_long_numbers_only(text: str, refusal: str | None) -> None:
    if refusal is None:
        assert bounded_json.loads(text) == json.loads(text)
    else:
        with pytest.raises(json.JSONDecodeError, match=refusal):
            bounded_json.loads(text)


# -- hostile actions through every built-in env ---------------------------------------------
HUGE = st.one_of(
    st.integers(1_000, 6_000).map(lambda n: "[" * n + "]" * n),
    st.integers(1_000, 4_000).map(lambda n: '{"a": ' * n + "1" + "}" * n),
    st.integers(4_301, 6_000).map(lambda n: "9" * n),
    st.sampled_from(["1e999", "-1e999", "1e-999", "NaN", "-Infinity", "9" * 5_000 + ".5", "0." + "0" * 5_000 + "1"]),
    st.builds(run_of, st.sampled_from(sorted(RUNS)), st.integers(1_000, 20_000)),
)
PAYLOAD = st.one_of(st.text(max_size=300), HUGE)
TOOL = st.sampled_from(["run_query", "submit_query", "describe_table", "search_customers", "list_orders", "get_product", "get_token"])
KEY = st.sampled_from(["query", "table", "name", "customer_id", "page", "product_id"])


def _spliced_call(name: str, key: str, raw: str) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {{"{key}": {raw}}}}}</tool_call>'


ACTION = st.one_of(
    PAYLOAD,  # the whole final answer
    PAYLOAD.map(lambda p: f"Here is the report:\n```json\n{p}\n```"),
    PAYLOAD.map(lambda p: f"```sql\n{p}\n```"),
    st.builds(_spliced_call, TOOL, KEY, PAYLOAD),  # raw in the call's JSON
    st.builds(lambda name, key, p: _spliced_call(name, key, json.dumps(p)), TOOL, KEY, PAYLOAD),  # a string argument
    PAYLOAD.map(lambda p: '{"name": "submit_query", "arguments": ' + p + "}"),  # a bare call
)


@pytest.fixture(scope="module")
def built_in() -> Iterator[dict[tuple[str, str], AgentEnv]]:
    made = {(env_id, d): envs.make(env_id, difficulty=d).unwrapped for env_id, d in BUILT_IN}
    yield made
    for env in made.values():
        env.close()


@pytest.mark.timing
@pytest.mark.parametrize(("env_id", "difficulty"), BUILT_IN, ids=[f"{e.split('/')[1]}-{d}" for e, d in BUILT_IN])
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**31 - 1), actions=st.lists(ACTION, min_size=1, max_size=4))
def test_step_never_raises_and_takes_under_a_second(built_in, env_id: str, difficulty: str, seed: int, actions: list[str]) -> None:
    env = built_in[(env_id, difficulty)]
    env.reset(seed=seed)
    tool, arguments = GOOD_CALL[env_id]
    for action in [*actions, call(tool, **arguments)]:  # the last turn shows the bad ones poisoned nothing
        start = time.perf_counter()
        obs, reward, terminated, truncated, info = env.step(action)
        elapsed = time.perf_counter() - start
        assert elapsed < STEP_LIMIT_S, f"{elapsed:.2f} s for {action[:80]!r}"
        assert env.observation_space.contains(obs) and isinstance(reward, float)
        if terminated or truncated:
            assert isinstance(info["success"], bool)
            env.reset(seed=seed)
    assert info["critique"] is None, info["critique"]


@pytest.mark.timing
@pytest.mark.parametrize(("env_id", "difficulty"), BUILT_IN, ids=[f"{e.split('/')[1]}-{d}" for e, d in BUILT_IN])
def test_the_reported_examples_are_answered_in_under_a_second(built_in, env_id: str, difficulty: str) -> None:
    env = built_in[(env_id, difficulty)]
    examples = ["```" + " " * 5_000 + "x", "[" * 5_000, "9" * 5_000, _spliced_call("run_query", "query", "[" * 5_000), _spliced_call("list_orders", "page", "9" * 5_000)]
    for action in examples:
        env.reset(seed=0)
        start = time.perf_counter()
        env.step(action)
        assert time.perf_counter() - start < STEP_LIMIT_S, action[:40]


@pytest.mark.timing
def test_ten_slow_queries_in_one_turn_stop_at_the_turns_budget(built_in) -> None:
    env = built_in[("cgym/SqlQuery-v0", "easy")]
    env.reset(seed=0)
    slow = call("run_query", query="WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r) SELECT max(i) FROM r")
    start = time.perf_counter()
    obs, *_, info = env.step(slow * 10)
    assert time.perf_counter() - start < STEP_LIMIT_S
    assert len(env.episode.steps[-1].results) == 1 and info["critique"]["code"] == "timeout"
    assert "Error [turn_time_exceeded]" in obs and "Error [too_many_tool_calls]" in obs


# -- the budget and the crash guards, on a small env the tests configure ------------------------
class FakeTask:
    id = "fake-0"
    prompt = "Say anything."
    ground_truth = "anything"


def _answered(episode: Episode) -> CheckResult:
    return CheckResult.ok()


def _raises(episode: Episode) -> CheckResult:
    raise ZeroDivisionError("the check divided by zero")


class FakeEnv(AgentEnv):
    """One task; tools `echo`, `boom` (raises) and `nap` (sleeps the whole turn budget)."""

    turn_time_s: ClassVar[float] = 0.3

    def __init__(self, *, checks: list[Check] | None = None, before_score: Callable[[Episode], None] | None = None) -> None:
        self.rubric = Rubric(checks or [Check("answered", _answered)])
        self._hook = before_score
        super().__init__(max_turns=4)

    def sample_task(self, rng: np.random.Generator, *, seed: int | None, options: dict | None) -> FakeTask:
        return FakeTask()

    def tools(self) -> list[Tool]:
        return [Tool.from_function(f) for f in (self.echo, self.boom, self.nap)]

    def before_score(self, episode: Episode) -> None:
        if self._hook is not None:
            self._hook(episode)

    def echo(self, text: str) -> str:
        """Return the text.

        Args:
            text: Anything.
        """
        return text

    def boom(self) -> str:
        """Always raises."""
        raise KeyError("no such thing")

    def nap(self) -> str:
        """Sleep through the turn's time budget."""
        time.sleep(self.turn_time_s)
        return "rested"


def _step(env: AgentEnv, action: str) -> tuple[str, bool, dict[str, Any]]:
    obs, _, terminated, _, info = env.step(action)
    return obs, terminated, info


@pytest.mark.parametrize(
    "action",
    [call("echo", text="hi") + " " * MAX_ACTION_CHARS, "a" * (MAX_ACTION_CHARS + 1)],
    ids=["tool-call", "final-answer"],
)
def test_an_over_long_action_is_refused_unread(action: str) -> None:
    env = FakeEnv()
    env.reset(seed=0)
    obs, terminated, info = _step(env, action)
    assert not terminated and env.episode.steps[-1].results == []
    assert info["critique"]["code"] == "action_too_long" and info["critique"]["got"] == len(action)
    assert obs.startswith("Error [action_too_long]")
    _, terminated, _ = _step(env, "a" * MAX_ACTION_CHARS)  # at the limit the answer is read
    assert terminated


def test_calls_beyond_the_cap_are_refused() -> None:
    env = FakeEnv()
    env.reset(seed=0)
    obs, _, info = _step(env, call("echo", text="x") * (MAX_CALLS_PER_TURN + 2))
    assert len(env.episode.steps[-1].results) == MAX_CALLS_PER_TURN
    assert info["critique"] == {**info["critique"], "code": "too_many_tool_calls", "expected": MAX_CALLS_PER_TURN, "got": MAX_CALLS_PER_TURN + 2}
    assert obs.endswith(f"only the first {MAX_CALLS_PER_TURN} were read and the rest were not run.")


def test_malformed_calls_count_toward_the_cap() -> None:
    env = FakeEnv()
    env.reset(seed=0)
    _, _, info = _step(env, "<tool_call>{</tool_call>" * 5 + call("echo", text="x") * 5)
    assert len(env.episode.steps[-1].results) == MAX_CALLS_PER_TURN - 5
    assert info["critique"]["code"] == "json_parse_error"


@pytest.mark.timing
def test_calls_after_the_turns_time_budget_are_refused() -> None:
    env = FakeEnv()
    env.reset(seed=0)
    start = time.perf_counter()
    obs, _, info = _step(env, call("nap") * 3)
    assert time.perf_counter() - start < 2 * FakeEnv.turn_time_s + 0.2
    assert [r.content for r in env.episode.steps[-1].results] == ["rested"]
    assert info["critique"]["code"] == "turn_time_exceeded" and "2 call(s) were not run" in obs


def test_a_crashing_tool_becomes_a_tool_error() -> None:
    env = FakeEnv()
    env.reset(seed=0)
    obs, terminated, info = _step(env, call("boom"))
    assert not terminated and obs.startswith("Error [tool_crashed]") and "KeyError" in obs
    assert info["critique"]["code"] == "tool_crashed" and not env.episode.steps[-1].results[0].ok


def test_a_crashing_check_fails_with_a_critique_naming_it_and_poisons_nothing() -> None:
    env = FakeEnv(checks=[Check("answered", _answered), Check("fragile", _raises, weight=2.0)])
    env.reset(seed=0)
    _, reward, terminated, _, info = env.step("my answer")
    assert terminated and not info["success"] and reward == 1.0 + 2.0 * CRASH_SCORE
    crashed = [c for c in info["critiques"] if c["code"] == "check_crashed"]
    assert len(crashed) == 1 and "'fragile'" in crashed[0]["message"] and "ZeroDivisionError" in crashed[0]["message"]
    with pytest.raises(ResetNeeded):  # the episode is over, not stuck re-raising
        env.step("again")
    env.reset(seed=1)
    assert _step(env, call("echo", text="still works"))[0] == "still works"


def test_a_crashing_scoring_hook_becomes_a_critique() -> None:
    env = FakeEnv(before_score=lambda episode: int("x" * 10))
    env.reset(seed=0)
    _, reward, terminated, _, info = env.step("my answer")
    assert terminated and reward == 1.0  # the checks still ran
    assert [c["code"] for c in info["critiques"]] == ["scoring_crashed"]


def test_a_crashing_parser_becomes_a_critique(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(text: str) -> None:
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(FakeEnv, "turn_parser", staticmethod(broken))
    env = FakeEnv()
    env.reset(seed=0)
    obs, terminated, info = _step(env, "anything")
    assert not terminated and info["critique"]["code"] == "parse_crashed" and "RecursionError" in obs


@pytest.mark.parametrize(
    ("payload", "cause"),
    [("[" * 5_000, "nesting deeper than"), ("9" * 5_000, "number longer than")],
    ids=["nested-5000-deep", "5000-digit-int"],
)
def test_parsers_report_deep_json_and_huge_numbers(payload: str, cause: str) -> None:
    error = parse_turn(_spliced_call("echo", "text", payload)).errors[0]
    assert error.code == "json_parse_error" and cause in error.message
    report = extract_report(f'```json\n{{"total": {payload}}}\n```')
    assert report.data is None and cause in (report.error or "")


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(text=st.one_of(st.text(max_size=500), HUGE, ACTION))
def test_parsers_never_raise(text: str) -> None:
    parse_turn(text)
    extract_report(text)
    extract_query(text)
    _loads_or_refuses(text)


def test_a_refused_action_is_kept_as_its_length_and_a_prefix_never_whole() -> None:
    """Over-long actions are refused unread; keeping them whole would let a client fill memory."""
    from cgym.envs.core import MAX_ACTION_CHARS, REFUSED_PREFIX_CHARS

    env = envs.make("cgym/ApiReport-v0", difficulty="easy", max_turns=3)
    env.reset(seed=0)
    huge = "x" * (50 * MAX_ACTION_CHARS)
    _, _, _, _, info = env.step(huge)
    kept = [m["content"] for m in info["messages"] if m["role"] == "assistant"]
    assert kept and all(len(text) < REFUSED_PREFIX_CHARS + 100 for text in kept)
    assert str(len(huge)) in kept[-1]
    assert len(env.unwrapped.episode.steps[-1].action) < REFUSED_PREFIX_CHARS + 100
    env.close()


@pytest.mark.parametrize("action", ["\ud800", 'report {"a": "\udfff"}', '<tool_call>{"name": "get_customer", "arguments": {"customer_id": "\ud83d"}}</tool_call>'], ids=["alone", "in-answer", "in-call"])
def test_lone_surrogates_never_stop_an_episode_from_serialising(action: str) -> None:
    import json

    env = envs.make("cgym/ApiReport-v0", difficulty="easy", max_turns=2)
    env.reset(seed=0)
    terminated = truncated = False
    while not (terminated or truncated):
        _, _, terminated, truncated, info = env.step(action)
        json.dumps(info, ensure_ascii=False, default=str).encode("utf-8")  # raises on a lone surrogate
    assert "success" in info and "critiques" in info
    env.close()
