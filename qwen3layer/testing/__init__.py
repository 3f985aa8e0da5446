"""Comparisons against transformers for pytest suites: compare() runs a qwen3layer layer (or a
model patched by qwen3layer.torch.patch_model) and its transformers reference on the same
inputs, and measures both against the reference run in a wider dtype; assert_matches() applies
the project's rule to that: our error at most twice the reference's own error in the same
precision (the rule of flash-attention's tests). docs/testing.md has a pytest example.

An output's error is the norm of its difference from the wide run over the norm of the wide
run (of the layer's own update y - x for a layer's output y, which the residual would
otherwise hide): relative, over every element (the real tokens of a model call's
attention_mask). Imports torch when imported (import qwen3layer does not)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Tuple, Union

import torch

from . import runs as _runs
from ..layer import DecoderLayer

__all__ = ["compare", "assert_matches", "Comparison", "OutputError", "TIMES", "VALUES_FLOOR_EPS"]

TIMES = 2.0  # our error may be this many times the reference's own
VALUES_FLOOR_EPS = 0.25  # cached values: the reference's error counts as at least this * finfo(dtype).eps
MARGIN_HINT = 1e-3  # a failure's message points at a routing margin below this
_WIDE = (torch.float32, torch.float64)
_NARROW = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class OutputError:
    """One output of a comparison: errors relative to the wide run, and where ours is worst."""
    name: str               # 'y', 'keys', 'values' (a layer); 'logits', 'layers.N.keys', ... (a model)
    error: float            # ours against the wide run, relative (see the module's docstring)
    reference_error: float  # the reference in the same dtype against its wide run, the same measure
    floor: float            # the least reference error the rule counts (0: none)
    max_abs: float          # max |ours - wide| over the compared elements
    index: Tuple[int, ...]  # where max_abs is, in the output's shape
    sequence: int           # the batch row of index
    token: int              # the token (position in the call's sequence) of index
    ours: float             # the three values at index: ours,
    reference: float        # the reference in the same dtype's,
    wide: float             # and the wide run's

    @property
    def allowed(self) -> float:
        """the most error the rule allows: TIMES * max(reference_error, floor)"""
        return TIMES * max(self.reference_error, self.floor)

    @property
    def ratio(self) -> float:
        """error / max(reference_error, floor): at most TIMES passes"""
        base = max(self.reference_error, self.floor)
        return self.error / base if base > 0 else (0.0 if self.error == 0 else math.inf)

    @property
    def ok(self) -> bool:
        return self.error <= self.allowed  # False for NaN

    def where(self) -> str:
        return (f"sequence {self.sequence}, token {self.token} (index {self.index}): ours {self.ours:.6g}, "
                f"reference {self.reference:.6g}, wide {self.wide:.6g}")

    def __str__(self) -> str:
        floor = f" (floor {self.floor:.3g})" if self.floor else ""
        return (f"{self.name}: error {self.error:.3g}, {self.ratio:.3g}x the reference's {self.reference_error:.3g}"
                f"{floor}, allowed {self.allowed:.3g}: {'ok' if self.ok else 'FAILED'}; largest difference "
                f"{self.max_abs:.3g} at {self.where()}")


@dataclass(frozen=True)
class Comparison:
    """What compare() measured: an OutputError per output, in the order run."""
    dtype: torch.dtype       # the precision both sides ran in
    wide_dtype: torch.dtype  # the reference's wide run's
    outputs: Tuple[OutputError, ...]
    routing_margin: Optional[float] = None  # a layer's: the wide run's least gap between a token's
    # k-th and (k+1)-th expert probability; near rounding, a flipped choice makes a whole expert's error

    @property
    def ok(self) -> bool:
        return all(o.ok for o in self.outputs)

    @property
    def failures(self) -> Tuple[OutputError, ...]:
        return tuple(o for o in self.outputs if not o.ok)

    def __getitem__(self, name: str) -> OutputError:
        for o in self.outputs:
            if o.name == name:
                return o
        raise KeyError(f"name: expected one of {[o.name for o in self.outputs]}, got {name!r}")

    def __str__(self) -> str:
        head = (f"ours and the reference in {self.dtype}, against the reference in {self.wide_dtype}; "
                f"allowed: {TIMES:g}x the reference's own error")
        if self.routing_margin is not None:
            head += f"; routing margin {self.routing_margin:.3g}"
        return "\n".join([head] + [f"  {o}" for o in self.outputs])


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).split(".")[-1]


def _is_patched(model: torch.nn.Module) -> bool:
    from ..torch import DecoderLayer as PatchedLayer
    return any(isinstance(m, PatchedLayer) for m in model.modules())


def _judge(name: str, ours: torch.Tensor, theirs: torch.Tensor, wide: torch.Tensor, token_axis: int,
           floor: float, real: Optional[torch.Tensor] = None, scale: Optional[torch.Tensor] = None) -> OutputError:
    """ours and theirs against wide, over the elements whose (batch, token) real holds"""
    if ours.shape != wide.shape or theirs.shape != wide.shape:
        raise ValueError(f"{name}: ours has shape {list(ours.shape)}, the reference {list(theirs.shape)} and its "
                         f"wide run {list(wide.shape)}; expected one shape")
    a, t, w = (v.detach().to("cpu", torch.float64) for v in (ours, theirs, wide))
    s = w if scale is None else scale.detach().to("cpu", torch.float64)
    keep = torch.ones_like(w, dtype=torch.bool)
    if real is not None:
        shape = [1] * w.dim()
        shape[0], shape[token_axis] = real.shape
        keep = keep & real.to("cpu", torch.bool).reshape(shape)
    d_ours, d_theirs = (a - w).where(keep, 0.0), (t - w).where(keep, 0.0)
    norm = float(s.where(keep, 0.0).norm())
    flat = int(d_ours.abs().flatten().argmax())  # a NaN is the largest
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), w.shape))
    return OutputError(name, float(d_ours.norm()) / norm, float(d_theirs.norm()) / norm, floor,
                       float(d_ours.abs().flatten()[flat]), index, index[0], index[token_axis],
                       float(a[index]), float(t[index]), float(w[index]))


def _floor(name: str, dtype: torch.dtype) -> float:
    """The cached values are one projection rounded once to dtype on both sides: where the
    reference's error is below about one rounding (bf16: 2**-9) a ratio of two roundings says
    nothing, so its error counts as at least that."""
    return VALUES_FLOOR_EPS * torch.finfo(dtype).eps if name.endswith("values") else 0.0


def _check_dtypes(dtype: Any, wide: Any, ours_dtype: torch.dtype, what: str) -> torch.dtype:
    """the wide run's dtype, after dtype and wide are checked"""
    if dtype not in _NARROW:
        raise ValueError(f"dtype: expected one of {[_dtype_name(d) for d in _NARROW]} (torch dtypes), got {dtype!r}")
    if dtype != ours_dtype:
        raise ValueError(f"dtype: expected {ours_dtype}, the dtype of the {what}, got {dtype}")
    wide_dtype = wide if isinstance(wide, torch.dtype) else (
        _runs.float_dtype(wide) if isinstance(wide, torch.nn.Module) else None)
    if not isinstance(wide, (torch.dtype, torch.nn.Module)) or wide_dtype not in _WIDE or \
            torch.finfo(wide_dtype).bits <= torch.finfo(dtype).bits:
        raise ValueError(f"wide: expected torch.float32 or torch.float64 (or a module in it) wider than dtype {dtype}, "
                         f"got {wide_dtype if isinstance(wide, torch.nn.Module) else wide!r}")
    return wide_dtype


def _check_calls(calls: Optional[Sequence[Any]], tokens: int) -> Sequence[Any]:
    if calls is None:
        return (tokens,)
    sizes = []
    for i, call in enumerate(calls):
        ok = isinstance(call, int) or (isinstance(call, tuple) and len(call) == 2 and all(
            isinstance(v, int) for v in call))
        if not ok or min(call if isinstance(call, tuple) else (call,)) < 1:
            raise ValueError(f"calls[{i}]: expected a token count or a (tokens, chunk_size) pair of positive ints, "
                             f"got {call!r}")
        sizes.append(call[0] if isinstance(call, tuple) else call)
    if not sizes or sum(sizes) != tokens:
        raise ValueError(f"calls: expected token counts adding up to the input's {tokens} tokens, got {list(calls)} "
                         f"({sum(sizes)} tokens)")
    return calls


def _compare_layer(layer: DecoderLayer, reference: Any, x: Any, dtype: torch.dtype, wide: Any,
                   calls: Optional[Sequence[Any]]) -> Comparison:
    if not hasattr(getattr(reference, "self_attn", None), "config") or not hasattr(reference, "mlp"):
        raise TypeError(f"reference: expected the transformers Qwen3MoeDecoderLayer a qwen3layer.DecoderLayer is "
                        f"compared with, got {type(reference).__name__}")
    wide_dtype = _check_dtypes(dtype, wide, getattr(torch, layer.dtype), "layer")
    H = layer.config.hidden_size
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() not in (2, 3) or x.shape[-1] != H:
        got = f"a {x.dtype} tensor of shape {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"inputs: expected a floating torch tensor [tokens, {H}] or [batch, tokens, {H}] "
                         f"(hidden states), got {got}")
    x = x if x.dim() == 3 else x[None]
    calls = _check_calls(calls, x.shape[1])
    rotary = _runs.rotary_of(reference)
    wide_layer = wide if isinstance(wide, torch.nn.Module) else _runs.in_dtype(reference, wide_dtype)
    x_wide = x.to(wide_dtype)
    theirs, _ = _runs.reference_layer_outputs(_runs.in_dtype(reference, dtype), rotary, x.to(dtype))
    wide_run, logits = _runs.reference_layer_outputs(wide_layer, rotary, x_wide)
    result = _comparison((_runs.layer_outputs(layer, x.to(dtype), calls), theirs, wide_run), dtype, wide_dtype,
                         scales={"y": wide_run["y"][0] - x_wide})
    margin = _runs.routing_margin(logits, layer.config.num_experts_per_tok)
    return Comparison(result.dtype, result.wide_dtype, result.outputs, margin)


def _compare_model(model: torch.nn.Module, reference: Any, inputs: Any, dtype: torch.dtype, wide: Any,
                   calls: Optional[Sequence[Any]]) -> Comparison:
    if calls is not None:
        raise ValueError(f"calls: a patched model runs as one forward call of inputs; got calls={list(calls)}")
    if not isinstance(reference, torch.nn.Module) or not hasattr(reference, "config") or _is_patched(reference):
        got = "a patched model" if isinstance(reference, torch.nn.Module) and _is_patched(reference) else \
            type(reference).__name__
        raise TypeError(f"reference: expected the unpatched transformers model, got {got}")
    wide_dtype = _check_dtypes(dtype, wide, _runs.float_dtype(model), "patched model")
    if isinstance(inputs, torch.Tensor) and not inputs.is_floating_point():
        inputs = {"input_ids": inputs}
    if not isinstance(inputs, Mapping) or {"cache", "past_key_values"} & set(inputs):
        raise ValueError(f"inputs: expected input_ids (a tensor) or a mapping of forward kwargs without a cache "
                         f"(compare starts from an empty one), got {type(inputs).__name__}"
                         + (f" with keys {sorted(inputs)}" if isinstance(inputs, Mapping) else ""))
    inputs = dict(inputs)
    mask = inputs.get("attention_mask")
    real = mask.bool() if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
    wide_model = wide if isinstance(wide, torch.nn.Module) else _runs.in_dtype(reference, wide_dtype)
    runs = tuple(_runs.model_outputs(m, inputs) for m in (model, _runs.in_dtype(reference, dtype), wide_model))
    return _comparison(runs, dtype, wide_dtype, real=real)


def _comparison(runs: Tuple[_runs.Outputs, _runs.Outputs, _runs.Outputs], dtype: torch.dtype,
                wide_dtype: torch.dtype, real: Optional[torch.Tensor] = None,
                scales: Optional[Mapping[str, torch.Tensor]] = None) -> Comparison:
    ours, theirs, wide = runs
    if set(ours) != set(wide) or set(theirs) != set(wide):
        raise ValueError(f"outputs: ours are {sorted(ours)}, the reference's {sorted(theirs)}; expected the same")
    return Comparison(dtype, wide_dtype, tuple(
        _judge(name, ours[name][0], theirs[name][0], w, axis, _floor(name, dtype), real, (scales or {}).get(name))
        for name, (w, axis) in wide.items()))


def compare(layer_or_patched_model: Any, reference: Any, inputs: Any, dtype: torch.dtype, *,
            wide: Union[torch.dtype, torch.nn.Module] = torch.float64,
            calls: Optional[Sequence[Union[int, Tuple[int, int]]]] = None) -> Comparison:
    """Runs ours and the reference on the same inputs in `dtype`, and the reference in `wide`;
    returns each output's errors against the wide run (Comparison, no judgment made).

    layer_or_patched_model and reference, one of:
    - a qwen3layer.DecoderLayer and the transformers Qwen3MoeDecoderLayer it was made from (or
      one of the same weights); inputs: hidden states [tokens, hidden] or [batch, tokens,
      hidden], positions from 0. Outputs: y [batch, tokens, hidden], the cache's keys and
      values [batch, kv heads, tokens, head_dim]. Ours runs through a new cache in `calls`
      (default: one prefill): token counts, the first a prefill, a later 1 a decode step, any
      other count a prefill continuing the cache; a (tokens, chunk_size) pair a prefill in
      passes of chunk_size. The reference runs in one causal call, with cos and sin from a
      Qwen3MoeRotaryEmbedding of its config (float32 frequencies, as the C layer's).
    - a model patched by qwen3layer.torch.patch_model and its unpatched transformers twin;
      inputs: input_ids [batch, tokens] or a mapping of forward kwargs (input_ids,
      attention_mask, position_ids, use_cache, ...). Outputs: logits and, where the model
      returns its cache, each layer's keys and values, on the real tokens of a 2D
      attention_mask.

    dtype: the precision both run in: ours must be in it; the reference is used as it is if
    its parameters are, else a copy is made in it. Ours and the reference get inputs cast to
    dtype, the wide run inputs as given, cast to wide.
    wide: float32 or float64, wider than dtype (a copy of the reference is made in it), or the
    wide reference itself (a module of the reference's kind, in float32 or float64): for
    weights the reference in dtype rounds, such as FP8 weights transformers dequantizes.
    """
    if isinstance(layer_or_patched_model, DecoderLayer):
        return _compare_layer(layer_or_patched_model, reference, inputs, dtype, wide, calls)
    if isinstance(layer_or_patched_model, torch.nn.Module) and _is_patched(layer_or_patched_model):
        return _compare_model(layer_or_patched_model, reference, inputs, dtype, wide, calls)
    got = "a model with no qwen3layer layers (patch it with qwen3layer.torch.patch_model)" if \
        isinstance(layer_or_patched_model, torch.nn.Module) else type(layer_or_patched_model).__name__
    raise TypeError(f"layer_or_patched_model: expected a qwen3layer.DecoderLayer or a model patched by "
                    f"qwen3layer.torch.patch_model, got {got}")


def assert_matches(layer_or_patched_model: Any, reference: Any, inputs: Any, dtype: torch.dtype, *,
                   wide: Union[torch.dtype, torch.nn.Module] = torch.float64,
                   calls: Optional[Sequence[Union[int, Tuple[int, int]]]] = None) -> Comparison:
    """compare(), then the rule: every output's error at most TIMES (2) times the reference's
    own error in dtype, both against the wide run; the cached values' reference error counts
    as at least VALUES_FLOOR_EPS * finfo(dtype).eps (2**-9 in bfloat16), the other outputs'
    have no floor. AssertionError naming each output that fails, its errors, and the sequence,
    token and values (ours, the reference's, the wide run's) where ours differs most; returns
    the Comparison when all pass."""
    result = compare(layer_or_patched_model, reference, inputs, dtype, wide=wide, calls=calls)
    if not result.ok:
        lines = [f"{o.name}: error {o.error:.3g} is {o.ratio:.3g}x the reference's own {o.reference_error:.3g} in "
                 f"{_dtype_name(dtype)} (allowed {TIMES:g}x" + (f", floor {o.floor:.3g}" if o.floor else "")
                 + f"); largest difference at {o.where()}" for o in result.failures]
        if result.routing_margin is not None and result.routing_margin < MARGIN_HINT:
            lines.append(f"the wide run's routing margin is {result.routing_margin:.3g}: a top-k choice that rounding "
                         f"flips costs a whole expert's error; draw inputs with a larger margin")
        raise AssertionError("qwen3layer.testing.assert_matches: " + "; ".join(lines) + "\n" + str(result))
    return result
