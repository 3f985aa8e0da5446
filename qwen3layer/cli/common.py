"""What the commands of the CLI share (qwen3layer.cli and its ep and hybrid commands): the
geometry argument, the progress line, timed decode steps."""
from __future__ import annotations

import sys
import time

from ..config import LayerConfig
from ..layer import DecoderLayer

GEOMETRIES = {"real": LayerConfig.qwen3_235b_a22b, "tiny": LayerConfig.tiny}


def geometry(arg: str) -> LayerConfig:
    """'real', 'tiny', or the path of a transformers config.json"""
    if arg in GEOMETRIES:
        return GEOMETRIES[arg]()
    import json
    import os

    if not os.path.exists(arg):
        raise SystemExit(f"--geometry: expected real, tiny or the path of a config.json, got {arg!r} (no such file)")
    with open(arg) as f:
        return LayerConfig.from_hf(json.load(f))


def progress(done: int, total: int, started: float, label: str) -> None:
    width = 30
    filled = width * done // total
    rate = done / max(time.perf_counter() - started, 1e-9)
    sys.stderr.write(f"\r{label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} tokens "
                     f"{rate:8.1f} tok/s")
    sys.stderr.flush()


def decode_steps(layer: DecoderLayer, cache, steps: int, seed: int, wrap=None, sync=None) -> list:
    """the seconds of `steps` decode steps of random inputs (wrap: each input as the calls take
    it; sync: waits for the device before the clock stops)"""
    H, took = layer.config.hidden_size, []
    for i in range(steps):
        x = layer.random_input((1, H), seed * 104729 + i)
        x = wrap(x) if wrap else x
        t = time.perf_counter()
        layer.decode(x, cache)
        if sync:
            sync()
        took.append(time.perf_counter() - t)
    return took
