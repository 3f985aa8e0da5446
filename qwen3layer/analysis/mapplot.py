"""The dual map as a picture (matplotlib): prefill on the left, decode on the right, every
stage a box in forward order annotated with its shapes, bytes, FLOPs and measured time (the
colour is its share of the time; the dominant stage is outlined in red), and between the two
columns what they share: the weights and the KV cache, with the stages that read or write
them. Also the chunk-size sweep: prefill time and working memory against chunk size.

layer_map(layer, ...) measures both paths and returns a LayerMap: in Jupyter it shows as the
drawing (_repr_svg_), in a terminal as the two stage tables; .save(path) writes files, as
`python -m qwen3layer map` does. The figures are made without pyplot, so drawing a map
neither changes a notebook's matplotlib backend nor opens a window."""
from __future__ import annotations

import dataclasses
import io
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple

from .profile import Profile

if TYPE_CHECKING:
    from ..layer import DecoderLayer

READS_WEIGHTS = {"input_norm", "qkv_proj", "qk_norm_rope", "o_proj", "post_norm", "router", "experts"}
TOUCHES_CACHE = {"kv_write": "writes", "attention": "reads"}


def _mb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _column(ax, x: float, profile: Profile, title: str) -> dict:
    """Draws one path's stages top to bottom; returns stage -> (x, y) of its box centre."""
    from matplotlib import cm
    from matplotlib.patches import FancyBboxPatch

    n = len(profile.stages)
    dominant = profile.dominant.name
    centres = {}
    ax.text(x, n + 0.7, title, ha="center", va="bottom", fontsize=10, weight="bold")
    for i, s in enumerate(profile.stages):
        y = n - 1 - i
        colour = cm.YlOrRd(0.1 + 0.8 * s.share)
        box = FancyBboxPatch((x - 1.45, y - 0.42), 2.9, 0.84, boxstyle="round,pad=0.02", fc=colour,
                             ec="red" if s.name == dominant else "0.4", lw=2.5 if s.name == dominant else 0.8)
        ax.add_patch(box)
        ax.text(x, y + 0.17, f"{s.name}  [{s.kernel}]", ha="center", va="center", fontsize=6.5, weight="bold")
        ax.text(x, y - 0.02, s.shapes, ha="center", va="center", fontsize=5)
        ax.text(x, y - 0.22, f"weights {_mb(s.weight_bytes)} | moved {_mb(s.bytes)} | {s.flops / 1e9:.2f} GFLOP | "
                f"{s.seconds * 1e3:.2f} ms ({s.share:.0%})", ha="center", va="center", fontsize=5)
        centres[s.name] = (x, y)
    return centres


def _figure_class():
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("qwen3layer's drawings need matplotlib (pip install matplotlib)") from None
    return Figure


def map_figure(prefill: Profile, decode: Profile, title: str):
    """The dual map as a matplotlib Figure (not registered with pyplot)."""
    from matplotlib.patches import FancyBboxPatch

    n = len(prefill.stages)
    fig = _figure_class()(figsize=(13, 1.0 + 0.62 * n))
    ax = fig.subplots()
    left = _column(ax, -2.6, prefill, f"prefill: {prefill.cost.tokens} tokens, chunks of {prefill.cost.chunk_size}\n"
                   f"{prefill.stage_seconds * 1e3:.1f} ms")
    right = _column(ax, 2.6, decode, f"decode: 1 token at context {decode.cost.context}\n"
                    f"{decode.stage_seconds * 1e3:.2f} ms")
    shared = {"weights": (0.0, n * 0.66), "KV cache": (0.0, n * 0.25)}
    wbytes = decode.cost.weight_bytes
    labels = {"weights": f"weights\nshared by both paths\ndecode reads {_mb(wbytes)} a token",
              "KV cache": f"KV cache\nprefill writes it,\ndecode reads it\n{_mb(decode.cache_bytes)} held"}
    for name, (x, y) in shared.items():
        ax.add_patch(FancyBboxPatch((x - 0.95, y - 0.8), 1.9, 1.6, boxstyle="round,pad=0.03", fc="#dde8f5", ec="0.3"))
        ax.text(x, y, labels[name], ha="center", va="center", fontsize=7)
    for centres, side in ((left, 1), (right, -1)):
        for stage, (x, y) in centres.items():
            edge = x + side * 1.45
            if stage in READS_WEIGHTS:
                tx, ty = shared["weights"]
                ax.annotate("", xy=(edge, y), xytext=(tx - side * 0.95, ty),
                            arrowprops=dict(arrowstyle="->", color="0.55", lw=0.5))
            if stage in TOUCHES_CACHE:
                tx, ty = shared["KV cache"]
                ax.annotate("", xy=(edge, y), xytext=(tx - side * 0.95, ty),
                            arrowprops=dict(arrowstyle="<-" if TOUCHES_CACHE[stage] == "writes" else "->",
                                            color="tab:blue", lw=1.0))
    ax.set_xlim(-4.3, 4.3)
    ax.set_ylim(-1, n + 1.6)
    ax.axis("off")
    ax.set_title(title, fontsize=11)
    return fig


def draw_map(prefill: Profile, decode: Profile, title: str, paths: Sequence[str]) -> None:
    fig = map_figure(prefill, decode, title)
    for path in paths:
        fig.savefig(path, dpi=150, bbox_inches="tight")


@dataclasses.dataclass(repr=False)
class LayerMap:
    """The dual map of one layer: the prefill and decode profiles (each a Profile, an HTML
    table in Jupyter) and the drawing of both. Shown in Jupyter as the drawing (SVG, its text
    kept as text), in a terminal as the two stage tables."""
    prefill: Profile
    decode: Profile
    title: str

    def figure(self):
        """The drawing as a matplotlib Figure (not registered with pyplot)."""
        return map_figure(self.prefill, self.decode, self.title)

    def save(self, *paths: str) -> None:
        """Writes the drawing to each path (its format from the extension: .svg, .png, .pdf)."""
        draw_map(self.prefill, self.decode, self.title, paths)

    def _repr_svg_(self) -> str:
        import matplotlib

        buf = io.StringIO()
        with matplotlib.rc_context({"svg.fonttype": "none"}):  # text as <text>: small, searchable
            self.figure().savefig(buf, format="svg", bbox_inches="tight")
        return buf.getvalue()

    def __repr__(self) -> str:
        return f"{self.title}\n\n{self.prefill.table()}\n\n{self.decode.table()}"


def layer_map(layer: "DecoderLayer", tokens: int = 512, context: Optional[int] = None, chunk_size: int = 512,
              repeat: int = 2, title: Optional[str] = None) -> LayerMap:
    """Measures `layer` as `python -m qwen3layer map` does (layer.profile: a prefill of
    `tokens` tokens in chunks of `chunk_size`, one decode step at `context`, default
    `tokens`; the median of `repeat` profiled calls, at least 3 for decode) and returns the
    map: the drawing in Jupyter, the two stage tables in a terminal."""
    context = tokens if context is None else context
    pre = layer.profile("prefill", tokens, 0, chunk_size, repeat=repeat)
    dec = layer.profile("decode", 1, context, repeat=max(3, repeat))
    if title is None:
        c = layer.config
        title = (f"a Qwen3-MoE decoder layer ({c.num_experts} experts, top-{c.num_experts_per_tok}, hidden "
                 f"{c.hidden_size}), {layer.dtype}{', FP8 weights' if layer.weight_format != 'dense' else ''}, "
                 f"{layer.device}")
    return LayerMap(pre, dec, title)


def draw_sweep(points: List[Tuple[int, float, int]], title: str, paths: Sequence[str]) -> None:
    """points: (chunk size, prefill seconds, working memory bytes)"""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chunks = [p[0] for p in points]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(chunks, [p[1] for p in points], "o-", color="tab:red", label="prefill time")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("chunk size (tokens)")
    ax.set_ylabel("prefill time (s)", color="tab:red")
    ax2 = ax.twinx()
    ax2.plot(chunks, [p[2] / 2**20 for p in points], "s--", color="tab:blue", label="working memory")
    ax2.set_ylabel("working memory beyond weights and cache (MiB)", color="tab:blue")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    for path in paths:
        fig.savefig(path, dpi=150)
    plt.close(fig)
