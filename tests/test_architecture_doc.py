"""docs/ARCHITECTURE.md names only modules that exist: every `hobson.*`, `launch.*`, `jobs.*` and
`aws.*` path in backticks imports (a name after the last module, such as a class, is an attribute)."""

import importlib
import re

import pytest

from tests.conftest import REPO

DOC = (REPO / "docs" / "ARCHITECTURE.md").read_text()
NAMES = sorted(set(re.findall(r"`((?:hobson|launch|jobs|aws)(?:\.\w+)+|hobson)`", DOC)))


def test_the_page_names_modules():
    assert len(NAMES) >= 30


@pytest.mark.parametrize("name", NAMES)
def test_named_module_exists(name):
    try:
        importlib.import_module(name)
    except ModuleNotFoundError:
        module, _, attr = name.rpartition(".")
        assert hasattr(importlib.import_module(module), attr), name
