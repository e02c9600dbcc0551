"""`run_episodes(..., workers=N)`: envs step concurrently, each pinned to one thread, and the
results are exactly those of stepping them one after another."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Sequence
from typing import Any

import gymnasium as gym
import pytest
from cgym.agents.base import Conversation, Turn
from cgym.agents.eval.episodes import EpisodeResult, run_episodes
from cgym.agents.scripted import ScriptedPolicy, family_for
from cgym.envs.toolcall import ToolCall

from cgym import envs

API = "cgym/ApiReport-v0"
SQL = "cgym/SqlQuery-v0"


def outcome(results: list[EpisodeResult]) -> list[tuple[Any, ...]]:
    """Everything an episode's result says: outcome, rewards, critiques and the whole transcript."""
    return [(r.summary(), r.breakdown, r.passed, r.critiques, r.conversation.messages) for r in results]


def play(env_id: str, agent: str, seeds: Sequence[int], *, workers: int, **kwargs: Any) -> tuple[list[EpisodeResult], list[int]]:
    """The results, and the seeds in the order `on_done` saw them finish."""
    done: list[int] = []
    results = run_episodes(lambda: envs.make(env_id, **kwargs), ScriptedPolicy(agent), seeds, batch_size=8, workers=workers,
                           on_done=lambda r: done.append(r.seed))
    return results, done


@pytest.mark.parametrize(
    ("env_id", "agent", "kwargs"),
    [
        (API, "oracle", {"difficulty": "hard", "faults": 0.3, "latency_s": 0.002}),
        (API, "no_retry", {"difficulty": "hard", "faults": 0.3, "latency_s": 0.002}),
        (API, "skip_pagination", {"difficulty": "hard", "faults": 0.1}),
        (SQL, "oracle", {"difficulty": "hard"}),
        (SQL, "wrong_aggregate", {"difficulty": "medium"}),
    ],
    ids=["api-hard-oracle", "api-hard-no-retry", "api-hard-skip-pagination", "sql-hard-oracle", "sql-medium-wrong-aggregate"],
)
def test_concurrent_steps_give_the_sequential_results(env_id: str, agent: str, kwargs: dict[str, Any]) -> None:
    seeds = list(range(20))
    sequential, seq_done = play(env_id, agent, seeds, workers=1, **kwargs)
    concurrent, conc_done = play(env_id, agent, seeds, workers=8, **kwargs)
    assert outcome(concurrent) == outcome(sequential)
    assert conc_done == seq_done
    if agent == "oracle":
        assert all(r.success for r in sequential)
    else:  # the comparison covers the flaw's critique
        assert any(family_for(env_id).flaw_codes[agent] in r.codes for r in sequential)


class ThreadProbeEnv(gym.Env[str, str]):
    """An env that opens a thread-bound sqlite3 connection in `reset`, uses it in `step`, and
    fails if two threads ever call it at once; `barrier` (if set) makes every step wait for others."""

    observation_space = gym.spaces.Text(1000)
    action_space = gym.spaces.Text(1000)

    def __init__(self, *, barrier: threading.Barrier | None = None, fail_on: int | None = None, turns: int = 3) -> None:
        self.barrier = barrier
        self.fail_on = fail_on
        self.turns = turns
        self.conn: sqlite3.Connection | None = None  # check_same_thread=True: only its own thread may use it
        self.threads: set[int] = set()
        self.busy = False
        self.seed_ = 0
        self.t = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        with self._exclusive():
            self.conn = self.conn or sqlite3.connect(":memory:")
            self.seed_, self.t = seed or 0, 0
            return "", {"messages": [{"role": "user", "content": f"seed {seed}"}], "tools": []}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        with self._exclusive():
            if self.barrier is not None:
                self.barrier.wait()
            if self.seed_ == self.fail_on:
                raise RuntimeError(f"step failed on seed {self.seed_}")
            time.sleep(0.001)
            self.t += 1
            assert self.conn is not None
            value = self.conn.execute("SELECT ? * 10 + ?", (self.seed_, self.t)).fetchone()[0]
            return "", float(value), self.t == self.turns, False, {"messages": [{"role": "tool", "content": str(value)}]}

    def _exclusive(self) -> Any:
        env = self

        class Guard:
            def __enter__(self) -> None:
                assert not env.busy, "two threads called one env at once"
                env.busy = True
                env.threads.add(threading.get_ident())

            def __exit__(self, *exc: object) -> None:
                env.busy = False

        return Guard()


class EchoPolicy:
    name = "echo"

    def act(self, batch: Sequence[Conversation]) -> list[Turn]:
        return [Turn(f"turn {len(conv.messages)}") for conv in batch]


def test_each_env_stays_on_one_thread_and_is_never_called_from_two_at_once() -> None:
    pool: list[gym.Env] = []
    results = run_episodes(lambda: ThreadProbeEnv(turns=3), EchoPolicy(), range(24), batch_size=6, workers=4, pool=pool)
    assert [r.reward for r in results] == [seed * 10 + 3 for seed in range(24)]
    assert all(len(env.threads) == 1 for env in pool)  # a thread-bound sqlite3 connection would have raised otherwise
    assert len({ident for env in pool for ident in env.threads}) == 4
    assert threading.get_ident() not in {ident for env in pool for ident in env.threads}


def test_steps_really_overlap() -> None:
    """Every step waits for 4 steps to be in flight: only concurrent stepping gets through."""
    barrier = threading.Barrier(4, timeout=10)
    results = run_episodes(lambda: ThreadProbeEnv(barrier=barrier, turns=2), EchoPolicy(), range(4), batch_size=4, workers=4)
    assert [r.reward for r in results] == [seed * 10 + 2 for seed in range(4)]


def test_one_worker_steps_inline_on_the_calling_thread() -> None:
    pool: list[gym.Env] = []
    run_episodes(lambda: ThreadProbeEnv(), EchoPolicy(), range(6), batch_size=3, pool=pool)
    assert {ident for env in pool for ident in env.threads} == {threading.get_ident()}


def test_a_failing_step_raises_in_the_caller() -> None:
    with pytest.raises(RuntimeError, match="seed 5"):
        run_episodes(lambda: ThreadProbeEnv(fail_on=5), EchoPolicy(), range(8), batch_size=8, workers=4)


@pytest.mark.parametrize("workers", [0, -2, 2.0, True], ids=["zero", "negative", "float", "bool"])
def test_bad_workers_are_refused(workers: Any) -> None:
    with pytest.raises(ValueError, match="workers must be an int >= 1"):
        run_episodes(lambda: ThreadProbeEnv(), EchoPolicy(), range(2), workers=workers)


# -- hostile SQL next to honest episodes ---------------------------------------------------------
ATTACKS = {  # SQL, the critique code it must get
    "cartesian-count": ("SELECT count(*) FROM order_items a, order_items b, order_items c, order_items d", "timeout"),
    "cte-doubling-levels": ("WITH a(x) AS (VALUES (1), (2)), b AS (SELECT 1 FROM a, a y), c AS (SELECT 1 FROM b, b y), "
                            "d AS (SELECT 1 FROM c, c y), e AS (SELECT 1 FROM d, d y), f AS (SELECT 1 FROM e, e y) "
                            "SELECT count(*) FROM f", "timeout"),
    "load-extension": ("SELECT load_extension('/tmp/evil.so')", "forbidden_statement"),
}


class AttackThenOracle:
    """The SQL oracle, except that the episodes in `attackers` open with an attack query."""

    name = "attack-then-oracle"

    def __init__(self, attack: str) -> None:
        self.oracle = ScriptedPolicy("oracle", env_id=SQL)
        self.attack = ToolCall("run_query", {"query": attack}).render()
        self.attackers: set[int] = set()

    def mark(self, index: int, conv: Conversation) -> Conversation:
        if index % 3 == 0:
            self.attackers.add(id(conv))
        return conv

    def act(self, batch: Sequence[Conversation]) -> list[Turn]:
        opening = [id(conv) in self.attackers and not any(m["role"] == "assistant" for m in conv.messages) for conv in batch]
        return [Turn(self.attack) if attack else turn for attack, turn in zip(opening, self.oracle.act(batch))]


@pytest.mark.timing
@pytest.mark.parametrize("attack", list(ATTACKS), ids=list(ATTACKS))
def test_sql_attacks_next_to_honest_episodes_change_nothing(attack: str) -> None:
    """An attack query in some episodes is stopped with its code, fast, while honest episodes run
    on other threads; every episode ends as it does when they run one after another."""
    sql, code = ATTACKS[attack]

    def run(workers: int) -> tuple[list[EpisodeResult], float]:
        policy = AttackThenOracle(sql)
        start = time.perf_counter()
        results = run_episodes(lambda: envs.make(SQL, difficulty="medium", schema="shop", query_timeout_s=0.3), policy, range(12), batch_size=6,
                               workers=workers, conversation_for=policy.mark)
        return results, time.perf_counter() - start

    sequential, _ = run(1)
    concurrent, elapsed = run(6)
    assert outcome(concurrent) == outcome(sequential)
    assert all(r.success for r in concurrent)  # honest and attacking episodes alike end with the gold query
    assert [r.critiques[0]["code"] if r.critiques else None for r in concurrent] == [code if i % 3 == 0 else None for i in range(12)]
    assert elapsed < 10  # 4 attacks of 0.3 s each, the honest episodes' queries in milliseconds


@pytest.mark.timing
def test_eval_workers_reach_the_episodes_and_change_no_figure() -> None:
    """`EvalConfig.workers` (`cgym eval --workers`) steps the envs on threads: same summary, faster I/O."""
    from cgym.agents.eval.evaluate import EvalConfig, evaluate

    kwargs = {"difficulty": "hard", "faults": 0.3, "latency_s": 0.01}
    figures = {}
    for workers in (1, 8):
        summary, results = evaluate(ScriptedPolicy("no_retry"), EvalConfig("cgym/ApiReport-v0", kwargs, episodes=16, workers=workers))
        figures[workers] = ({k: summary[k] for k in ("success_rate", "mean_reward", "critique_codes")}, [r.summary() for r in results], summary["wall_s"])
    assert figures[1][:2] == figures[8][:2]
    assert figures[8][2] < figures[1][2]
