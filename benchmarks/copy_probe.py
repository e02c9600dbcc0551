"""Does a model copy a report's values from the tool result, or guess them? A teacher-forced probe.

The oracle solves each episode; its transcript is fed to a model exactly as sampling lays it out
(`ChatEncoder.encode_demo`), and at every token of every value in the final JSON report the probe
asks whether the model's most likely next token is the oracle's. A value counts as copied when all
its tokens are. Results are grouped by the true value for fields with few distinct values (and by
domain for emails), where copying and guessing differ: a model that reads the tool result is right
for every value; one that falls back on its prior is right for the common value only, whatever the
tool said. For envs whose final answer is a JSON report (ApiReport); a diagnostic, so it lives here.

Usage:
    python -m cgym.benchmarks.copy_probe --model quickstart/sft --model quickstart/grpo/final \\
        --env-kwargs '{"difficulty": "easy"}' --episodes 300 --json runs/copy_probe.json

Runs the oracle on the test episodes, then probes every model on its transcripts (teacher-forced):
per report field, the share of values whose every token is the model's top choice and the mean
probability of the right value, broken down by value for few-valued fields, and the most common
token misses.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from cgym.agents.eval.episodes import EpisodeResult, run_episodes
from cgym.agents.ledger import ChatEncoder
from cgym.agents.scripted import ScriptedPolicy
from cgym.benchmarks.output import emit
from cgym.envs.api_report.checks import extract_report
from cgym.envs.registration import make
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

MAX_GROUPS = 8  # fields with at most this many distinct values are broken down by value


def report_values(answer: str) -> dict[str, Any]:
    """The JSON report in a final answer, parsed as the env's checks parse it."""
    report = extract_report(answer)
    if report.data is None:
        raise ValueError(f"{report.error}: {answer!r}")
    return report.data


def value_spans(answer: str, values: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Character span of each field's value in `answer` (inside the quotes for strings)."""
    spans = {}
    for key, value in values.items():
        pair = f"{json.dumps(key)}: {json.dumps(value)}"
        at = answer.find(pair)
        if at < 0:
            raise ValueError(f"{pair!r} is not in the answer: {answer!r}")
        start = at + len(json.dumps(key)) + 2
        end = start + len(json.dumps(value))
        spans[key] = (start + 1, end - 1) if isinstance(value, str) else (start, end)
    return spans


def token_offsets(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> list[tuple[int, int]]:
    """Character span of each token in the decoded text of `ids`."""
    offsets, end = [], 0
    for k in range(len(ids)):
        new_end = len(tokenizer.decode(list(ids[: k + 1])))
        offsets.append((end, new_end))
        end = new_end
    return offsets


def value_group(key: str, value: Any) -> str:
    """What a value is grouped by: an email's domain, otherwise the value itself."""
    text = str(value)
    return text.split("@", 1)[1] if key == "email" and "@" in text else text


class FieldProbe(NamedTuple):
    """One report value, teacher-forced: the value, the first of its tokens the model got wrong
    as (expected, the model's top choice) or None, and the probability the model gives it."""

    value: Any
    miss: tuple[str, str] | None
    p: float


def probe_episode(model: torch.nn.Module, encoder: ChatEncoder, result: EpisodeResult) -> dict[str, FieldProbe]:
    """Probe every field of the episode's final report."""
    messages, tools = result.conversation.messages, result.conversation.tools
    ids, mask = encoder.encode_demo(messages, tools)
    answer = str(messages[-1]["content"])
    # the last assistant turn: the sampled ids after the last unsampled one, minus end-of-turn
    first = max(i for i, m in enumerate(mask) if m == 0) + 1
    answer_ids = ids[first:-1]
    if encoder.tokenizer.decode(answer_ids) != answer:
        raise ValueError("the answer's tokens do not decode to its text")
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    top = logp.argmax(-1).tolist()  # top[j] predicts ids[j + 1]
    offsets = token_offsets(encoder.tokenizer, answer_ids)
    decode = encoder.tokenizer.decode
    values = report_values(answer)
    probes: dict[str, FieldProbe] = {}
    for key, (start, end) in value_spans(answer, values).items():
        positions = [first + k for k, (a, b) in enumerate(offsets) if a < end and b > start]
        wrong = next((j for j in positions if top[j - 1] != ids[j]), None)
        miss = None if wrong is None else (decode([ids[wrong]]), decode([top[wrong - 1]]))
        probes[key] = FieldProbe(values[key], miss, math.exp(sum(float(logp[j - 1, ids[j]]) for j in positions)))
    return probes


def tally(rows: Sequence[dict[str, FieldProbe]], *, confusions: int = 5) -> dict[str, Any]:
    """Per field: how often the value was copied (all its tokens the top choice) and the mean
    probability of the right value, overall and per value group for few-valued fields; and the
    most common misses as `expected -> preferred` token counts."""
    by_field: dict[str, list[tuple[str, FieldProbe]]] = defaultdict(list)
    for probes in rows:
        for key, field_probe in probes.items():
            by_field[key].append((value_group(key, field_probe.value), field_probe))
    out: dict[str, Any] = {}
    for key, cells in sorted(by_field.items()):
        missed = Counter(f"{c.miss[0]!r} -> {c.miss[1]!r}" for _, c in cells if c.miss is not None)
        entry: dict[str, Any] = {**_rates([c for _, c in cells]), "top_misses": dict(missed.most_common(confusions))}
        groups: dict[str, list[FieldProbe]] = defaultdict(list)
        for group, cell in cells:
            groups[group].append(cell)
        if len(groups) <= MAX_GROUPS:
            entry["by_value"] = {group: _rates(cells) for group, cells in sorted(groups.items())}
        out[key] = entry
    return out


def _rates(cells: Sequence[FieldProbe]) -> dict[str, Any]:
    return {
        "n": len(cells),
        "copied": round(sum(c.miss is None for c in cells) / len(cells), 3),
        "p_value": round(sum(c.p for c in cells) / len(cells), 3),
    }


def oracle_transcripts(env_id: str, env_kwargs: dict[str, Any], seeds: Sequence[int]) -> list[EpisodeResult]:
    """The oracle's solved episodes on `seeds` (test split unless `env_kwargs` says otherwise)."""
    kwargs = {"split": "test", **env_kwargs}
    results = run_episodes(lambda: make(env_id, **kwargs), ScriptedPolicy("oracle", env_id=env_id), list(seeds), batch_size=len(seeds))
    return [r for r in results if r.success]


def probe_model(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, transcripts: Sequence[EpisodeResult]) -> dict[str, Any]:
    """`tally` of one model over the oracle's transcripts."""
    encoder = ChatEncoder(tokenizer)
    return tally([probe_episode(model, encoder, r) for r in transcripts])


def probe(model_dirs: Sequence[str], env_id: str, env_kwargs: dict[str, Any], seeds: Sequence[int]) -> dict[str, Any]:
    """Probe every model directory on the oracle's transcripts of `seeds`."""
    transcripts = oracle_transcripts(env_id, env_kwargs, seeds)
    report: dict[str, Any] = {"env": env_id, "env_kwargs": {"split": "test", **env_kwargs}, "episodes": len(transcripts), "models": {}}
    for path in model_dirs:
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        report["models"][path] = probe_model(model, AutoTokenizer.from_pretrained(path), transcripts)
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", required=True, help="a model directory; repeat to compare")
    parser.add_argument("--env", default="cgym/ApiReport-v0")
    parser.add_argument("--env-kwargs", type=json.loads, default={}, help='JSON, e.g. \'{"difficulty": "easy"}\'')
    parser.add_argument("--episodes", type=int, default=300)
    parser.add_argument("--seed", type=int, default=10_000, help="first test seed (the trainer's evaluation seeds by default)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.episodes < 1:
        parser.error("--episodes must be >= 1")
    emit(probe(args.model, args.env, args.env_kwargs, range(args.seed, args.seed + args.episodes)), args.json)


if __name__ == "__main__":
    main()
