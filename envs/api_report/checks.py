"""The API-report rubric: the article's example weights under correctness gating.

- `valid_json` (gate, +1 / -1): the report parses as a JSON object.
- `fields_match` (gate, +2 times the share of fields right): every required field equals the
  shop's data (numbers within 0.01, strings case-insensitively).
- `grounded` (gate, +0.5): the answer rests on the API: the needed calls succeeded, every page
  was fetched, transient failures were retried ("call the API before you summarise").
- `concise` (bonus, +0.5): visible reasoning outside the JSON is at most 500 characters;
  counted only when every gate passed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from cgym.envs import bounded_json
from cgym.envs.api_report.calls import ApiCall, fetched_pages, unretried_failures
from cgym.envs.api_report.tasks import ReportTask
from cgym.envs.critique import Critique
from cgym.envs.episode import Episode
from cgym.envs.rubric import Check, CheckResult, Rubric

MAX_REASONING_CHARS = 500
_FENCE = "```"


@dataclass(frozen=True)
class Report:
    """The final answer split into the JSON report (or the parse error) and the prose."""

    data: dict[str, Any] | None
    error: str | None
    reasoning: str


def extract_report(answer: str) -> Report:
    """Find the JSON object in a final answer: the last ```json fence, else the outer braces."""
    fences, outside = _split_fences(answer)
    if fences:
        block = fences[-1].removeprefix("json").strip()
        reasoning = "".join(outside).strip()
    else:
        start, end = answer.find("{"), answer.rfind("}")
        if start < 0:
            return Report(None, "no JSON object found in the answer", answer.strip())
        block = answer[start : end + 1] if end > start else answer[start:]
        reasoning = (answer[:start] + (answer[end + 1 :] if end > start else "")).strip()
    try:
        data = bounded_json.loads(block)
    except json.JSONDecodeError as exc:
        return Report(None, f"{exc.msg} at line {exc.lineno} column {exc.colno} (char {exc.pos})", reasoning)
    if not isinstance(data, dict):
        return Report(None, f"the report must be a JSON object, got {type(data).__name__}", reasoning)
    return Report(data, None, reasoning)


def _split_fences(text: str) -> tuple[list[str], list[str]]:
    """The insides of the closed ``` fences of `text` and the text outside them, in one pass."""
    fences: list[str] = []
    outside: list[str] = []
    done = 0
    while (start := text.find(_FENCE, done)) >= 0 and (end := text.find(_FENCE, start + len(_FENCE))) >= 0:
        outside.append(text[done:start])
        fences.append(text[start + len(_FENCE) : end])
        done = end + len(_FENCE)
    outside.append(text[done:])
    return fences, outside


def _report(episode: Episode) -> Report | None:
    return None if episode.final_answer is None else extract_report(episode.final_answer)


def valid_json(episode: Episode) -> CheckResult:
    report = _report(episode)
    if report is None:  # truncated: the env already says so
        return CheckResult.fail(None, -1.0)
    if report.error is not None:
        message = f"The final answer is not a parseable JSON report: {report.error}."
        return CheckResult.fail(Critique(episode.final_step, "json_parse_error", message, got=episode.final_answer), -1.0)
    return CheckResult.ok()


def fields_match(episode: Episode) -> CheckResult:
    task: ReportTask = episode.task
    report = _report(episode)
    if report is None or report.data is None:
        return CheckResult.fail(None)
    cause = _cause(task, episode.extras.get("calls", []))
    wrong = [c for name in task.fields if (c := _field_critique(episode.final_step, name, task.expected[name], report.data))]
    if not wrong:
        return CheckResult.ok()
    message = " ".join(c.message for c in wrong) + cause
    if len(wrong) > 1:
        message = f"{len(wrong)} of {len(task.fields)} fields are wrong. {message}"
    expected = {k: v for c in wrong for k, v in c.expected.items()}
    got = {k: v for c in wrong if c.got for k, v in c.got.items()}
    code = "field_mismatch" if any(c.code == "field_mismatch" for c in wrong) else "missing_field"
    score = 1.0 - len(wrong) / len(task.fields)
    return CheckResult.fail(Critique(episode.final_step, code, message, expected, got or None), score)


def _field_critique(step: int, name: str, expected: Any, data: dict[str, Any]) -> Critique | None:
    if name not in data:
        return Critique(step, "missing_field", f"The report has no field {name!r}.", {name: expected}, None)
    got = data[name]
    if _same(expected, got):
        return None
    return Critique(step, "field_mismatch", f"{name}: expected {expected!r} but the report says {got!r}.", {name: expected}, {name: got})


def _same(expected: Any, got: Any) -> bool:
    if isinstance(expected, bool) or isinstance(got, bool):
        return expected == got
    if isinstance(expected, int) and not isinstance(expected, bool):
        return isinstance(got, int) and got == expected
    if isinstance(expected, float):
        return isinstance(got, (int, float)) and abs(got - expected) <= 0.01
    return isinstance(got, str) and got.strip().casefold() == str(expected).strip().casefold()


def _cause(task: ReportTask, calls: list[ApiCall]) -> str:
    """A sentence on why the data may be off, from how the agent used the API."""
    problems = _process_critiques(task, calls, step=0)
    return f" Likely cause: {problems[0].message}" if problems else ""


def grounded(episode: Episode) -> CheckResult:
    task: ReportTask = episode.task
    if episode.final_answer is None:
        return CheckResult.fail(None)
    problems = _process_critiques(task, episode.extras.get("calls", []), episode.final_step)
    return CheckResult.fail(problems[0]) if problems else CheckResult.ok()


def _process_critiques(task: ReportTask, calls: list[ApiCall], step: int) -> list[Critique]:
    problems: list[Critique] = []
    for failed in unretried_failures(calls):
        problems.append(
            Critique(
                failed.step,
                "http_error_not_retried",
                f"{failed.tool} at step {failed.step} failed ({failed.error}, status {failed.status}) and was never retried.",
                expected="retry the same call",
                got=failed.error,
            )
        )
    if task.require_auth and calls and not any(c.ok and c.tool == "get_token" for c in calls):
        first = next((c for c in calls if c.tool != "get_token"), calls[0])
        problems.append(Critique(first.step, "auth_skipped", "The API needs a token: call get_token first and pass the token to every call.", "get_token", first.tool))
    if "order_count" in task.fields and any(c.ok and c.tool == "list_orders" for c in calls):
        missing = sorted(set(range(1, task.order_pages + 1)) - fetched_pages(calls, task.customer.id))
        if missing:
            pages = ", ".join(map(str, missing))
            last_page_call = max(c.step for c in calls if c.ok and c.tool == "list_orders")
            where = min(last_page_call + 1, step) if step else 0
            problems.append(Critique(where, "pagination_incomplete", f"Order page(s) {pages} of {task.order_pages} were never fetched.", task.order_pages, task.order_pages - len(missing)))
    needed = ["search_customers"] + (["list_orders"] if "order_count" in task.fields else []) + (["get_product"] if "top_product" in task.fields else [])
    for tool in needed:
        if not any(c.ok and c.tool == tool for c in calls):
            problems.append(Critique(step, "skipped_tool_call", f"The answer was given without a successful {tool} call.", tool, None))
            break
    return problems


def concise(episode: Episode) -> CheckResult:
    report = _report(episode)
    if report is None:
        return CheckResult.fail(None)
    if len(report.reasoning) <= MAX_REASONING_CHARS:
        return CheckResult.ok()
    message = f"The visible reasoning is {len(report.reasoning)} characters; keep it to {MAX_REASONING_CHARS}."
    return CheckResult.fail(Critique(episode.final_step, "reasoning_too_long", message, MAX_REASONING_CHARS, len(report.reasoning)))


def default_rubric(*, json_weight: float = 1.0, fields_weight: float = 2.0, grounded_weight: float = 0.5, concise_weight: float = 0.5) -> Rubric:
    """The article's weights (+1/-1 JSON, +2 fields, +0.5 concise) plus a grounding gate."""
    return Rubric(
        [
            Check("valid_json", valid_json, json_weight),
            Check("fields_match", fields_match, fields_weight),
            Check("grounded", grounded, grounded_weight),
            Check("concise", concise, concise_weight, gate=False),
        ]
    )
