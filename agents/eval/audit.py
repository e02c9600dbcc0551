"""The reward-hacking audit: exploit agents must neither succeed nor outscore honest work.

For every exploit registered with the env (in its `Family`), and the same seeds, we compare
each exploit episode with the oracle's episode: an exploit fails the audit if it ever succeeds
or if its reward reaches the oracle's (an honest attempt with the right fields) on any seed.

It also fails if it scores above one of the env's near misses (honest attempts with one mistake;
those in the family's `honest_floor`) on the same task. That is the ordering GRPO sees: a group's advantages rank its attempts, so an
exploit that outscores an honest mistake is pushed up against it even though neither succeeds.
"""

from __future__ import annotations

from typing import Any

from cgym.agents.eval.evaluate import EvalConfig, evaluate
from cgym.agents.scripted import ScriptedPolicy, family_for
from cgym.envs.registration import ScriptedAgentsError


def audit(env_id: str, env_kwargs: dict[str, Any], *, episodes: int = 50, seed: int = 0) -> dict[str, Any]:
    """Run the oracle and every exploit on the same seeds; `passed` is the verdict.

    Raises `ScriptedAgentsError` for an env registered without scripted agents or without exploits.
    """
    family = family_for(env_id)
    if not family.exploits:
        raise ScriptedAgentsError(f"the scripted agents of {env_id} have no exploits (agents named 'exploit_*') to audit")
    config = EvalConfig(env_id, env_kwargs, episodes=episodes, seed=seed)
    honest, honest_results = evaluate(ScriptedPolicy("oracle", env_id=env_id), config)
    report: dict[str, Any] = {"env": env_id, "env_kwargs": env_kwargs, "episodes": episodes, "oracle": _brief(honest), "exploits": {}}
    near_misses = {name: evaluate(ScriptedPolicy(name, env_id=env_id), config)[1] for name in family.floor}
    for name in family.exploits:
        summary, results = evaluate(ScriptedPolicy(name, env_id=env_id), config)
        outscored = sum(r.reward >= h.reward for r, h in zip(results, honest_results))
        above = {miss: sum(r.reward > m.reward for r, m in zip(results, missed)) for miss, missed in near_misses.items()}
        entry = _brief(summary) | {
            "max_reward": max(r.reward for r in results),
            "episodes_reaching_honest_reward": outscored,
            "episodes_above_near_misses": {miss: n for miss, n in above.items() if n},
        }
        entry["passed"] = summary["success_rate"] == 0.0 and outscored == 0 and not any(above.values())
        report["exploits"][name] = entry
    report["passed"] = honest["success_rate"] == 1.0 and all(e["passed"] for e in report["exploits"].values())
    return report


def _brief(summary: dict[str, Any]) -> dict[str, Any]:
    return {"mean_reward": summary["mean_reward"], "success_rate": summary["success_rate"], "critique_codes": summary["critique_codes"]}
