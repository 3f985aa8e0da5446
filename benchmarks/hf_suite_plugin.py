"""The pytest plugin of benchmarks/hf_suite.py, for one run of transformers' tests/models/qwen3_moe.
hf_suite.py copies it into a temporary folder as qwen3layer_hf_suite.py with its settings beside
it (qwen3layer_hf_suite.json: {"patch": bool, "compat": {name: value}}) and loads it with
`-p qwen3layer_hf_suite`. Both runs load it; only "patch" differs:

  - the tester's hidden_act is set to "silu" after the tester's __init__ (get_config reads it
    from the tester);
  - each test starts from seeds of its own (crc32 of its id) in python's random, numpy, torch
    and the tests' global_rng (ids_tensor's inputs), whichever worker runs it after whichever
    tests;
  - names of "compat" that transformers.testing_utils lacks are added to it, and huggingface_hub's
    http client stands in for httpx where that package is absent (a tree of another version's
    tests: hf_suite.py's save_compat);
  - with "patch", Qwen3MoeModel.__call__ patches the model (qwen3layer.torch.patch_model) at its
    first call: hf_suite.py's docstring says why there.

What it did goes to $HF_SUITE_NOTES/<pid>, a line each, read back by hf_suite.py.
"""
import json
import os
import sys
from pathlib import Path

_SETTINGS = Path(__file__).with_suffix(".json")
SETTINGS = json.loads(_SETTINGS.read_text()) if _SETTINGS.is_file() else {"patch": False, "compat": {}}


def note(line: str) -> None:
    folder = os.environ.get("HF_SUITE_NOTES")
    if folder:
        with open(os.path.join(folder, str(os.getpid())), "a") as f:
            f.write(line + "\n")


def add_compat(compat: dict) -> None:
    import transformers.testing_utils as tu

    for name, value in compat.items():
        if not hasattr(tu, name):
            setattr(tu, name, value)
            note("compat " + name)
    try:
        import httpx  # noqa: F401  (the tests of mid-2026 import it; huggingface_hub 2 ships httpx2)
    except ImportError:
        from huggingface_hub.utils import httpx as client

        sys.modules["httpx"] = client
        note("compat httpx")


def patch_at_first_call() -> None:
    import torch

    import qwen3layer
    import qwen3layer.torch as q3t
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeModel

    call = torch.nn.Module.__call__

    def __call__(self, *args, **kwargs):
        if "_hf_suite_patched" not in self.__dict__:
            q3t.patch_model(self)
            self.__dict__["_hf_suite_patched"] = True
            note("patched")
        return call(self, *args, **kwargs)

    Qwen3MoeModel.__call__ = __call__
    note("qwen3layer " + qwen3layer.__file__)


def set_silu(tester: type) -> None:
    """the tester's instances get hidden_act "silu" after their own __init__"""
    init = tester.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if not hasattr(self, "hidden_act"):
            raise AttributeError(f"hf_suite: {type(self).__name__} has no hidden_act to set to silu")
        if getattr(type(self), "_hf_suite_seen", None) != self.hidden_act:
            type(self)._hf_suite_seen = self.hidden_act
            note(f"hidden_act {type(self).__name__} {self.hidden_act}")
        self.hidden_act = "silu"

    tester.__init__ = __init__
    tester._hf_suite_init = init


def seed_all(nodeid: str) -> None:
    import random
    import zlib

    import numpy
    import torch

    seed = zlib.crc32(nodeid.encode())
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)
    for name, module in list(sys.modules.items()):
        rng = getattr(module, "global_rng", None) if name.startswith("tests.") else None
        if isinstance(rng, random.Random):
            rng.seed(seed)


def pytest_configure(config):
    add_compat(SETTINGS["compat"])
    if SETTINGS["patch"]:
        patch_at_first_call()


def pytest_collection_modifyitems(session, config, items):
    for cls in {item.cls for item in items if getattr(item, "cls", None) is not None}:
        tester = getattr(cls, "model_tester_class", None)
        if tester is not None and "_hf_suite_init" not in vars(tester):
            set_silu(tester)


def pytest_runtest_setup(item):
    seed_all(item.nodeid)
