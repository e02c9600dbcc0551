"""The refinement benchmark's plumbing, on scripted agents (no model needed)."""

from __future__ import annotations

from cgym.agents.scripted import ScriptedPolicy
from cgym.benchmarks.refine_success import STYLES, refine_failures

from cgym import envs  # noqa: F401

ENV = "cgym/ApiReport-v0"
KWARGS = {"difficulty": "easy", "split": "test"}


def test_every_failure_is_refined_once_per_style_and_a_persistent_slip_stays_wrong() -> None:
    report = refine_failures(ScriptedPolicy("typo"), ENV, KWARGS, [10, 11, 12, 13])
    assert report["episodes"] == 4 and report["failed"] == 4
    assert set(report["styles"]) == set(STYLES)
    for style in STYLES:
        figures = report["styles"][style]
        assert figures["refined"] == 4 and figures["succeeded"] == 0  # the scripted slip ignores critiques
        example = figures["examples"][0]
        assert example["critique"] and example["before"] and example["after"]
    assert "expected" in report["styles"]["step"]["examples"][0]["critique"]
    assert report["first_attempts"]["turns"] and all(t >= 1 for t in report["first_attempts"]["turns"])
    assert report["first_attempts"]["tools"] and report["first_attempts"]["tools_in_successes"] == {}  # every first attempt failed
    assert len(report["styles"]["step"]["turns"]) == 4


def test_max_failures_caps_the_refinements() -> None:
    report = refine_failures(ScriptedPolicy("typo"), ENV, KWARGS, [10, 11, 12, 13], ("indicative",), max_failures=2)
    assert report["failed"] == 2 and report["styles"]["indicative"]["refined"] == 2


def test_a_policy_that_never_fails_has_nothing_to_refine() -> None:
    report = refine_failures(ScriptedPolicy("oracle"), ENV, KWARGS, [10, 11])
    assert report["failed"] == 0
    assert all(figures["refined"] == figures["succeeded"] == 0 and figures["turns"] == [] for figures in report["styles"].values())
