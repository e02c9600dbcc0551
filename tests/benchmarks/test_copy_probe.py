from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from cgym.agents.eval.episodes import run_episodes
from cgym.agents.ledger import ChatEncoder
from cgym.agents.scripted import ScriptedPolicy
from cgym.benchmarks.copy_probe import FieldProbe, probe_episode, report_values, tally, value_group, value_spans
from cgym.envs.registration import make


def test_report_values_and_spans_point_at_each_value() -> None:
    answer = 'Looked up Ana.\n{"customer_id": 7, "email": "ana@mail.example.org", "tier": "gold"}'
    values = report_values(answer)
    spans = value_spans(answer, values)
    assert {key: answer[a:b] for key, (a, b) in spans.items()} == {"customer_id": "7", "email": "ana@mail.example.org", "tier": "gold"}
    with pytest.raises(ValueError, match="no JSON"):
        report_values("no report")
    with pytest.raises(ValueError, match="not in the answer"):
        value_spans(answer, {"tier": "silver"})


def test_emails_group_by_domain_and_tally_splits_few_valued_fields() -> None:
    assert value_group("email", "ana@mail.example.org") == "mail.example.org"
    assert value_group("tier", "gold") == "gold"
    rows = [
        {"tier": FieldProbe("standard", None, 0.9), "id": FieldProbe(1, None, 0.9)},
        {"tier": FieldProbe("standard", None, 0.7), "id": FieldProbe(2, ("2", "1"), 0.2)},
        {"tier": FieldProbe("gold", ("gold", "standard"), 0.1), "id": FieldProbe(3, None, 0.9)},
    ]
    out = tally(rows)
    assert out["tier"]["copied"] == pytest.approx(2 / 3, abs=1e-3)
    assert out["tier"]["p_value"] == pytest.approx(1.7 / 3, abs=1e-3)
    assert out["tier"]["by_value"] == {"gold": {"n": 1, "copied": 0.0, "p_value": 0.1}, "standard": {"n": 2, "copied": 1.0, "p_value": 0.8}}
    assert out["tier"]["top_misses"] == {"'gold' -> 'standard'": 1}
    assert "by_value" in out["id"]  # three distinct values: still few
    many = [{"id": FieldProbe(i, None, 0.9)} for i in range(20)]
    assert "by_value" not in tally(many)["id"]


class _Echo(torch.nn.Module):
    """Predicts the next token of one fixed sequence (optionally wrong at one position)."""

    def __init__(self, ids: list[int], vocab: int, wrong_at: int | None = None) -> None:
        super().__init__()
        self.ids, self.vocab, self.wrong_at = ids, vocab, wrong_at

    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        assert input_ids[0].tolist() == self.ids
        logits = torch.zeros(1, len(self.ids), self.vocab)
        for j in range(len(self.ids) - 1):
            target = self.ids[j + 1]
            logits[0, j, (target + 1) % self.vocab if j + 1 == self.wrong_at else target] = 1.0
        return SimpleNamespace(logits=logits)


def test_probe_episode_finds_the_value_token_a_model_misses(tiny_chat_model: Path) -> None:
    from transformers import AutoTokenizer

    encoder = ChatEncoder(AutoTokenizer.from_pretrained(tiny_chat_model))
    env = lambda: make("cgym/ApiReport-v0", difficulty="easy", split="test")  # noqa: E731
    result = next(
        r for r in run_episodes(env, ScriptedPolicy("oracle"), list(range(10_000, 10_010)), batch_size=10) if "email" in r.conversation.messages[-1]["content"]
    )
    ids, _ = encoder.encode_demo(result.conversation.messages, result.conversation.tools)
    vocab = len(encoder.tokenizer)
    clean = probe_episode(_Echo(ids, vocab), encoder, result)
    assert {key: p.miss for key, p in clean.items()} == {"customer_id": None, "email": None, "city": None}
    # one-hot logits of 1.0: each value token gets e / (e + vocab - 1)
    assert all(0.0 < p.p < 1.0 for p in clean.values())

    at = max(j for j, token in enumerate(ids) if "@" in encoder.tokenizer.decode([token]))  # the answer's email
    probes = probe_episode(_Echo(ids, vocab, wrong_at=at), encoder, result)
    assert probes["customer_id"].miss is None and probes["city"].miss is None
    assert probes["email"].p < clean["email"].p and probes["city"].p == clean["city"].p
    expected, preferred = probes["email"].miss
    assert expected == encoder.tokenizer.decode([ids[at]]) and preferred == encoder.tokenizer.decode([(ids[at] + 1) % vocab])
