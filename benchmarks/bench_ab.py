"""Before and after in one process: two builds of this project (or two CPU paths of one build)
called in turn on the same weights, so that a kernel change is measured under the same machine
state. On a VM whose layer figures move 20-40% from one process to the next, a change of a few
per cent shows only this way.

    python benchmarks/bench_ab.py --base-rev HEAD~1            # A: that commit, built now; B: this checkout
    git worktree add --detach /tmp/base <rev> && (cd /tmp/base && python setup.py build_ext --inplace)
    python benchmarks/bench_ab.py --base /tmp/base             # A: a build of your own
    python benchmarks/bench_ab.py --paths avx512,avx512bf16    # A, B: this build on two CPU paths

--base-rev checks the commit out into a git worktree of a temporary folder, builds it there
(a few minutes; its log is kept if the build fails) and removes the worktree at the end.

Rows: decode at each context (batch 1), a decode step of each --batches sequences at context
512, prefill of --prefill-tokens tokens in one chunk; bf16 weights, FP8 (fp8_e4m3_block128)
with --fp8, and 4-bit GPTQ (gptq_int4: the draws rounded to nearest, group 128) with --int4. The two layers borrow one set of weights (random, seed 0), each has its own cache,
filled with the same tokens. Each round calls A then B, the next B then A (so neither always
runs second), after a warm-up call of each. Per row: the median ms of A and of B; B's speed-up
as the median of the rounds' A/B ratios, with their quartiles; the rounds B was faster in; and
the largest difference between A's and B's outputs of the same input (0: the change keeps the
layer's numbers bit for bit).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import qwen3layer as q3  # noqa: E402
from qwen3layer import _C  # noqa: E402
from machine import cpu_name  # noqa: E402

SMALL = q3.LayerConfig(hidden_size=1024, num_attention_heads=16, num_key_value_heads=2, head_dim=128,
                       num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512)
FP8 = "fp8_e4m3_block128"
INT4 = "gptq_int4"


def load_build(root: str):
    """the qwen3layer package of the checkout at root, imported as qwen3layer_base beside this
    one (its own extension: a second shared object, its own C state)"""
    init = os.path.join(os.path.abspath(root), "qwen3layer", "__init__.py")
    if not os.path.isfile(init):
        raise SystemExit(f"--base {root}: no qwen3layer/__init__.py there (expected a checkout of this project)")
    pkg = os.path.dirname(init)
    if not any(f.startswith("_C.") and f.endswith(".so") for f in os.listdir(pkg)):
        raise SystemExit(f"--base {root}: its extension is not built; run `python setup.py build_ext --inplace` there")
    if os.path.samefile(pkg, os.path.dirname(q3.__file__)):
        raise SystemExit(f"--base {root}: that is this checkout; give another one")
    spec = importlib.util.spec_from_file_location("qwen3layer_base", init, submodule_search_locations=[pkg])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["qwen3layer_base"] = mod
    spec.loader.exec_module(mod)
    return mod


def build_rev(rev: str) -> str:
    """a worktree of this checkout at `rev` in a new temporary folder, its extension built
    in place; the folder (the caller removes it with remove_rev)"""
    git = ["git", "-C", ROOT]
    got = subprocess.run(git + ["rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], capture_output=True,
                         text=True)
    if got.returncode != 0:
        raise SystemExit(f"--base-rev {rev}: not a commit of the repository at {os.path.abspath(ROOT)}")
    commit = got.stdout.strip()
    where = tempfile.mkdtemp(prefix="qwen3layer-ab-")
    add = subprocess.run(git + ["worktree", "add", "--detach", where, commit], capture_output=True, text=True)
    if add.returncode != 0:
        shutil.rmtree(where, ignore_errors=True)
        raise SystemExit(f"--base-rev {rev}: git worktree add failed: {add.stderr.strip()}")
    log = os.path.join(tempfile.gettempdir(), f"qwen3layer-ab-build-{commit[:12]}.log")
    print(f"building {rev} ({commit[:12]}) in {where} (log: {log}) ...", flush=True)
    t = time.perf_counter()
    try:
        with open(log, "w") as f:
            built = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=where, stdout=f,
                                   stderr=subprocess.STDOUT)
        if built.returncode != 0:
            raise SystemExit(f"--base-rev {rev}: the build failed (exit {built.returncode}); see {log}")
    except BaseException:  # a failed or interrupted build leaves no worktree behind
        remove_rev(where)
        raise
    os.remove(log)
    print(f"built in {time.perf_counter() - t:.0f} s", flush=True)
    return where


def remove_rev(where: str) -> None:
    subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", where], capture_output=True)
    shutil.rmtree(where, ignore_errors=True)


class Side:
    """one of the two: a layer, and the CPU path to set before each call (None: leave it)"""

    def __init__(self, label: str, layer, path: str | None = None):
        self.label, self.layer, self.path = label, layer, path

    def enter(self) -> None:
        if self.path is not None:
            q3.set_cpu_path(self.path)


def as_float(t) -> torch.Tensor:
    return torch.from_dlpack(t).float()


def decode_case(side: Side, H: int, context: int, batch: int):
    """(call, first output) of a decode step of `batch` sequences at `context`; the call
    truncates the caches back, so every round runs the same step"""
    side.enter()
    layer = side.layer
    cache = layer.new_cache(context + 1, batch)
    for t0 in range(0, context, 512):  # real keys and values, the same on both sides
        n = min(512, context - t0)
        shape = (n, H) if batch == 1 else (batch, n, H)
        layer.prefill(_C.random_tensor(shape, 1000 + t0, "bfloat16"), cache, chunk_size=512)
    x = _C.random_tensor((batch, H), 17, "bfloat16")

    def call():
        y = layer.decode(x, cache)
        for s in range(batch):
            cache.truncate(context, s)
        return y

    return call


def prefill_case(side: Side, H: int, tokens: int):
    side.enter()
    x = _C.random_tensor((tokens, H), 19, "bfloat16")
    return lambda: side.layer.prefill(x, side.layer.new_cache(tokens), chunk_size=tokens)


def measure(sides, calls, rounds: int) -> dict:
    """rounds of A then B (odd rounds B then A) after a warm-up of each; the outputs of the
    warm-up compared"""
    outs = []
    for side, call in zip(sides, calls):
        side.enter()
        outs.append(as_float(call()))
    diff = (outs[0] - outs[1]).abs().max().item()
    secs = [[], []]
    for r in range(rounds):
        for i in ((0, 1) if r % 2 == 0 else (1, 0)):
            sides[i].enter()
            t = time.perf_counter()
            calls[i]()
            secs[i].append(time.perf_counter() - t)
    ratios = sorted(a / b for a, b in zip(*secs))
    q = lambda f: ratios[min(len(ratios) - 1, int(f * len(ratios)))]
    return dict(a=statistics.median(secs[0]), b=statistics.median(secs[1]), ratio=statistics.median(ratios),
                q1=q(0.25), q3=q(0.75), wins=sum(a > b for a, b in zip(*secs)), rounds=rounds, diff=diff)


def print_rows(rows) -> None:
    head = ("measurement", "A", "B", "B speed-up", "quartiles", "B faster", "max |A - B|")
    cells = [head] + [(name, f"{m['a'] * 1e3:.2f} ms", f"{m['b'] * 1e3:.2f} ms", f"{m['ratio']:.3f}x",
                       f"{m['q1']:.3f}-{m['q3']:.3f}", f"{m['wins']}/{m['rounds']}", f"{m['diff']:.3g}")
                      for name, m in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    for j, r in enumerate(cells):
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths)))
        if j == 0:
            print("-|-".join("-" * w for w in widths))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    who = ap.add_mutually_exclusive_group(required=True)
    who.add_argument("--base", metavar="DIR", help="a checkout of this project, built in place: A (this one is B)")
    who.add_argument("--base-rev", metavar="REV", help="a commit of this repository, checked out and built now: A")
    who.add_argument("--paths", metavar="A,B", help="two CPU paths of this build (build_info()['cpu_paths'])")
    ap.add_argument("--small", action="store_true", help="a small geometry instead of the real one")
    ap.add_argument("--contexts", default="512,4096", help="decode contexts, batch 1 (default %(default)s)")
    ap.add_argument("--batches", default="4,16", help="decode steps of these many sequences at context 512 "
                    "(default %(default)s; '' for none)")
    ap.add_argument("--prefill-tokens", type=int, default=512, help="0: no prefill row")
    ap.add_argument("--decode-rounds", type=int, default=40)
    ap.add_argument("--prefill-rounds", type=int, default=8)
    ap.add_argument("--fp8", action="store_true", help="the same rows on FP8 weights too")
    ap.add_argument("--int4", action="store_true", help="the same rows on 4-bit GPTQ weights (gptq_int4, RTN) too")
    args = ap.parse_args()
    if args.base_rev:
        args.base = build_rev(args.base_rev)
        try:
            return run(args)
        finally:
            remove_rev(args.base)
    return run(args)


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    cfg = SMALL if args.small else q3.LayerConfig.qwen3_235b_a22b()
    info = q3.build_info()
    if args.paths:
        paths = args.paths.split(",")
        if len(paths) != 2 or any(p not in info["cpu_paths"] for p in paths):
            raise SystemExit(f"--paths {args.paths}: expected two of this CPU's paths {info['cpu_paths']}")
        base = None
        print(f"A: cpu path {paths[0]}, B: cpu path {paths[1]}, one build (qwen3layer {info['version']})")
    else:
        base = load_build(args.base)
        paths = [None, None]
        print(f"A: {os.path.abspath(args.base)} (cpu path {base.build_info()['cpu_path']}), "
              f"B: {os.path.abspath(ROOT)} (cpu path {info['cpu_path']})")
    print(f"machine: {cpu_name()}, {info['threads']} threads; read probe {_C.probe_read_bandwidth(1 << 30, 3):.1f} "
          f"GB/s; {'small' if args.small else 'real'} geometry")
    contexts = [int(c) for c in args.contexts.split(",") if c]
    batches = [int(b) for b in args.batches.split(",") if b]
    H = cfg.hidden_size
    for fmt in [None] + [FP8] * args.fp8 + [INT4] * args.int4:
        t = time.perf_counter()
        weights = _C.random_weights(cfg, 0, "bfloat16", fmt)  # one set, borrowed by both layers
        layer_b = q3.DecoderLayer(cfg, weights)
        layer_a = layer_b if base is None else base.DecoderLayer(base.LayerConfig(**dataclasses.asdict(cfg)), weights)
        sides = [Side("A", layer_a, paths[0]), Side("B", layer_b, paths[1])]
        print(f"\n{fmt or 'bf16'} weights ({layer_b.weight_bytes / 1e9:.2f} GB, built in "
              f"{time.perf_counter() - t:.1f} s):", flush=True)
        rows = []
        cases = [(f"decode, context {c}", lambda s, c=c: decode_case(s, H, c, 1), args.decode_rounds) for c in contexts]
        cases += [(f"decode, {b} sequences at 512", lambda s, b=b: decode_case(s, H, 512, b), args.decode_rounds)
                  for b in batches]
        if args.prefill_tokens:
            cases.append((f"prefill, {args.prefill_tokens} tokens", lambda s: prefill_case(s, H, args.prefill_tokens),
                          args.prefill_rounds))
        for name, make, rounds in cases:
            rows.append((name, measure(sides, [make(s) for s in sides], rounds)))
            print(f"  {name}: B {rows[-1][1]['ratio']:.3f}x A", flush=True)
        print_rows(rows)
        del layer_a, layer_b, sides, weights
    print(f"\nFinished in {time.perf_counter() - started:.0f} s.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
