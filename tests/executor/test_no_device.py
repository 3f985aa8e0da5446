"""A machine with no CUDA device (no GPU, or no driver): every way of asking for one says so in
one sentence, "no CUDA device on this machine (0 found)", naming the call or argument and the
value it got, before anything is read or made (not "a device index below 0", nor the CUDA
runtime's "driver version is insufficient"); and q3.cuda.emulate() still works after, so a
notebook need not restart. In a fresh process of its own: the first CUDA call of a process is
what is tested."""
import json
import os
import subprocess
import sys

import pytest

import qwen3layer as q3

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
SCRIPT = """
import json, os, sys
import torch
import qwen3layer as q3
from hf_reference import tiny_model

def refusal(call):
    try:
        call()
    except Exception as e:  # the message is what is checked
        return f"{type(e).__name__}: {e}"
    return "accepted"

cfg = q3.LayerConfig.tiny()
hf_layer = tiny_model(0).model.layers[0]
got = {"random": refusal(lambda: q3.DecoderLayer.random(cfg, device="cuda")),
       "random:0": refusal(lambda: q3.DecoderLayer.random(cfg, device="cuda:0")),
       "from_hf": refusal(lambda: q3.DecoderLayer.from_hf(hf_layer, device="cuda")),
       "from_checkpoint": refusal(lambda: q3.DecoderLayer.from_checkpoint(sys.argv[1], 0, device="cuda")),
       "synchronize": refusal(q3.cuda.synchronize),
       "check_kernels": refusal(q3.cuda.check_kernels),
       "load": refusal(q3.cuda.load),
       "to_device": refusal(lambda: q3.cuda.to_device(torch.zeros(2))),
       "device_count": q3.cuda.device_count()}
if os.path.exists(q3.cuda.SIMT_LIBRARY):
    q3.cuda.emulate()
    layer = q3.DecoderLayer.random(cfg, device="cuda")
    y = layer.decode(layer.random_input((1, cfg.hidden_size), 0), layer.new_cache(2))
    got["emulated"] = [str(y.device), q3.cuda.device_count(), q3.cuda.emulated()]
print(json.dumps(got))
"""
HINT = "call qwen3layer.cuda.emulate() first to run the CUDA path on the CPU's SIMT executor"


@pytest.fixture(scope="module")
def answers(tmp_path_factory):
    if q3.cuda.device_count() > 0:
        pytest.skip("this machine has a CUDA device")
    missing = str(tmp_path_factory.mktemp("no-device") / "no-checkpoint")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests", "helpers")]))
    run = subprocess.run([sys.executable, "-c", SCRIPT, missing], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.splitlines()[-1])


def test_a_layer_on_cuda_is_refused_with_the_sentence_naming_the_device_it_got(answers):
    simt = os.path.exists(q3.cuda.SIMT_LIBRARY)
    for call, name in (("random", "cuda"), ("random:0", "cuda:0"), ("from_hf", "cuda"), ("from_checkpoint", "cuda")):
        if q3.cuda.built():
            want = f"ValueError: device: {name!r}: no CUDA device on this machine (0 found); expected 'cpu'" + \
                (f", or {HINT}" if simt else "")
        else:
            want = (f"ValueError: device: {name!r}: this build has no CUDA backend (nvcc was not found when it was "
                    "built); expected 'cpu'")
        assert answers[call] == want, call  # from_checkpoint: the device before the (missing) folder


@pytest.mark.skipif(not q3.cuda.built(), reason="a CPU-only build: no CUDA library to load")
def test_the_cuda_calls_say_the_same_sentence_not_the_runtimes(answers):
    hint = f"; {HINT}" if os.path.exists(q3.cuda.SIMT_LIBRARY) else ""
    for call, what in (("synchronize", "synchronize(device=0)"), ("check_kernels", "check_kernels(device=0)"),
                       ("load", "load()"), ("to_device", "to_device(device=0)")):
        assert answers[call] == f"RuntimeError: qwen3layer.cuda.{what}: no CUDA device on this machine (0 found){hint}"
    assert answers["device_count"] == 0


@pytest.mark.skipif(not os.path.exists(q3.cuda.SIMT_LIBRARY), reason="no SIMT executor in this build")
def test_emulate_works_after_cuda_was_asked_for(answers):
    assert answers["emulated"] == ["cuda:0", 1, True]
