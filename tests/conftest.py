import os
import sys

# the tests import the package from the checkout (built in place by `pip install -e .`), and the
# shared helpers (hf_reference, fp8_weights, ...) from tests/helpers/
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "helpers"))


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (the test command's -n auto --dist loadgroup): the tests that share a
    module-scoped fixture (a layer built once, checkpoints written once) form one group, which
    runs on one worker, so the fixture is computed once, not once a worker; every other test
    goes to whichever worker is free. (The executor's modules, one subprocess each, mark their
    own group: tests/executor/conftest.py.)"""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    import pytest

    parent: dict = {}

    def root(a):
        while parent.setdefault(a, a) != a:
            a = parent[a]
        return a

    shared = {}
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        names = [f"{item.nodeid.split('::')[0]}::{name}" for name, defs in (info.name2fixturedefs if info else {}).items()
                 if defs and defs[-1].scope == "module"]
        for a in names[1:]:
            parent[root(a)] = root(names[0])
        shared[item] = names[0] if names else None
    for item, name in shared.items():
        if name is not None:
            item.add_marker(pytest.mark.xdist_group(root(name)))
