"""The drop-in's own cost per layer call: a tiny many-layer transformers Qwen3MoeForCausalLM,
patched (qwen3layer.torch.patch_model), generating greedily with a DynamicCache and with a
StaticCache (cache_implementation="static"). Each decode call of each patched layer is timed
twice over: the module's forward (qwen3layer.torch.DecoderLayer.forward: the plan, the cache
views, the checks, the recorders) and, inside it, the C layer's call (the extension's
Layer.prefill, qwen3layer._C: the DLPack import of the input, the engine, the output made;
the core API's Python wrapper around it, q3.DecoderLayer.prefill, counts as the drop-in's,
since a drop-in call need not go through it). The difference is what the drop-in adds to a
layer a token; on a 94-layer model it is paid 94 times a token.

    python benchmarks/bench_dropin.py                      # 8 layers, 64 tokens, 3 runs
    python benchmarks/bench_dropin.py --layers 16 --tokens 128 --runs 5

One thread: torch.set_num_threads(1), and OMP_NUM_THREADS=1 set before the extension loads
(the C layer reads it once). Per run and cache: the median of the module's time, of the C
call's and of the per-call differences (us), over every layer's decode calls after the first
--warmup tokens, the differences' mean (the first layer of each model call plans the call,
the others repeat its plan: qwen3layer.torch.DecoderLayer._repeat, so the median is a later
layer's and the mean counts both), and `layers`, the mean over the layers of each layer's
median difference (what a token costs over the layers, the planning layer counted once per
model call as the mean counts it, without the outliers that move the mean by tens of us when
another process disturbs a run); prefill calls are not counted. The geometry is
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
    """stands in for a core layer's extension object (q3.DecoderLayer._core) and times its
    prefill calls; everything else is the extension object's"""

    def __init__(self, core, inner: list) -> None:
        self._c, self._inner = core, inner
        self.device = core.device  # fixed at construction; read by each drop-in call (not through __getattr__)

    def prefill(self, *args, **kwargs):
        t0 = time.perf_counter_ns()
        y = self._c.prefill(*args, **kwargs)
        self._inner.append(time.perf_counter_ns() - t0)
        return y

    def __getattr__(self, name):
        return getattr(self._c, name)


class Timings:
    """the per-call times of each patched layer's forward and of its C call, decode calls only.
    Each layer's forward is timed by a wrapper set on that layer (layer.forward), which torch's
    call of the module runs in place of the class's: nothing changes for other models."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.module, self.core, self.layer = [], [], []
        for layer in model.model.layers:
            self._wrap(layer)

    def _wrap(self, layer: q3t.DecoderLayer) -> None:
        forward = layer.forward
        inner = []  # the C call's time within the forward now running
        index = layer.layer_idx
        layer.core._core = _TimedCore(layer.core._core, inner)

        def timed_forward(hidden_states, *args, **kwargs):
            inner.clear()
            t0 = time.perf_counter_ns()
            y = forward(hidden_states, *args, **kwargs)
            elapsed = time.perf_counter_ns() - t0
            if hidden_states.shape[1] == 1 and len(inner) == 1:  # a decode call
                self.module.append(elapsed)
                self.core.append(inner[0])
                self.layer.append(index)
            return y

        layer.forward = timed_forward

    def reset(self) -> None:
        self.module.clear()
        self.core.clear()
        self.layer.clear()

    def medians(self) -> tuple:
        """(module, C call, difference) medians, the differences' mean and the mean over the
        layers of each layer's median difference in us, and the calls counted"""
        diffs = [m - c for m, c in zip(self.module, self.core)]
        by_layer: dict = {}
        for index, d in zip(self.layer, diffs):
            by_layer.setdefault(index, []).append(d)
        return (statistics.median(self.module) / 1e3, statistics.median(self.core) / 1e3,
                statistics.median(diffs) / 1e3, statistics.fmean(diffs) / 1e3,
                statistics.fmean(map(statistics.median, by_layer.values())) / 1e3, len(diffs))


def run(model: torch.nn.Module, timings: Timings, ids: torch.Tensor, tokens: int, warmup: int,
        static: bool) -> tuple:
    extra = {"cache_implementation": "static"} if static else {}
    with torch.no_grad():
        model.generate(ids, max_new_tokens=warmup, do_sample=False, pad_token_id=0, **extra)
        timings.reset()
        out = model.generate(ids, max_new_tokens=tokens, do_sample=False, pad_token_id=0, **extra)
    return timings.medians(), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated a run (default 64)")
    ap.add_argument("--prompt", type=int, default=8, help="prompt tokens (default 8)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=8, help="tokens of a warm-up generation before each run")
    ap.add_argument("--attn", default="sdpa", help="attn_implementation (default sdpa, transformers' own)")
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
          f"{'calls':>7}")
    for static in (False, True):
        name = "StaticCache" if static else "DynamicCache"
        diffs, means, layers = [], [], []
        for r in range(args.runs):
            (module, core, diff, mean, per_layer, calls), _ = run(model, timings, ids, args.tokens, args.warmup,
                                                                  static)
            diffs.append(diff)
            means.append(mean)
            layers.append(per_layer)
            print(f"{name:<14}{r + 1:>4}{module:>10.1f}{core:>10.1f}{diff:>12.1f}{mean:>8.1f}{per_layer:>8.1f}"
                  f"{calls:>7}")
        print(f"{name:<14}{'all':>4}{'':>10}{'':>10}{statistics.median(diffs):>12.1f}{statistics.median(means):>8.1f}"
              f"{statistics.median(layers):>8.1f}  (medians of the runs)")


if __name__ == "__main__":
    main()
