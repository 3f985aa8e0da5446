"""What a notebook shows: Profile as an HTML stage table, the layer map as SVG, and the
routing summary of a call (tokens per expert counted in C, as a table and a bar chart). The
reprs are parsed (html.parser, xml.etree) and must hold the objects' own numbers; the counts
must equal torch.bincount of the trace's experts."""
import dataclasses
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import matplotlib
import pytest
import torch

import qwen3layer as q3
from qwen3layer import _C
from qwen3layer.analysis.routing import RoutingSummary, routing_summary

matplotlib.use("Agg")

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
# odd sizes: 13 experts, top-3
CFG = q3.LayerConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=13,
                     num_experts_per_tok=3, moe_intermediate_size=32)
VOID = {"br", "hr", "img", "input", "meta", "link", "col", "wbr"}


class Tables(HTMLParser):
    """Every table row as its cells' text (and whether the row is bold); raises on a tag
    closed out of order or left open (checked by closed())."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack, self.rows, self.text, self.captions = [], [], None, []

    def handle_starttag(self, tag, attrs):
        if tag not in VOID:
            self.stack.append(tag)
        if tag == "tr":
            self.rows.append(([], "font-weight:bold" in (dict(attrs).get("style") or "")))
        if tag in ("td", "th", "caption", "p"):
            self.text = ""

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes {self.stack[-1:]}"
        self.stack.pop()
        if tag in ("td", "th"):
            self.rows[-1][0].append(self.text)
        elif tag in ("caption", "p"):
            self.captions.append(self.text)
        if tag in ("td", "th", "caption", "p"):
            self.text = None

    def handle_data(self, data):
        if self.text is not None:
            self.text += data

    def closed(self):
        self.close()
        assert not self.stack, f"left open: {self.stack}"
        return self


def parse_html(text):
    p = Tables()
    p.feed(text)
    return p.closed()


@pytest.fixture(scope="module")
def layer():
    return q3.DecoderLayer.random(CFG, seed=3, dtype="float32")


@pytest.fixture(scope="module")
def trace(layer):
    cache = layer.new_cache(64)
    return layer.prefill(torch.randn(29, CFG.hidden_size, generator=torch.Generator().manual_seed(0)), cache,
                         return_router=True)


def bincount(experts, n=CFG.num_experts):
    return tuple(torch.bincount(experts.reshape(-1).long(), minlength=n).tolist())


# ---- Profile and the map ----------------------------------------------------------------------

def test_profile_html_is_a_table_of_every_stage_and_its_figures(layer):
    p = layer.profile("prefill", 20, 3, 8, repeat=1)
    page = parse_html(p._repr_html_())
    head, *rows = page.rows
    assert head[0][:2] == ["stage", "kernel"] and "ms" in head[0] and "share" in head[0]
    col = {h: i for i, h in enumerate(head[0])}
    assert [r[0][0] for r in rows] == [s.name for s in p.stages]
    for (cells, bold), s in zip(rows, p.stages):
        assert cells[col["kernel"]] == s.kernel and cells[col["shapes (first pass)"]] == s.shapes
        assert cells[col["ms"]] == f"{s.seconds * 1e3:.2f}" and cells[col["share"]] == f"{s.share:.0%}"
        assert cells[col["GFLOP"]] == f"{s.flops / 1e9:.2f}" and cells[col["moved MB"]] == f"{s.bytes / 1e6:.1f}"
        assert bold == (s.name == p.dominant.name)
    assert p.title() in page.captions[0] and "20 token(s)" in page.captions[0]
    assert p.table().splitlines()[0] == p.title()  # the terminal's table is unchanged
    assert repr(p) == str(p) == p.table()  # a terminal's `p` and print(p): the table, not the dataclass's fields


def test_profile_html_escapes_text(layer):
    p = layer.profile("decode", 1, 2, repeat=1)
    odd = dataclasses.replace(p, stages=[dataclasses.replace(p.stages[0], kernel="a<b & c>", shapes="<script>")]
                              + p.stages[1:])
    text = odd._repr_html_()
    assert "<script>" not in text and "a&lt;b &amp; c&gt;" in text
    cells = parse_html(text).rows[1][0]
    assert cells[1:3] == ["a<b & c>", "<script>"]


def test_layer_map_renders_as_svg_holding_every_stage(layer):
    m = q3.layer_map(layer, tokens=16, context=5, chunk_size=8, repeat=1)
    svg = ET.fromstring(m._repr_svg_())
    assert svg.tag == "{http://www.w3.org/2000/svg}svg"
    texts = ["".join(t.itertext()) for t in svg.iter("{http://www.w3.org/2000/svg}text")]
    joined = "\n".join(texts)
    assert m.title in joined and "KV cache" in joined
    for profile in (m.prefill, m.decode):
        for s in profile.stages:
            assert f"{s.name}  [{s.kernel}]" in texts
            assert f"{s.seconds * 1e3:.2f} ms ({s.share:.0%})" in joined
    assert "prefill: 16 tokens, chunks of 8" in joined and "decode: 1 token at context 5" in joined
    assert repr(m) == f"{m.title}\n\n{m.prefill.table()}\n\n{m.decode.table()}"
    assert m.decode.cost.context == 5 and m.prefill.cost.tokens == 16


def test_layer_map_saves_files_and_leaves_pyplot_alone(layer, tmp_path):
    import matplotlib.pyplot as plt

    before = plt.get_fignums()
    m = q3.layer_map(layer, tokens=8, chunk_size=8, repeat=1)
    m._repr_svg_()
    m.save(str(tmp_path / "map.svg"), str(tmp_path / "map.png"))
    assert plt.get_fignums() == before  # no figure left registered with pyplot
    assert ET.parse(tmp_path / "map.svg").getroot().tag.endswith("svg")
    assert (tmp_path / "map.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- routing ---------------------------------------------------------------------------------

def test_routing_counts_equal_a_bincount_of_the_trace(trace):
    r = trace.routing()
    assert isinstance(r, RoutingSummary)
    assert r.counts == bincount(trace.experts) and r.num_experts == 13 and r.top_k == 3
    assert r.tokens == 29 and r.choices == 29 * 3 and sum(r.counts) == 87
    counts = torch.tensor(r.counts)
    assert r.busiest == tuple(torch.nonzero(counts == counts.max()).flatten().tolist())
    assert r.idlest == tuple(torch.nonzero(counts == counts.min()).flatten().tolist())
    assert r.unused == tuple(torch.nonzero(counts == 0).flatten().tolist())
    assert r.imbalance == pytest.approx(counts.max().item() / (87 / 13))
    assert r.ranking()[0] == r.busiest[0] and sorted(r.ranking()) == list(range(13))


def test_routing_of_batched_prefill_and_decode(layer):
    cache = layer.new_cache(32, batch=2)
    g = torch.Generator().manual_seed(1)
    pre = layer.prefill(torch.randn(2, 7, CFG.hidden_size, generator=g), cache, return_router=True)
    assert tuple(pre.experts.shape) == (2, 7, 3)
    assert pre.routing().counts == bincount(pre.experts) and pre.routing().tokens == 14
    dec = layer.decode(torch.randn(2, CFG.hidden_size, generator=g), cache, return_router=True)
    assert dec.routing().counts == bincount(dec.experts) and dec.routing().tokens == 2


def test_routing_summary_takes_any_layout_and_numpy(trace):
    sliced = trace.experts[3:20:2, 1:]  # strided rows, two of the three slots
    r = routing_summary(sliced, 13)
    assert not sliced.is_contiguous() and r.counts == bincount(sliced) and r.top_k == 2 and r.tokens == 9
    assert routing_summary(trace.experts.numpy(), 13).counts == bincount(trace.experts)
    assert routing_summary(trace.experts.T, 13).counts == bincount(trace.experts)
    import numpy as np

    backwards = trace.experts.numpy()[::-3, ::-1]  # negative strides
    assert routing_summary(backwards, 13).counts == bincount(torch.from_numpy(backwards.copy()))
    # a size-1 dimension's stride is never taken, whatever it is
    odd = np.lib.stride_tricks.as_strided(trace.experts.numpy(), shape=(29, 1, 3), strides=(12, 2**61, 4))
    assert routing_summary(odd, 13).counts == bincount(trace.experts)
    empty = routing_summary(trace.experts[:0], 13)
    assert empty.counts == (0,) * 13 and empty.tokens == 0 and empty.imbalance == 0.0
    assert _C.expert_counts(trace.experts, 13) == list(bincount(trace.experts))


def test_routing_summary_refuses_views_whose_elements_overlap(trace):
    """an expand (stride 0) or an overlapping as_strided view would make the count walk far
    more elements than the memory holds (2^40 here, over 4 bytes): refused at once, by name"""
    import numpy as np

    with pytest.raises(ValueError, match=r"experts: expected a view whose elements do not overlap, got shape "
                                         r"\[1099511627776\] with strides \[0\] .*call .contiguous\(\)"):
        routing_summary(torch.zeros(1, dtype=torch.int32).expand(2**40), 13)
    with pytest.raises(ValueError, match="elements do not overlap"):
        routing_summary(trace.experts[:1].expand(5, 3), 13)
    flat = trace.experts.numpy().reshape(-1)
    with pytest.raises(ValueError, match="elements do not overlap"):  # rows of 3 starting 1 apart
        routing_summary(np.lib.stride_tricks.as_strided(flat, shape=(20, 3), strides=(4, 4)), 13)
    assert routing_summary(trace.experts[:1].expand(5, 3).contiguous(), 13).tokens == 5


def test_routing_html_lists_every_expert_and_its_count(trace):
    r = trace.routing()
    page = parse_html(r._repr_html_())
    head, *rows = page.rows
    assert head[0][:3] == ["expert", "tokens", "share"]
    assert len(rows) == 13
    got = {int(cells[0]): (int(cells[1]), cells[2]) for cells, _ in rows}
    assert got == {e: (c, f"{c / 87:.1%}") for e, c in enumerate(r.counts)}
    assert [int(cells[0]) for cells, _ in rows] == r.ranking()  # busiest first
    assert page.captions[0] == r.headline() and "29 token(s) x top-3 = 87 choices over 13 experts" in r.headline()
    assert str(r) == f"RoutingSummary: {r.headline()}"


def test_routing_plot_draws_a_bar_per_expert(trace):
    import matplotlib.pyplot as plt

    r = trace.routing()
    ax = r.plot()
    bars = ax.patches
    assert len(bars) == 13 and [b.get_height() for b in bars] == list(r.counts)
    assert [round(b.get_x() + b.get_width() / 2) for b in bars] == list(range(13))
    (mean,) = ax.get_lines()
    assert tuple(mean.get_ydata()) == (pytest.approx(87 / 13),) * 2
    fig, given = plt.subplots()
    assert r.plot(ax=given) is given and len(given.patches) == 13
    plt.close("all")


def test_routing_plot_without_matplotlib_says_what_to_install(trace, monkeypatch):
    r = trace.routing()
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"RoutingSummary.plot needs matplotlib \(pip install matplotlib\)"):
        r.plot()


@pytest.mark.parametrize("position,value", [((4, 1), 13), ((0, 0), -1), ((28, 2), 1 << 30)])
def test_an_expert_out_of_range_is_named_by_its_position(trace, position, value):
    bad = trace.experts.clone()
    bad[position] = value
    with pytest.raises(IndexError, match=rf"experts\[{position[0]}, {position[1]}\]: expected an expert index "
                                         rf"in \[0, 13\) \(num_experts\), got {value}"):
        routing_summary(bad, 13)


@pytest.mark.parametrize("experts,error,msg", [
    (lambda t: t.experts.long(), TypeError, "experts: expected dtype int32, got int64"),
    (lambda t: t.router_logits, TypeError, "experts: expected dtype int32, got float32"),
    (lambda t: t.experts.tolist(), TypeError, "experts: expected a tensor with __dlpack__"),
    (lambda t: torch.tensor(3, dtype=torch.int32), ValueError, "experts: expected at least 1 dimension"),
    (lambda t: torch.zeros(4, 0, dtype=torch.int32), ValueError, r"experts: expected a shape \[..., top_k\] with "
                                                                  r"top_k >= 1, got \[4, 0\]"),
])
def test_wrong_experts_are_refused_naming_the_argument(trace, experts, error, msg):
    with pytest.raises(error, match=msg):
        routing_summary(experts(trace), 13)


@pytest.mark.parametrize("n", [0, -2, 4097])
def test_wrong_num_experts_is_refused(trace, n):
    with pytest.raises(ValueError, match=rf"num_experts: expected 1 <= num_experts <= 4096, got {n}"):
        routing_summary(trace.experts, n)


def test_a_trace_without_router_choices_says_how_to_get_them(layer):
    cache = layer.new_cache(8)
    t = layer.prefill(torch.randn(2, CFG.hidden_size), cache, return_attention=True)
    with pytest.raises(ValueError, match=r"routing: this trace holds no router choices; call prefill/decode with "
                                         r"return_router=True"):
        t.routing()


NO_BACKEND_SCRIPT = r"""
import sys
sys.path.insert(0, sys.argv[1])
from qwen3layer import _C

class OnGpu:
    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, **kw):
        raise AssertionError("exported before the device was checked")

try:
    _C.expert_counts(OnGpu(), 4)
except ValueError as e:
    print(e)
"""


def test_a_cuda_tensor_without_the_cuda_backend_is_refused_before_it_is_exported():
    """In a fresh process (the backend, once loaded, stays for the process)."""
    r = subprocess.run([sys.executable, "-c", NO_BACKEND_SCRIPT, ROOT], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ("experts: expected a host tensor, or a CUDA one once the CUDA backend is loaded "
                                "(qwen3layer.cuda.load()), got a tensor on cuda:0")


DEVICE_SCRIPT = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
import qwen3layer as q3
from qwen3layer import _C
q3.cuda.emulate()
cfg = q3.LayerConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=13,
                     num_experts_per_tok=3, moe_intermediate_size=32)
layer = q3.DecoderLayer.random(cfg, seed=3, dtype="float32", device="cuda")
cache = layer.new_cache(32, batch=2)
out = {}
for name, call in (("prefill", lambda: layer.prefill(layer.random_input((2, 9, 64), 1), cache, return_router=True)),
                   ("decode", lambda: layer.decode(layer.random_input((2, 64), 2), cache, return_router=True))):
    t = call()
    host = torch.from_dlpack(_C.copy_tensor(t.experts, -1))
    out[name] = [str(t.experts.device), list(t.routing().counts),
                 torch.bincount(host.flatten().long(), minlength=13).tolist()]
print(json.dumps(out))
"""


def test_routing_of_a_cuda_trace_on_the_executor():
    """A CUDA layer's experts stay on the device; the glue copies them to the host (after a
    synchronisation of the device) and counts them there. On the SIMT executor, in a
    subprocess (the executor is then the whole process's CUDA backend)."""
    r = subprocess.run([sys.executable, "-c", DEVICE_SCRIPT, ROOT], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for name, tokens in (("prefill", 18), ("decode", 2)):
        device, counts, expected = out[name]
        assert device == "cuda:0" and counts == expected and sum(counts) == 3 * tokens, (name, out[name])
