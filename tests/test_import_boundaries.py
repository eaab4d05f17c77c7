"""Import boundaries, read from the source with ``ast`` (no module is imported).

- Stages never know their backend: nothing under src/hobson or jobs/ imports hobson.launch.
- The RL rooms are layered, models <- rollout <- rl: models/ imports neither rollout/ nor rl/,
  rollout/ never imports rl/.
- The AWS room (aws/) never imports the launcher; the launcher's aws backend adapts it.
- No installed module (src/hobson, launch/, jobs/, aws/) imports another that imports it back,
  directly or around a loop.

Every import in a file counts, including those inside functions: a late import still makes the
importing module depend on the imported one, it only hides the cycle until the call.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import REPO

SRC = REPO / "src"

# lowest first: a module of a layer may import its own layer and the ones before it, never one after
LAYERS = ("hobson.models", "hobson.rollout", "hobson.rl")


def test_stage_code_never_imports_the_launcher():
    offenders = []
    for path in list((REPO / "src" / "hobson").rglob("*.py")) + list((REPO / "jobs").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.relative_to(REPO)}: {n}" for n in names
                          if n in ("launch", "hobson.launch") or n.startswith(("launch.", "hobson.launch."))]
    assert offenders == []


# where each installed package's source lives (setup.py's package_dir): src/hobson, and the
# checkout folders installed inside it
ROOTS = {"hobson": SRC / "hobson", "hobson.launch": REPO / "launch", "hobson.jobs": REPO / "jobs",
         "hobson.aws": REPO / "aws"}


def _modules(roots: dict[str, Path] | None = None) -> dict[str, Path]:
    """Dotted name -> file of every installed module (a package is its ``__init__.py``)."""
    modules = {}
    for package, root in (roots or ROOTS).items():
        for path in sorted(root.rglob("*.py")):
            parts = (*package.split("."), *path.relative_to(root).with_suffix("").parts)
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(module: str, path: Path) -> Iterator[tuple[int, str, list[str]]]:
    """``(line, base, names)`` for each import in the file, relative ones made absolute.

    ``import a.b`` gives ``("a.b", [])``; ``from a import b, c`` gives ``("a", ["b", "c"])``; so does
    ``importlib.import_module("a.b")`` with a literal name, as ``("a.b", [])``.
    """
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            yield node.lineno, base, [a.name for a in node.names]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.lineno, node.args[0].value, []


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _layer(name: str) -> int | None:
    return next((i for i, p in enumerate(LAYERS) if _within(name, p)), None)


def test_rl_rooms_are_layered_models_rollout_rl():
    offenders = []
    for module, path in _modules().items():
        own = _layer(module)
        if own is None:
            continue
        for line, base, names in _imports(module, path):
            # `from hobson import rl` names the package only through its alias
            for target in [base] + [f"{base}.{n}" for n in names]:
                layer = _layer(target)
                if layer is not None and layer > own:
                    offenders.append(f"{path.relative_to(REPO)}:{line}: {LAYERS[own]} imports {target}")
    assert offenders == [], "layers are models <- rollout <- rl; these import upward:\n" + "\n".join(offenders)


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules under src/hobson it imports anywhere in its file.

    ``from hobson.x import y`` is an edge to ``hobson.x.y`` when that is a module, else to
    ``hobson.x``; ``import hobson.x.y`` to ``hobson.x.y``. The package ``__init__`` that Python runs
    before a submodule is not an edge: an ``__init__`` re-exporting its submodules would otherwise
    always be a cycle, and it is not one a module author can create or break.
    """
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        edges = set()
        for _, base, names in _imports(module, path):
            for name in names:
                if f"{base}.{name}" in modules:
                    edges.add(f"{base}.{name}")
                elif base in modules:
                    edges.add(base)
            if not names:
                # the longest prefix that is ours: `import hobson.x.y` where y is an attribute is hobson.x
                parts = base.split(".")
                while parts and ".".join(parts) not in modules:
                    parts.pop()
                if parts:
                    edges.add(".".join(parts))
        edges.discard(module)
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle ``[a, b, ..., a]`` of the graph, or None; depth first, in sorted order (stable reports)."""
    done: set[str] = set()
    for root in sorted(graph):
        if root in done:
            continue
        path, on_path = [root], {root}
        stack = [iter(sorted(graph[root]))]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                stack.pop()
                done.add(path[-1])
                on_path.discard(path.pop())
            elif nxt in on_path:
                return path[path.index(nxt) :] + [nxt]
            elif nxt not in done:
                path.append(nxt)
                on_path.add(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_find_cycle_reports_the_loop():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"b"}}) == ["b", "c", "b"]
    assert find_cycle({"x": {"y"}, "y": {"z"}, "z": {"x"}}) == ["x", "y", "z", "x"]


def test_import_graph_sees_late_and_relative_imports(tmp_path):
    pkg = tmp_path / "p"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from p.sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("from . import b\n")
    (pkg / "sub" / "b.py").write_text("from ..a import f\nimport p.sub.b as me\n")
    modules = {"p": pkg / "__init__.py", "p.a": pkg / "a.py", "p.sub": pkg / "sub" / "__init__.py"}
    modules["p.sub.b"] = pkg / "sub" / "b.py"
    graph = import_graph(modules)
    assert graph == {"p": set(), "p.a": {"p.sub.b"}, "p.sub": {"p.sub.b"}, "p.sub.b": {"p.a"}}
    assert find_cycle(graph) == ["p.a", "p.sub.b", "p.a"]


def test_the_aws_room_never_imports_the_launcher():
    """The launcher's aws backend adapts hobson.aws.session; the AWS room does not call back."""
    aws = _modules({"hobson.aws": ROOTS["hobson.aws"]})
    assert {"hobson.aws.session", "hobson.aws.remote", "hobson.aws.runner"} <= set(aws)
    offenders = [f"{path.relative_to(REPO)}:{line}: {base}" for module, path in aws.items()
                 for line, base, names in _imports(module, path)
                 if any(_within(t, "hobson.launch") for t in [base] + [f"{base}.{n}" for n in names])]
    assert offenders == []


def test_no_import_cycle_in_any_installed_module():
    """src/hobson and the launch/, jobs/ and aws/ folders installed inside it."""
    modules = _modules()
    assert {"hobson.launch.submit", "hobson.launch.backends.aws", "hobson.jobs.rl", "hobson.aws.runner"} <= set(modules)
    graph = import_graph(modules)
    # the graph must see what it guards: the trainer's late import of the vLLM engine, in a function
    assert "hobson.rollout.vllm_engine" in graph["hobson.rl.loop"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
