"""The drop-in's own cost per layer call: a tiny many-layer transformers Qwen3MoeForCausalLM,
patched (qwen3layer.torch.patch_model), generating greedily with a DynamicCache and with a
StaticCache (cache_implementation="static"). Each decode call of each patched layer is timed
twice over, in two generations of the same tokens (greedy: the same calls on the same
caches): the module's forward (qwen3layer.torch.DecoderLayer.forward: the plan, the cache
views, the checks, the recorders), with nothing timed inside it, and in the second the C
layer's call (the extension's Layer.prefill, qwen3layer._C: the DLPack import of the input,
the engine, the output made; the core API's Python wrapper around it, q3.DecoderLayer.prefill,
counts as the drop-in's, since a drop-in call need not go through it), timed by a wrapper
whose own Python (a frame, two clock reads) would otherwise count as the module's. The
difference is what the drop-in adds to a layer a token; on a 94-layer model it is paid 94
times a token.

    python benchmarks/bench_dropin.py                      # 8 layers, 64 tokens, 3 runs
    python benchmarks/bench_dropin.py --layers 16 --tokens 128 --runs 5

One thread: torch.set_num_threads(1), and OMP_NUM_THREADS=1 set before the extension loads
(the C layer reads it once). Per run and cache: the median of the module's time, of the C
call's and of the per-call differences (us: call i of the first generation less call i of the
second), over every layer's decode calls after the first --warmup tokens, the differences'
mean (the first layer of each model call plans the call,
the others repeat its plan: qwen3layer.torch.DecoderLayer._repeat, so the median is a later
layer's and the mean counts both), and `layers`, the mean over the layers of each layer's
median difference (what a token costs over the layers, the planning layer counted once per
model call as the mean counts it, without the outliers that move the mean by tens of us when
another process disturbs a run), and that mean for a model --model-layers deep (94 by
default: the first layer's once, the later layers' mean for each other; what a layer call
costs on average in Qwen3-235B-A22B); prefill calls are not counted. The geometry is
LayerConfig.tiny()'s, so the C call is as short as the engine makes it and the difference is
the Python around it.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ["OMP_NUM_THREADS"] = "1"  # before qwen3layer._C loads: the C layer's threads

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

import qwen3layer as q3  # noqa: E402
import qwen3layer.torch as q3t  # noqa: E402
from machine import cpu_name  # noqa: E402


def tiny_model(layers: int, attn: str) -> torch.nn.Module:
    """LayerConfig.tiny()'s geometry, `layers` layers, vocab 101, random weights (seed 0)"""
    tiny = q3.LayerConfig.tiny()
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=101, hidden_size=tiny.hidden_size, intermediate_size=64,
                         num_hidden_layers=layers, num_attention_heads=tiny.num_attention_heads,
                         num_key_value_heads=tiny.num_key_value_heads, head_dim=tiny.head_dim,
                         num_experts=tiny.num_experts, num_experts_per_tok=tiny.num_experts_per_tok,
                         moe_intermediate_size=tiny.moe_intermediate_size, max_position_embeddings=1024,
                         pad_token_id=0, attn_implementation=attn)
    return Qwen3MoeForCausalLM(cfg).eval()


class _TimedCore:
    """stands in for a core layer's extension object (q3.DecoderLayer._core) while the C calls
    are timed, and times its prefill calls; everything else is the extension object's"""

    def __init__(self, core, times: list) -> None:
        self._c, self._times = core, times
        self.device = core.device  # fixed at construction; read by each drop-in call (not through __getattr__)

    def prefill(self, *args, **kwargs):
        t0 = time.perf_counter_ns()
        y = self._c.prefill(*args, **kwargs)
        self._times.append(time.perf_counter_ns() - t0)
        return y

    def __getattr__(self, name):
        return getattr(self._c, name)


class Timings:
    """the per-call times of each patched layer's forward (timing the module) or of its C call
    (timing the C calls), decode calls only, in call order. Each layer's forward is timed by a
    wrapper set on that layer (layer.forward), which torch's call of the module runs in place of
    the class's: nothing changes for other models. A layer's C calls are timed while its core's
    extension object is a _TimedCore."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.layers = list(model.model.layers)
        self.module, self.core, self.layer = [], [], []
        self._inner = []  # the C calls of the forward now running
        self._cores = [layer.core._core for layer in self.layers]
        self.timing_core = False
        for layer in self.layers:
            self._wrap(layer)

    def _wrap(self, layer: q3t.DecoderLayer) -> None:
        forward, inner = layer.forward, self._inner
        index = layer.layer_idx

        def timed_forward(hidden_states, *args, **kwargs):
            if self.timing_core:
                inner.clear()
                y = forward(hidden_states, *args, **kwargs)
                if hidden_states.shape[1] == 1 and len(inner) == 1:  # a decode call
                    self.core.append(inner[0])
                return y
            t0 = time.perf_counter_ns()
            y = forward(hidden_states, *args, **kwargs)
            elapsed = time.perf_counter_ns() - t0
            if hidden_states.shape[1] == 1:  # a decode call
                self.module.append(elapsed)
                self.layer.append(index)
            return y

        layer.forward = timed_forward

    def time_core(self, on: bool) -> None:
        """time the C calls (on) or the modules (off)"""
        self.timing_core = on
        for layer, core in zip(self.layers, self._cores):
            layer.core._core = _TimedCore(core, self._inner) if on else core

    def reset(self, core: bool) -> None:
        """drop the C calls' times (core) or the modules'"""
        for times in (self.core,) if core else (self.module, self.layer):
            times.clear()

    def medians(self, model_layers: int) -> tuple:
        """(module, C call, difference) medians, the differences' mean, the mean over the
        layers of each layer's median difference, and that mean for a model of model_layers
        layers (the first layer's, which plans each call, once; the later layers' mean for the
        others), in us, and the calls counted"""
        if len(self.core) != len(self.module):
            raise RuntimeError(f"the two generations made {len(self.module)} and {len(self.core)} decode calls")
        diffs = [m - c for m, c in zip(self.module, self.core)]
        by_layer: dict = {}
        for index, d in zip(self.layer, diffs):
            by_layer.setdefault(index, []).append(d)
        per_layer = [statistics.median(by_layer[i]) for i in sorted(by_layer)]
        scaled = (per_layer[0] + (model_layers - 1) * statistics.fmean(per_layer[1:] or per_layer)) / model_layers
        return (statistics.median(self.module) / 1e3, statistics.median(self.core) / 1e3,
                statistics.median(diffs) / 1e3, statistics.fmean(diffs) / 1e3,
                statistics.fmean(per_layer) / 1e3, scaled / 1e3, len(diffs))


def run(model: torch.nn.Module, timings: Timings, ids: torch.Tensor, tokens: int, warmup: int,
        static: bool, model_layers: int) -> tuple:
    extra = {"cache_implementation": "static"} if static else {}
    outs = []
    with torch.no_grad():
        for timing_core in (False, True):  # the modules' times, then the C calls' (the same calls)
            timings.time_core(timing_core)
            model.generate(ids, max_new_tokens=warmup, do_sample=False, pad_token_id=0, **extra)
            timings.reset(core=timing_core)
            outs.append(model.generate(ids, max_new_tokens=tokens, do_sample=False, pad_token_id=0, **extra))
    timings.time_core(False)
    if not torch.equal(outs[0], outs[1]):
        raise RuntimeError("the two generations made different tokens: their calls differ")
    return timings.medians(model_layers), outs[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated a run (default 64)")
    ap.add_argument("--prompt", type=int, default=8, help="prompt tokens (default 8)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=8, help="tokens of a warm-up generation before each run")
    ap.add_argument("--attn", default="sdpa", help="attn_implementation (default sdpa, transformers' own)")
    ap.add_argument("--model-layers", type=int, default=94,
                    help="the depth the last column scales to (default 94, Qwen3-235B-A22B's)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    info = q3.build_info()
    print(f"machine: {cpu_name()}; qwen3layer {info['version']} cpu path {info['cpu_path']}, "
          f"{info['threads']} thread(s); torch {torch.__version__} ({torch.get_num_threads()} thread); "
          f"transformers {transformers.__version__}")
    model = tiny_model(args.layers, args.attn)
    ids = torch.randint(1, 101, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    q3t.patch_model(model)
    timings = Timings(model)
    print(f"{args.layers} layers (LayerConfig.tiny() geometry, {args.attn}), prompt {args.prompt}, "
          f"{args.tokens} tokens generated greedily; us per layer decode call, medians")
    print(f"{'cache':<14}{'run':>4}{'module':>10}{'C call':>10}{'module - C':>12}{'mean':>8}{'layers':>8}"
          f"{f'{args.model_layers} layers':>11}{'calls':>7}")
    for static in (False, True):
        name = "StaticCache" if static else "DynamicCache"
        rows = []
        for r in range(args.runs):
            (module, core, diff, mean, per_layer, scaled, calls), _ = run(model, timings, ids, args.tokens,
                                                                          args.warmup, static, args.model_layers)
            rows.append((diff, mean, per_layer, scaled))
            print(f"{name:<14}{r + 1:>4}{module:>10.1f}{core:>10.1f}{diff:>12.1f}{mean:>8.1f}{per_layer:>8.1f}"
                  f"{scaled:>11.1f}{calls:>7}")
        diff, mean, per_layer, scaled = (statistics.median(column) for column in zip(*rows))
        print(f"{name:<14}{'all':>4}{'':>10}{'':>10}{diff:>12.1f}{mean:>8.1f}{per_layer:>8.1f}{scaled:>11.1f}"
              "  (medians of the runs)")


if __name__ == "__main__":
    main()
