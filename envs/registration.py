"""Registering envs with Gymnasium, making them with clear errors, and third-party plugins.

Built-in envs live under the `cgym/` namespace. Gymnasium's registry is the one registry: its
spec holds an env's entry point and default kwargs. What Gymnasium has no field for lives in a
side table of `EnvCard`s: the env's description and, optionally, its scripted agents (an oracle,
flawed agents and exploits, as an `agents.scripted.Family`), named by a ``"module:attr"`` string
that is imported only when a scripted policy or the audit asks for it::

    register("myorg/Foo-v0", "myorg_envs.foo:FooEnv", agents="myorg_envs.foo_agents:FAMILY")

A plugin whose package calls `register` on import works with a bare Gymnasium through
Gymnasium's own module prefix, which imports the module before it looks the id up (Gymnasium 1.x
has no plugin entry points; 0.26-0.29 had them)::

    gymnasium.make("myorg_envs:myorg/Foo-v0")

The same prefixed id works everywhere critique-gym takes an env id (`--env`, `make`). For the bare
id, plugins may also add an entry point to the group ``cgym.envs``, naming a callable that calls
`register` (or a module whose import does); they load on ``import cgym.envs``::

    [project.entry-points."cgym.envs"]
    myorg = "myorg_envs:register_all"
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import re
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
from cgym.envs.errors import CgymError, InvalidChoiceError, InvalidEnvKwargError, UnknownEnvError, did_you_mean
from cgym.envs.kwarg_types import annotations_of, choices_of, describe, fits
from gymnasium.envs.registration import load_env_creator

ENTRY_POINT_GROUP = "cgym.envs"
_ID = re.compile(r"^(?:[\w.-]+/)?[\w.-]+-v\d+$")


@dataclass(frozen=True)
class EnvCard:
    """What Gymnasium's registry has no field for: an env's description and its scripted agents.

    `entry_point` and `defaults` are read from Gymnasium's spec, the one place they are kept.
    """

    id: str
    description: str = ""
    agents: Any = None  # the env's scripted agents: an object, a "module:attr" string, or None

    @property
    def entry_point(self) -> str:
        entry = gym.registry[self.id].entry_point
        return entry if isinstance(entry, str) else f"{entry.__module__}:{entry.__qualname__}"

    @property
    def defaults(self) -> dict[str, Any]:
        return dict(gym.registry[self.id].kwargs)

    def load_agents(self) -> Any:
        """The env's scripted agents (imported now if `agents` names them), or None."""
        if not isinstance(self.agents, str):
            return self.agents
        module, _, attr = self.agents.partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise ScriptedAgentsError(f"cannot load the scripted agents {self.agents!r} of {self.id}: {exc}") from None


class ScriptedAgentsError(CgymError):
    """An env registered without scripted agents, or whose agents cannot be loaded."""


_CARDS: dict[str, EnvCard] = {}
_plugins_loaded = False  # every entry point loaded (none deferred)
_plugins_loading = False
_plugins_done: set[str] = set()  # names of the entry points already loaded


def register(env_id: str, entry_point: str, *, description: str = "", agents: Any = None, **defaults: Any) -> EnvCard:
    """Register an env with Gymnasium (and `cgym envs`). `defaults` become its default kwargs.

    `agents` names the env's scripted agents (``"module:attr"`` or the object itself), so that
    `scripted:oracle` and `cgym audit` work on it.
    """
    if not _ID.match(env_id):
        raise CgymError(f"env id {env_id!r} must look like 'namespace/Name-v0'")
    if isinstance(agents, str) and ":" not in agents:
        raise ScriptedAgentsError(f"agents={agents!r} of {env_id} must look like 'module:attr'")
    gym.register(id=env_id, entry_point=entry_point, kwargs=dict(defaults))
    card = EnvCard(env_id, description, agents)
    _CARDS[env_id] = card
    return card


def registered() -> dict[str, EnvCard]:
    """Every env registered through critique-gym (built-ins and plugins) and still in Gymnasium's registry, by id."""
    load_plugins()
    return {env_id: card for env_id, card in _CARDS.items() if env_id in gym.registry}


def resolve_id(env_id: str) -> str:
    """Gymnasium's ``module:namespace/Name-v0`` -> ``namespace/Name-v0``, importing `module` first
    (its import registers the env); a bare id comes back as is."""
    module, sep, bare = env_id.rpartition(":")
    if not sep:
        return env_id
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise UnknownEnvError(f"cannot import {module!r}, the module of the env id {env_id!r}: {exc}") from None
    return bare


def make(env_id: str, **kwargs: Any) -> gym.Env:
    """`gymnasium.make` with a did-you-mean for unknown ids and a check of the kwargs."""
    env_id = _require(env_id)
    _check_kwargs(env_id, kwargs)
    return gym.make(env_id, **kwargs)


def takes_kwarg(env_id: str, name: str) -> bool:
    """Whether `make(env_id, name=...)` is accepted (e.g. pass `split` only to envs that take it)."""
    env_id = _require(env_id)
    accepted = _accepted(env_id)
    return accepted is None or name in accepted


def _require(env_id: str) -> str:
    """The bare id of a registered env (after the plugins load, and a ``module:`` prefix's import)."""
    load_plugins()
    env_id = resolve_id(env_id)
    if env_id not in gym.registry:
        ours = sorted(registered())
        raise UnknownEnvError(f"no env registered as {env_id!r}; registered: {ours}.{did_you_mean(env_id, ours or sorted(gym.registry))}")
    return env_id


def _accepted(env_id: str) -> list[str] | None:
    """The kwargs an env's creator takes (plus Gymnasium's own), or None if it takes any."""
    params = inspect.signature(_creator(env_id)).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return [name for name in params if name != "self"] + ["render_mode", "max_episode_steps", "disable_env_checker"]


def _creator(env_id: str) -> Any:
    entry_point = gym.registry[env_id].entry_point
    return entry_point if callable(entry_point) else load_env_creator(entry_point)


def _check_kwargs(env_id: str, kwargs: dict[str, Any]) -> None:
    accepted = _accepted(env_id)
    if accepted is None:
        return
    for name in kwargs:
        if name not in accepted:
            raise InvalidEnvKwargError(
                f"{env_id} does not take {name!r}; it takes {sorted(set(accepted))}.{did_you_mean(name, accepted)}"
            )
    hints = annotations_of(_creator(env_id))
    for name, value in kwargs.items():
        if name in hints and not fits(value, hints[name]):
            shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
            message = f"{env_id}: {name}={shown} does not fit; it takes {describe(hints[name])}."
            if choices := choices_of(hints[name]):
                raise InvalidChoiceError(message + did_you_mean(str(value), [str(c) for c in choices]))
            raise InvalidEnvKwargError(message)


def load_plugins() -> None:
    """Import every ``cgym.envs`` entry point once; a broken plugin warns instead of failing.

    `import cgym.envs` calls this, last. Import cycles are safe both ways: a plugin that imports
    `envs` while `envs` loads it finds every name defined and this call already running; a
    plugin imported first, whose own ``import cgym.envs`` lands here, is still half-imported, so it
    is loaded by the next call (`make`, `registered`, ...) once its import has finished.
    """
    global _plugins_loaded, _plugins_loading
    if _plugins_loaded or _plugins_loading:
        return
    _plugins_loading = True
    deferred = False
    try:
        for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if entry.name in _plugins_done:
                continue
            if _importing(entry.module):
                deferred = True
                continue
            _plugins_done.add(entry.name)
            try:
                target = entry.load()
                if callable(target):
                    target()
            except Exception as exc:  # noqa: BLE001 - one bad plugin must not hide the others
                warnings.warn(f"cgym.envs plugin {entry.name!r} failed to load: {exc}", stacklevel=2)
    finally:
        _plugins_loading = False
    _plugins_loaded = not deferred


def _importing(module: str) -> bool:
    """True while `module` is being imported (its spec is marked initializing until it is done)."""
    found = sys.modules.get(module)
    return bool(getattr(getattr(found, "__spec__", None), "_initializing", False))
