"""Registering envs with Gymnasium, making them with clear errors, and third-party plugins.

Built-in envs live under the `cgym/` namespace. Third-party packages add theirs through the
entry-point group ``cgym.envs``: each entry point names a callable that calls `register`
(or a module whose import does)::

    [project.entry-points."cgym.envs"]
    myorg = "myorg_envs:register_all"
"""

from __future__ import annotations

import importlib.metadata
import inspect
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
from gymnasium.envs.registration import load_env_creator

from envs.errors import CgymError, InvalidEnvKwargError, UnknownEnvError, did_you_mean

ENTRY_POINT_GROUP = "cgym.envs"
_ID = re.compile(r"^(?:[\w.-]+/)?[\w.-]+-v\d+$")


@dataclass(frozen=True)
class EnvSpec:
    """What `cgym envs` lists about a registered env."""

    id: str
    entry_point: str
    description: str = ""
    defaults: dict[str, Any] = field(default_factory=dict)


_SPECS: dict[str, EnvSpec] = {}
_plugins_loaded = False


def register(env_id: str, entry_point: str, *, description: str = "", **defaults: Any) -> EnvSpec:
    """Register an env with Gymnasium (and `cgym envs`). `defaults` become its default kwargs."""
    if not _ID.match(env_id):
        raise CgymError(f"env id {env_id!r} must look like 'namespace/Name-v0'")
    gym.register(id=env_id, entry_point=entry_point, kwargs=defaults)
    spec = EnvSpec(env_id, entry_point, description, dict(defaults))
    _SPECS[env_id] = spec
    return spec


def registered() -> dict[str, EnvSpec]:
    """Every env registered through critique-gym (built-ins and plugins), by id."""
    load_plugins()
    return dict(_SPECS)


def make(env_id: str, **kwargs: Any) -> gym.Env:
    """`gymnasium.make` with a did-you-mean for unknown ids and a check of the kwargs."""
    load_plugins()
    if env_id not in gym.registry:
        known = sorted(_SPECS) or sorted(gym.registry)
        raise UnknownEnvError(f"no env registered as {env_id!r}; registered: {sorted(_SPECS)}.{did_you_mean(env_id, known)}")
    _check_kwargs(env_id, kwargs)
    return gym.make(env_id, **kwargs)


def _check_kwargs(env_id: str, kwargs: dict[str, Any]) -> None:
    creator = load_env_creator(gym.registry[env_id].entry_point)
    params = inspect.signature(creator).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    accepted = [name for name in params if name != "self"] + ["render_mode", "max_episode_steps", "disable_env_checker"]
    for name in kwargs:
        if name not in accepted:
            raise InvalidEnvKwargError(
                f"{env_id} does not take {name!r}; it takes {sorted(set(accepted))}.{did_you_mean(name, accepted)}"
            )


def load_plugins() -> None:
    """Import every ``cgym.envs`` entry point once; a broken plugin warns instead of failing."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            target = entry.load()
            if callable(target):
                target()
        except Exception as exc:  # noqa: BLE001 - one bad plugin must not hide the others
            warnings.warn(f"cgym.envs plugin {entry.name!r} failed to load: {exc}", stacklevel=2)
