"""Dependencies point one way: mock_apis <- envs <- agents <- trainer <- {cgym, benchmarks} (DESIGN.md).

Every package installs under the `cgym` namespace (`cgym.envs` is the envs/ folder); the CLI
modules (`cgym.cli`, `cgym.commands`) are the top layer. Every import counts, including those
inside functions: a lazy import back up the layers is still a cycle between packages. The CLI
may import `benchmarks` (the `bench` commands); `benchmarks` must not import the CLI. `envs`
never imports torch. No module imports a layer by its bare, un-namespaced name.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYER = {"mock_apis": 0, "envs": 1, "agents": 2, "trainer": 3, "benchmarks": 4, "cgym": 5}
FORBIDDEN = {"envs": {"torch"}}  # third-party packages a layer must not import


NAMESPACE = "cgym"


def layer_of(module: str) -> str:
    """'cgym.envs.core' -> 'envs'; 'cgym.cli' -> 'cgym' (the CLI); 'torch.nn' -> 'torch'."""
    head, _, rest = module.partition(".")
    if head == NAMESPACE and rest.split(".")[0] in LAYER:
        return rest.split(".")[0]
    return head if head != NAMESPACE or rest else NAMESPACE


def imported(source: str) -> set[str]:
    """The layer (or top-level package) of every absolute import in `source`, wherever it is written."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(layer_of(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == NAMESPACE:  # from cgym import envs
                names.update(layer_of(f"{NAMESPACE}.{alias.name}") for alias in node.names)
            else:
                names.add(layer_of(node.module))
    return names


def bare_imports(source: str) -> set[str]:
    """Layers imported by their un-namespaced name (`import cgym.envs`): they do not exist once installed."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names if a.name.split(".")[0] in LAYER and a.name.split(".")[0] != NAMESPACE)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.split(".")[0] in LAYER and node.module.split(".")[0] != NAMESPACE:
            found.add(node.module.split(".")[0])
    return found


def violations(package: str, source: str) -> list[str]:
    """Imports in a module of `package` that point up the layering, into a forbidden package, or
    name a layer outside the namespace."""
    bad = [f"{package} imports {name} outside the {NAMESPACE} namespace" for name in sorted(bare_imports(source))]
    for name in sorted(imported(source)):
        if name in LAYER and LAYER[name] > LAYER[package]:
            bad.append(f"{package} imports {name}")
        if name in FORBIDDEN.get(package, ()):
            bad.append(f"{package} imports {name}")
    return bad


def modules() -> list[tuple[str, Path]]:
    return [(package, path) for package in LAYER for path in sorted((ROOT / package).rglob("*.py"))]


@pytest.mark.parametrize(("package", "path"), modules(), ids=lambda v: str(v.relative_to(ROOT)) if isinstance(v, Path) else None)
def test_no_import_points_back_up_the_layers(package: str, path: Path) -> None:
    assert violations(package, path.read_text()) == []


@pytest.mark.parametrize(
    ("package", "source", "expected"),
    [
        pytest.param("agents", "def f():\n    from cgym.trainer.grpo import train\n", ["agents imports trainer"], id="lazy-import-up"),
        pytest.param("benchmarks", "import cgym.cli\n", ["benchmarks imports cgym"], id="benchmarks-imports-the-cli"),
        pytest.param("benchmarks", "from cgym import commands\n", ["benchmarks imports cgym"], id="benchmarks-imports-the-cli-from-the-namespace"),
        pytest.param("envs", "import torch.nn as nn\n", ["envs imports torch"], id="envs-imports-torch"),
        pytest.param("cgym", "from cgym.benchmarks.env_throughput import run\nfrom cgym.envs import make\n", [], id="cgym-may-import-benchmarks"),
        pytest.param("trainer", "from . import losses\nfrom cgym.agents.local.hf import HFPolicy\nfrom cgym import envs\n", [], id="relative-and-downward"),
        pytest.param("trainer", "from agents.local.hf import HFPolicy\n", ["trainer imports agents outside the cgym namespace"], id="bare-name"),
        pytest.param("envs", "from cgym import trainer\n", ["envs imports trainer"], id="from-the-namespace-up"),
    ],
)  # fmt: skip
def test_the_checker_catches_a_violation(package: str, source: str, expected: list[str]) -> None:
    assert violations(package, source) == expected


def test_every_package_is_scanned() -> None:
    scanned = {package for package, _ in modules()}
    assert scanned == set(LAYER)


def test_importing_envs_loads_no_torch() -> None:
    """The static check above, confirmed at run time: `import cgym.envs` (every built-in env) stays torch-free."""
    code = "import sys, cgym.envs, cgym.envs.api_report, cgym.envs.sql; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def module_name(package: str, path: Path) -> str:
    """envs/sql/env.py -> cgym.envs.sql.env; cgym/cli.py -> cgym.cli; a package's __init__.py -> the package."""
    parts = list(path.relative_to(ROOT / package).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([NAMESPACE, *([] if package == NAMESPACE else [package]), *parts])


def module_graph() -> dict[str, set[str]]:
    """Every module of the namespace -> the namespace modules it imports at run time, lazy imports included."""
    sources = {module_name(package, path): path.read_text() for package, path in modules()}
    graph: dict[str, set[str]] = {}
    for name, source in sources.items():
        targets: set[str] = set()
        tree = ast.parse(source)
        typing_only = {id(n) for guard in ast.walk(tree) if isinstance(guard, ast.If) and ast.unparse(guard.test).endswith("TYPE_CHECKING") for n in ast.walk(guard)}
        for node in ast.walk(tree):
            if id(node) in typing_only:  # `if TYPE_CHECKING:` imports never run
                continue
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                # `from cgym.agents import spec` imports the module cgym.agents.spec; `from cgym.agents.spec import load_policy` the module itself
                targets.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in sources else node.module for a in node.names)
        graph[name] = {t for t in targets if t in sources and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_no_module_import_cycles() -> None:
    """Not even lazy ones: a module that imports another must not be imported back by it, directly or around a loop."""
    assert cycles(module_graph()) == []


def test_the_cycle_finder_finds_a_loop_through_lazy_imports() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def room(module: str) -> str:
    """cgym.agents.local.hf -> agents.local; cgym.agents.spec -> agents; cgym.trainer.grpo -> trainer."""
    parts = module.split(".")[1:]
    return ".".join(parts[:2]) if len(parts) > 2 else parts[0] if parts else NAMESPACE


# rooms of agents/ that must not reach into each other: the engine and the remote back-ends are
# policies, the harness runs any policy without knowing which.
APART = {
    "agents.local": {"agents.remote", "agents.eval", "agents.scripted"},
    "agents.remote": {"agents.local", "agents.eval", "agents.scripted"},
    "agents.eval": {"agents.local", "agents.remote"},
}


def test_the_rooms_of_agents_stay_apart() -> None:
    crossing = sorted(f"{m} imports {t}" for m, targets in module_graph().items() for t in targets if room(t) in APART.get(room(m), ()))
    assert crossing == []


def test_the_eval_harness_loads_no_trainer() -> None:
    code = "import sys, cgym.agents.eval.compare, cgym.agents.eval.report, cgym.agents.eval.audit; sys.exit(any(m.startswith('cgym.trainer') for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0
