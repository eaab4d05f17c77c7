"""Stages never know their backend: nothing under src/hobson or jobs/ imports launch."""

import ast

from tests.conftest import REPO


def test_stage_code_never_imports_the_launcher():
    offenders = []
    for path in list((REPO / "src" / "hobson").rglob("*.py")) + list((REPO / "jobs").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.relative_to(REPO)}: {n}" for n in names if n == "launch" or n.startswith("launch.")]
    assert offenders == []
