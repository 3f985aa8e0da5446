import os
import re
import sys

import pytest

# Idle threads sleep instead of spinning: under the parallel suite (-n auto, a process a core)
# the OpenMP threads of the extension and torch and numpy's OpenBLAS threads spin-wait after
# each parallel region on cores another worker needs (a third of the suite's CPU time on 2
# cores). Set before anything loads those libraries, which read these once; a value the caller
# set is kept. The kernels' threads and their splits are the same either way.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# the tests import the package from the checkout (built in place by `pip install -e .`), and the
# shared helpers (hf_reference, fp8_weights, ...) from tests/helpers/
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "helpers"))


def pytest_configure(config):
    """under CI=true, a missing qwen3layer._testing stops the suite (tests/helpers/ci_checks.py)"""
    import ci_checks

    ci_checks.require_testing_in_ci()


@pytest.fixture
def opened(monkeypatch):
    """every shard DecoderLayer.from_checkpoint opens (qwen3layer.checkpoint.open_shard), to
    check that a failed load closes them, or refused before opening any"""
    import qwen3layer.checkpoint as checkpoint

    shards = []
    real = checkpoint.open_shard

    def recording(*args):
        shards.append(real(*args))
        return shards[-1]

    monkeypatch.setattr(checkpoint, "open_shard", recording)
    return shards


# A module whose tests share state computed once per process (a module- or session-scoped
# fixture: a layer built, checkpoints written; or the executor's one subprocess a module,
# tests/executor/conftest.py) is read from its source by this pattern
SHARES_STATE = re.compile(r"""scope=["'](module|session)["']|executor_subprocess""")


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: unknown where it is absent or off
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's work units under the test command's -n (its default --dist load; another
    --dist named on the command line is left alone): the whole module for a module that shares
    state between its tests (SHARES_STATE), so that state is computed once, on one worker, not
    once a worker; each test alone otherwise, to whichever worker is free. The executor's modules
    (tests/executor/: subprocesses of a minute) are handed out first, the rest in collection
    order, so that no long unit starts last. (xdist's own --dist loadgroup would do the first
    part, but it marks groups in node ids in a way pytest 9.2's node ids no longer take.)"""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    shares: dict = {}

    def module_shares_state(module: str) -> bool:
        if module not in shares:
            try:
                with open(os.path.join(str(config.rootpath), module), encoding="utf-8") as f:
                    shares[module] = bool(SHARES_STATE.search(f.read()))
            except OSError:
                shares[module] = True  # unknown: kept together, as xdist's loadscope would
        return shares[module]

    class ModulesThatShareStateTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if module_shares_state(module) else nodeid

        def _assign_work_unit(self, node):
            first = next((scope for scope in self.workqueue if scope.startswith("tests/executor/")), None)
            if first is not None:  # the executor's units before the others
                self.workqueue.move_to_end(first, last=False)
            super()._assign_work_unit(node)

    config.option.loadscopereorder = False  # the order above, not xdist's (most tests first)
    return ModulesThatShareStateTogether(config, log)
