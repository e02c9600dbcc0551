"""The SQL rubric: execution match decides success; format terms only reorder within it.

- `valid_sql` (gate, +1 / -1): a query was submitted and ran in the sandbox.
- `execution_match` (gate, +2, binary): its result equals the gold result (multisets, order
  when the gold orders, float tolerance, columns by position).
- `concise` (bonus, +0.5): the correct query is at most twice as long as the gold query.

The env judges the submission once, when the episode ends, and leaves the `Verdict` in
`episode.extras["verdict"]`; the checks are pure functions of the episode.
"""

from __future__ import annotations

from dataclasses import dataclass

from cgym.envs.critique import Critique
from cgym.envs.episode import Episode
from cgym.envs.rubric import Check, CheckResult, Rubric
from cgym.envs.sql.lexer import unconstrained_joins
from cgym.envs.sql.match import Mismatch, compare
from cgym.envs.sql.sandbox import Sandbox, SqlError
from cgym.envs.sql.tasks import SUBMIT_ROW_CAP, SqlTask

CONCISE_FACTOR = 2.0
_ROW_CODES = frozenset({"extra_rows", "missing_rows", "row_count_mismatch", "result_mismatch"})


@dataclass(frozen=True)
class Verdict:
    """How the submission fared: nothing submitted, refused/failed (`error`), or compared."""

    query: str | None
    error: SqlError | None = None
    mismatch: Mismatch | None = None

    @property
    def ran(self) -> bool:
        return self.query is not None and self.error is None

    @property
    def correct(self) -> bool:
        return self.ran and self.mismatch is None


def judge(task: SqlTask, query: str | None, sandbox: Sandbox, *, time_budget_s: float | None = None) -> Verdict:
    """Run the submitted query (if any) and compare its result with the gold result."""
    if query is None or not query.strip():
        return Verdict(None)
    try:
        result = sandbox.run(query, max_rows=SUBMIT_ROW_CAP, time_budget_s=time_budget_s)
    except SqlError as exc:
        return Verdict(query, error=exc)
    if result.truncated:
        n = len(task.expected.rows)
        return Verdict(query, mismatch=Mismatch("row_count_mismatch", f"The result has more than {SUBMIT_ROW_CAP} rows; "
                                                f"the answer has {n}.", expected=n, got=f">{SUBMIT_ROW_CAP}"))
    return Verdict(query, mismatch=compare(task.expected, result.columns, result.rows, query=query))


def verdict_of(episode: Episode) -> Verdict | None:
    """The judged submission; None when the episode ran out of turns before submitting."""
    return episode.extras.get("verdict")


def valid_sql(episode: Episode) -> CheckResult:
    verdict = verdict_of(episode)
    if verdict is None:  # truncated: the env's own critique says so
        return CheckResult.fail(None, -1.0)
    if verdict.query is None:
        message = "No SQL query was submitted: call submit_query, or put the query in a ```sql block."
        return CheckResult.fail(Critique(episode.final_step, "no_submission", message, expected="one SELECT query"), -1.0)
    if verdict.error is not None:
        err = verdict.error
        return CheckResult.fail(Critique(episode.final_step, err.code, f"The submitted query failed. {err.message}", err.expected, err.got), -1.0)
    return CheckResult.ok()


def execution_match(episode: Episode) -> CheckResult:
    verdict = verdict_of(episode)
    if verdict is None or not verdict.ran:
        return CheckResult.fail(None)
    if verdict.mismatch is None:
        return CheckResult.ok()
    code, message = explain(verdict)
    return CheckResult.fail(Critique(episode.final_step, code, message, verdict.mismatch.expected, verdict.mismatch.got))


def explain(verdict: Verdict) -> tuple[str, str]:
    """The critique code and message for a failed verdict, naming a likely cause when visible."""
    if verdict.error is not None:
        return verdict.error.code, verdict.error.message
    if verdict.mismatch is None:
        return "", ""
    code, message = verdict.mismatch.code, verdict.mismatch.message
    loose = unconstrained_joins(verdict.query or "")
    if loose and code in _ROW_CODES:
        code = "missing_join_condition"
        message = (f"The JOIN of {', '.join(loose)} has no join condition (ON ...), so every row is paired with every "
                   f"row of the other table. {message}")
    return code, message


def concise(episode: Episode) -> CheckResult:
    verdict = verdict_of(episode)
    if verdict is None or not verdict.correct or verdict.query is None:
        return CheckResult.fail(None)
    limit = int(CONCISE_FACTOR * len(episode.task.gold_sql))
    if len(verdict.query.strip()) <= limit:
        return CheckResult.ok()
    message = f"The query is correct but {len(verdict.query.strip())} characters long; a {limit}-character query would do."
    return CheckResult.fail(Critique(episode.final_step, "query_too_long", message, limit, len(verdict.query.strip())))


def default_rubric(*, valid_weight: float = 1.0, match_weight: float = 2.0, concise_weight: float = 0.5) -> Rubric:
    """Execution match gates everything; the concise bonus counts only on success."""
    return Rubric(
        [
            Check("valid_sql", valid_sql, valid_weight),
            Check("execution_match", execution_match, match_weight),
            Check("concise", concise, concise_weight, gate=False),
        ]
    )
