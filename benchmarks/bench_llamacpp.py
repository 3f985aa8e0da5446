"""llama.cpp peer: this layer against llama.cpp's llama-bench on the same layer's weights.

    python benchmarks/bench_llamacpp.py --llama-bench PATH [--llama-quantize PATH]
    python benchmarks/bench_llamacpp.py --llama-bench PATH --small --depths 0 --rounds 1 --reps 1   # smoke

The script writes the layer's random weights (qwen3layer's own draws, seed --seed) into a
one-layer qwen3moe GGUF (bf16; llama-quantize makes F16, Q8_0, Q4_0 and Q4_K_M copies of it), then
times, in interleaved rounds, llama.cpp bf16, Q8_0, Q4_0 and Q4_K_M, and qwen3layer bf16, FP8
(fp8_e4m3_block128) and int4 (gptq_int4: 4-bit GPTQ, group 128, rounded to nearest), the last
two the same draws quantized, on llama-bench's two tests:

    pp512 @ d: tok/s of a prefill of 512 tokens into a cache that holds d tokens
    tg32  @ d: tok/s of 32 decode steps, one token each, after d tokens

llama-bench runs with -embd 1: in a one-layer model the layer is the last one, and llama.cpp
runs the last layer's MoE only for the tokens whose output is asked (the last, in a prompt):
its pp would skip the MoE of 511 of 512 tokens (two thirds of the layer's FLOPs, and more of
its time). With embeddings on it computes every token's output, as this layer does. What
llama.cpp also runs and we do not: the token embedding lookup, the final norm and an lm_head
over VOCAB tokens (2 x 320 x 4096 FLOPs a token, 0.6% of the layer's 446 M).

The quantized GGUFs hold the tensor types llama-quantize picks (the script prints them), and
llama.cpp repacks them at load as it does by default: norms and router stay F32, the lm_head is
Q6_K in Q4_0 and Q4_K_M. Q4_K_M chooses by layer, and the one layer here is a first one: its
ffn_down_exps (a third of the experts' weights) and attn_v are Q6_K, as in 46 of the 94
layers of a Q4_K_M of the whole model (the other 48 Q4_K, as the rest of the matrices).

The table gives tok/s, then ours over theirs: bf16 and FP8 each against llama.cpp bf16 and
Q8_0 (issue 23's targets read ours against both), fp16 against llama.cpp F16 (llama-quantize's
F16 copy of the bf16 GGUF; ours: DecoderLayer.random's fp16 draws of the seed; --engines
llama-f16,ours-f16 for those two alone), int4 only against the two 4-bit formats
(a 4-bit layer against a 16- or 8-bit one says more about the bytes than about the code).

Needs torch, qwen3layer (built) and the `gguf` package (pip install -e ".[bench]").
Without --llama-bench it says how to build one and exits 0 (skipped). Not part of the tests.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
from machine import cpu_name  # noqa: E402

VOCAB = 320          # tokens of the GGUF's vocabulary: <unk> <s> </s>, 256 byte tokens, 61 words
UBATCH = 512         # llama-bench's default -ub; our prefill runs in chunks of as many tokens
ENGINES = ("llama-bf16", "llama-f16", "llama-q8_0", "llama-q4_0", "llama-q4_k_m", "ours-bf16", "ours-f16", "ours-fp8",
           "ours-int4")
QUANTS = {"llama-f16": "F16", "llama-q8_0": "Q8_0", "llama-q4_0": "Q4_0",
          "llama-q4_k_m": "Q4_K_M"}                                              # engine: llama-quantize type
OURS = {"ours-fp8": "fp8_e4m3_block128", "ours-int4": "gptq_int4"}              # engine: weight_format
PAIRS = [("ours-bf16", "llama-bf16"), ("ours-f16", "llama-f16"), ("ours-bf16", "llama-q8_0"), ("ours-fp8", "llama-bf16"),
         ("ours-fp8", "llama-q8_0"), ("ours-int4", "llama-q4_0"), ("ours-int4", "llama-q4_k_m")]

BUILD_HELP = """\
bench_llamacpp.py: skipped: no --llama-bench given (the path of llama.cpp's llama-bench binary).
Build llama-bench and llama-quantize (it makes the Q8_0, Q4_0 and Q4_K_M GGUFs from the bf16
one; without it those engines run only from cached files) outside this repo from the
llama-cpp-python sdist's vendored llama.cpp, with clang (~6 minutes on 2 cores of a Xeon, ~8
on a Zen 1 EPYC). Not GCC 12: its _tile_loadconfig declares 8 of the tile configuration's 64
bytes read, the other stores are dropped and ggml's AMX Q8_0 kernels fault. clang 14 spells
the AMX macros __AMXINT8__ etc., and ggml tests __AMX_INT8__: the -D flags below name them as
ggml's own CMake does for MSVC, on a CPU that has AMX (elsewhere they would build code it
cannot run).

    apt-get install -y clang libomp-14-dev
    pip download llama-cpp-python --no-binary llama-cpp-python --no-deps -d /tmp/llama-src
    tar xzf /tmp/llama-src/llama_cpp_python-*.tar.gz -C /tmp/llama-src
    AMX=""; grep -qw amx_tile /proc/cpuinfo && AMX="-D__AMX_TILE__ -D__AMX_INT8__ -D__AMX_BF16__"  # only where the CPU has AMX
    cmake -S /tmp/llama-src/llama_cpp_python-*/vendor/llama.cpp -B /tmp/llama-build \\
        -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \\
        -DCMAKE_C_FLAGS="$AMX" -DCMAKE_CXX_FLAGS="$AMX" -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \\
        -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \\
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF
    cmake --build /tmp/llama-build --target llama-bench llama-quantize -j 2

then: python benchmarks/bench_llamacpp.py --llama-bench /tmp/llama-build/bin/llama-bench \\
          --llama-quantize /tmp/llama-build/bin/llama-quantize"""



def layer_config(small: bool):
    import qwen3layer as q3

    if not small:
        return q3.LayerConfig.qwen3_235b_a22b()
    return q3.LayerConfig(hidden_size=1024, num_attention_heads=16, num_key_value_heads=2, head_dim=128,
                          num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512)


# ---------------------------------------------------------------------------------------------
# The GGUF: one qwen3moe block holding qwen3layer's weights

class Pieces:
    """A tensor for GGUFWriter made of contiguous numpy arrays written one after another, so
    that a strided view (the gate or up half of every expert) is written without a copy.
    GGUFWriter reads only .shape, .dtype, .nbytes and .tofile() of what it is given."""

    def __init__(self, pieces: list, shape: tuple):
        self.pieces, self.shape, self.dtype = pieces, shape, pieces[0].dtype
        self.nbytes = sum(p.nbytes for p in pieces)

    def tofile(self, f) -> None:
        for p in self.pieces:
            p.tofile(f)


def bf16_bits(t) -> np.ndarray:
    """the uint16 bits of a bf16 tensor (numpy has no bf16), a view of its memory"""
    import torch

    return torch.from_dlpack(t).view(torch.int16).numpy().view(np.uint16)


def as_f32(t) -> np.ndarray:
    import torch

    return torch.from_dlpack(t).float().numpy()


def vocab() -> tuple:
    """a small SentencePiece ("llama") vocabulary llama.cpp loads: <unk>=0, <s>=1, </s>=2, the
    256 byte tokens <0x00>..<0xFF> (its newline token is <0x0A>), then plain words"""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256   # gguf.TokenType: UNKNOWN, CONTROL, BYTE, NORMAL
    tokens += [f"\u2581w{i}" for i in range(VOCAB - len(tokens))]
    types += [1] * (VOCAB - len(types))
    scores = [0.0] * 259 + [-float(i) for i in range(VOCAB - 259)]
    return tokens, scores, types


def gguf_tensors(cfg, weights: dict, seed: int) -> list:
    """(GGUF name, array, GGML type) for every tensor of the one-layer model.

    GGUF lists dims fastest first, numpy slowest first: a numpy [out, in] matrix is ggml's
    {in, out}, which is what llama.cpp's qwen3moe loader asks for (attn_q {n_embd, n_head *
    head_dim}, ffn_gate_exps {n_embd, n_ff_exp, n_expert} = numpy [E, I, H]). No permutation
    of q/k rows: qwen3moe's RoPE is NEOX (half-split), as in transformers and this layer.
    As convert_hf_to_gguf.py does: norms (1-D) and the router in F32, matrices in BF16.
    The bf16 arrays are views of the weights' memory (each keeps its owner alive)."""
    from gguf import GGMLQuantizationType as T

    from qwen3layer import _C

    H, E, I = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    gu = bf16_bits(weights["mlp.experts.gate_up_proj"])      # [E, 2I, H]: rows 0..I-1 gate, I..2I-1 up
    emb = _C.random_tensor((VOCAB, H), seed + 1, "bfloat16")  # N(0, 1): inputs like our side's
    head = _C.random_tensor((VOCAB, H), seed + 2, "bfloat16", 0.02)
    w = lambda name: weights[name]
    return [
        ("token_embd.weight", bf16_bits(emb), T.BF16),                              # [V, H]
        ("output_norm.weight", np.ones(H, np.float32), T.F32),                      # [H]
        ("output.weight", bf16_bits(head), T.BF16),                                 # [V, H]
        ("blk.0.attn_norm.weight", as_f32(w("input_layernorm.weight")), T.F32),     # [H]
        ("blk.0.attn_q.weight", bf16_bits(w("self_attn.q_proj.weight")), T.BF16),   # [nq*hd, H]
        ("blk.0.attn_k.weight", bf16_bits(w("self_attn.k_proj.weight")), T.BF16),   # [nkv*hd, H]
        ("blk.0.attn_v.weight", bf16_bits(w("self_attn.v_proj.weight")), T.BF16),   # [nkv*hd, H]
        ("blk.0.attn_output.weight", bf16_bits(w("self_attn.o_proj.weight")), T.BF16),  # [H, nq*hd]
        ("blk.0.attn_q_norm.weight", as_f32(w("self_attn.q_norm.weight")), T.F32),  # [hd]
        ("blk.0.attn_k_norm.weight", as_f32(w("self_attn.k_norm.weight")), T.F32),  # [hd]
        ("blk.0.ffn_norm.weight", as_f32(w("post_attention_layernorm.weight")), T.F32),  # [H]
        ("blk.0.ffn_gate_inp.weight", as_f32(w("mlp.gate.weight")), T.F32),         # [E, H]
        ("blk.0.ffn_gate_exps.weight", Pieces([gu[e, :I] for e in range(E)], (E, I, H)), T.BF16),
        ("blk.0.ffn_up_exps.weight", Pieces([gu[e, I:] for e in range(E)], (E, I, H)), T.BF16),
        ("blk.0.ffn_down_exps.weight", bf16_bits(w("mlp.experts.down_proj")), T.BF16),  # [E, H, I]
    ]


def write_gguf(path: str, cfg, weights: dict, seed: int) -> None:
    """the bf16 GGUF at path (written to path.partial, renamed when complete), streamed: the
    tensors are views of the layer's weights, written one by one"""
    import gguf

    arch = "qwen3moe"
    wr = gguf.GGUFWriter(path + ".partial", arch)
    wr.add_name("qwen3layer random layer")
    wr.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    wr.add_block_count(1)
    wr.add_context_length(cfg.max_position_embeddings)
    wr.add_embedding_length(cfg.hidden_size)
    # the dense FFN width: unused by qwen3moe beside expert_feed_forward_length (12288 = 8 x 1536)
    wr.add_feed_forward_length(cfg.moe_intermediate_size * cfg.num_experts_per_tok)
    wr.add_head_count(cfg.num_attention_heads)
    wr.add_head_count_kv(cfg.num_key_value_heads)
    wr.add_key_length(cfg.head_dim)      # 128, not hidden / heads = 64
    wr.add_value_length(cfg.head_dim)
    wr.add_rope_freq_base(cfg.rope_theta)
    wr.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    wr.add_expert_count(cfg.num_experts)
    wr.add_expert_used_count(cfg.num_experts_per_tok)
    wr.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    tokens, scores, types = vocab()
    wr.add_tokenizer_model("llama")
    wr.add_token_list(tokens)
    wr.add_token_scores(scores)
    wr.add_token_types(types)
    wr.add_unk_token_id(0)
    wr.add_bos_token_id(1)
    wr.add_eos_token_id(2)
    for name, arr, ggml_type in gguf_tensors(cfg, weights, seed):
        wr.add_tensor(name, arr, raw_dtype=ggml_type)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    os.replace(path + ".partial", path)


def gguf_params(path: str) -> int:
    """elements of all tensors of a GGUF (llama-bench's model_n_params must match)"""
    import gguf

    return sum(int(t.n_elements) for t in gguf.GGUFReader(path).tensors)


def gguf_types(path: str) -> str:
    """how many tensors of each GGML type a GGUF holds: llama-quantize picks a type a tensor
    (Q4_K_M is a mix), so the file says what was timed"""
    import gguf

    counts = collections.Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors)
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))


def quantize(tool: str, src: str, dst: str, qtype: str, threads: int) -> None:
    """llama-quantize src -> dst as qtype (Q8_0, Q4_0, Q4_K_M: the tensor types llama.cpp
    decides), its warnings shown: a fallback to another type for a row length the type's
    blocks do not divide would change what is timed"""
    t = time.perf_counter()
    r = subprocess.run([tool, src, dst + ".partial", qtype, str(threads)], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"llama-quantize failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    os.replace(dst + ".partial", dst)
    print(f"  quantized to {qtype} in {time.perf_counter() - t:.0f} s: {dst}")
    for line in (r.stdout + r.stderr).splitlines():
        if "warning" in line.lower():
            print(f"    llama-quantize: {line.strip()}")


# ---------------------------------------------------------------------------------------------
# llama.cpp: one llama-bench run per model and round

def llama_bench(bench: str, model: str, args) -> list:
    """llama-bench's JSON records, one a test: pp<prompt> and tg<gen> at each depth"""
    cmd = [bench, "-m", model, "-embd", "1", "-t", str(args.threads), "-p", str(args.prompt),
           "-n", str(args.gen), "-d", args.depths, "-r", str(args.reps), "-o", "json"] + args.llama_args.split()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        hint = ("\n(killed by a signal: a GCC 12 build of llama.cpp faults in its AMX Q8_0 kernels; build it "
                "with clang as the README says, or pass --llama-args='--repack 0' to leave them out)"
                if r.returncode < 0 else "")
        raise SystemExit(f"llama-bench failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr[-4000:]}{hint}")
    return json.loads(r.stdout)


def check_record(rec: dict, args, n_params: int) -> None:
    """what llama-bench ran is what was asked: the model's size, threads, embeddings, tokens,
    depth and repetitions"""
    problems = []
    if rec["model_n_params"] != n_params:
        problems.append(f"model_n_params {rec['model_n_params']} (the GGUF holds {n_params})")
    if rec["n_threads"] != args.threads:
        problems.append(f"n_threads {rec['n_threads']}")
    if not rec["embeddings"]:
        problems.append("embeddings off")
    if (rec["n_prompt"], rec["n_gen"]) not in ((args.prompt, 0), (0, args.gen)):
        problems.append(f"n_prompt {rec['n_prompt']}, n_gen {rec['n_gen']}")
    if rec["n_depth"] not in [int(d) for d in args.depths.split(",")]:
        problems.append(f"n_depth {rec['n_depth']}")
    if len(rec["samples_ts"]) != args.reps:
        problems.append(f"{len(rec['samples_ts'])} samples")
    if problems:
        raise SystemExit(f"llama-bench ran something else than asked: {', '.join(problems)}")


def label(kind: str, args) -> str:
    return f"pp{args.prompt}" if kind == "pp" else f"tg{args.gen}"


def llama_round(bench: str, model: str, n_params: int, args, samples: dict, engine: str, info: dict) -> None:
    for rec in llama_bench(bench, model, args):
        check_record(rec, args, n_params)
        kind = "pp" if rec["n_prompt"] else "tg"
        samples.setdefault((engine, kind, rec["n_depth"]), []).extend(rec["samples_ts"])
        info.setdefault("llama", {k: rec[k] for k in ("build_commit", "build_number", "cpu_info", "backends",
                                                      "flash_attn", "type_k", "type_v", "n_batch", "n_ubatch")})
        info.setdefault("models", {})[engine] = f"{rec['model_type']}, {rec['model_size'] / 1e9:.2f} GB"


# ---------------------------------------------------------------------------------------------
# qwen3layer: the same two tests, timed the same way

class OurEngine:
    """a qwen3layer layer with one KV cache a depth, filled once (untimed) and cut back to
    the depth after every timed call, as llama-bench restores its cached depth state"""

    def __init__(self, layer, cfg, args):
        from qwen3layer import _C

        self.layer, self.cfg, self.args, self.caches = layer, cfg, args, {}
        H = cfg.hidden_size
        self.prompt = _C.random_tensor((args.prompt, H), 19, layer.dtype)             # [prompt, H]
        self.steps = [_C.random_tensor((1, H), 20 + i, layer.dtype) for i in range(args.gen)]  # gen x [1, H]

    def cache(self, depth: int):
        if depth not in self.caches:
            from qwen3layer import _C

            c = self.layer.new_cache(depth + max(self.args.prompt, self.args.gen))
            for t0 in range(0, depth, UBATCH):
                n = min(UBATCH, depth - t0)
                self.layer.prefill(_C.random_tensor((n, self.cfg.hidden_size), 1000 + t0, self.layer.dtype), c,
                                   chunk_size=UBATCH)
            self.caches[depth] = c
        return self.caches[depth]

    def pp(self, depth: int) -> float:
        """seconds of one prefill of the prompt after depth tokens"""
        c = self.cache(depth)
        t = time.perf_counter()
        self.layer.prefill(self.prompt, c, chunk_size=UBATCH)
        t = time.perf_counter() - t
        c.truncate(depth)
        return t

    def tg(self, depth: int) -> float:
        """seconds of gen decode steps after depth tokens"""
        c = self.cache(depth)
        t = time.perf_counter()
        for x in self.steps:
            self.layer.decode(x, c)
        t = time.perf_counter() - t
        c.truncate(depth)
        return t


def our_round(eng: OurEngine, depths: list, args, samples: dict, engine: str) -> None:
    """as llama-bench: per test a warm-up call, then reps timed calls; pp tests first"""
    for kind, tokens in (("pp", args.prompt), ("tg", args.gen)):
        run = eng.pp if kind == "pp" else eng.tg
        for d in depths:
            run(d)
            samples.setdefault((engine, kind, d), []).extend(tokens / run(d) for _ in range(args.reps))


# ---------------------------------------------------------------------------------------------
# the table

def cell(xs) -> str:
    if not xs:
        return "-"
    return f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})"


def ratio(samples: dict, ours: str, theirs: str, key: tuple) -> str:
    a, b = samples.get((ours,) + key), samples.get((theirs,) + key)
    return f"{statistics.median(a) / statistics.median(b):.2f}x" if a and b else "-"


def print_rows(head: list, rows: list) -> None:
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    fmt = lambda r: " | ".join(v.ljust(w) for v, w in zip(r, widths))
    print(fmt(head))
    print("-|-".join("-" * w for w in widths))
    for r in rows:
        print(fmt(r))


def print_table(samples: dict, engines: list, depths: list, args) -> None:
    """tok/s of every engine, then the ratios of PAIRS whose two engines ran: two tables, as
    seven engines and six ratios in one would not fit a screen"""
    tests = [(f"{label(kind, args)} @ d{d}", (kind, d)) for kind in ("pp", "tg") for d in depths]
    print_rows(["test"] + [f"{e} tok/s" for e in engines],
               [[name] + [cell(samples.get((e,) + key)) for e in engines] for name, key in tests])
    pairs = [(o, t) for o, t in PAIRS if o in engines and t in engines]
    if pairs:
        print()
        print_rows(["test"] + [f"{o}/{t}" for o, t in pairs],
                   [[name] + [ratio(samples, o, t, key) for o, t in pairs] for name, key in tests])


# ---------------------------------------------------------------------------------------------

def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-bench", help="path of llama.cpp's llama-bench (without it: skipped)")
    ap.add_argument("--llama-quantize", help="path of llama-quantize, to make the Q8_0, Q4_0 and Q4_K_M GGUFs")
    ap.add_argument("--work-dir", default="/tmp/qwen3layer-llamacpp", help="where the GGUF files are kept")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="threads of both engines")
    ap.add_argument("--depths", default="0,512,4096", help="tokens in the cache before each test")
    ap.add_argument("--prompt", type=int, default=512, help="pp test's tokens (llama-bench -p)")
    ap.add_argument("--gen", type=int, default=32, help="tg test's decode steps (llama-bench -n)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of all engines")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions of a test in a round (-r)")
    ap.add_argument("--engines", default=",".join(ENGINES), help="a subset of " + ",".join(ENGINES))
    ap.add_argument("--seed", type=int, default=0, help="the weights' seed (of both engines)")
    ap.add_argument("--small", action="store_true", help="a small geometry (1024 hidden, 32 experts)")
    ap.add_argument("--llama-args", default="", help="more llama-bench arguments, e.g. '-fa 1'")
    ap.add_argument("--json", help="write every sample to this file")
    return ap.parse_args()


def prepare_ggufs(args, cfg, weights, engines: list) -> dict:
    """engine -> (GGUF path, its parameter count), writing or quantizing what is not cached"""
    os.makedirs(args.work_dir, exist_ok=True)
    stem = os.path.join(args.work_dir, f"qwen3moe-1layer-{'small' if args.small else 'real'}-seed{args.seed}")
    bf16 = stem + "-bf16.gguf"
    if not os.path.exists(bf16):
        t = time.perf_counter()
        write_gguf(bf16, cfg, weights, args.seed)
        print(f"  wrote {bf16} in {time.perf_counter() - t:.0f} s")
    else:
        print(f"  reusing {bf16}")
    out = {}
    if "llama-bf16" in engines:
        out["llama-bf16"] = bf16
    for e, qtype in QUANTS.items():
        if e not in engines:
            continue
        path = f"{stem}-{qtype.lower()}.gguf"
        if not os.path.exists(path) and args.llama_quantize:
            quantize(args.llama_quantize, bf16, path, qtype, args.threads)
        if os.path.exists(path):
            out[e] = path
            print(f"  using {path}")
        else:
            print(f"  {e} left out: no --llama-quantize given and no cached {qtype} GGUF")
    for e, p in out.items():
        print(f"  {e} tensors: {gguf_types(p)}")
    return {e: (p, gguf_params(p)) for e, p in out.items()}


def main() -> int:
    args = parse_args()
    if not args.llama_bench:
        print(BUILD_HELP)
        return 0
    if not os.access(args.llama_bench, os.X_OK):
        raise SystemExit(f"--llama-bench {args.llama_bench}: not an executable file")
    # qwen3layer takes its thread count from OpenMP at import: set it before the first import
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import qwen3layer as q3
    from qwen3layer import _C

    started = time.perf_counter()
    engines = [e for e in args.engines.split(",") if e]
    if set(engines) - set(ENGINES):
        raise SystemExit(f"--engines: unknown {sorted(set(engines) - set(ENGINES))}; known: {ENGINES}")
    depths = [int(d) for d in args.depths.split(",")]
    cfg = layer_config(args.small)
    bi = q3.build_info()
    assert bi["threads"] == args.threads, bi
    print(f"machine: {cpu_name()}, {os.cpu_count()} cpus; {args.threads} threads for both engines")
    print(f"qwen3layer {bi['version']}, cpu path {bi['cpu_path']}; geometry {'small' if args.small else 'real'}")

    t = time.perf_counter()
    weights = _C.random_weights(cfg, args.seed, "bfloat16")   # the bf16 layer's, exported to the GGUF
    print(f"weights drawn in {time.perf_counter() - t:.0f} s ({sum(w.nbytes for w in weights.values()) / 1e9:.2f} GB)")
    ggufs = prepare_ggufs(args, cfg, weights, engines)
    engines = [e for e in engines if not e.startswith("llama") or e in ggufs]
    ours = {}
    if "ours-bf16" in engines:
        ours["ours-bf16"] = OurEngine(q3.DecoderLayer(cfg, weights), cfg, args)
    del weights
    if "ours-f16" in engines:  # fp16 draws of the same seed (llama-f16: the bf16 GGUF converted by llama-quantize)
        ours["ours-f16"] = OurEngine(q3.DecoderLayer.random(cfg, args.seed, "float16"), cfg, args)
    for e, weight_format in OURS.items():
        if e in engines:
            ours[e] = OurEngine(q3.DecoderLayer.random(cfg, args.seed, "bfloat16", weight_format=weight_format),
                                cfg, args)

    samples, info = {}, {}
    for r in range(args.rounds):
        for e in engines:
            t = time.perf_counter()
            if e in ggufs:
                llama_round(args.llama_bench, ggufs[e][0], ggufs[e][1], args, samples, e, info)
            else:
                our_round(ours[e], depths, args, samples, e)
            print(f"  round {r + 1}/{args.rounds}: {e} in {time.perf_counter() - t:.0f} s", flush=True)

    if "llama" in info:
        li = info["llama"]
        print(f"\nllama.cpp build {li['build_commit']} ({li['build_number']}), backends {li['backends']}, "
              f"cpu {li['cpu_info']}; flash_attn {li['flash_attn']}, KV {li['type_k']}/{li['type_v']}, "
              f"batch {li['n_batch']}, ubatch {li['n_ubatch']}, -embd 1")
        for e, desc in info["models"].items():
            print(f"  {e}: {desc}")
    print(f"\ntok/s, median (min-max) of {args.rounds} rounds x {args.reps} reps; ratios of medians; "
          f"{args.threads} threads")
    print_table(samples, engines, depths, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "args": vars(args), "cpu": cpu_name(),
                       "samples": [{"engine": e, "test": label(k, args), "depth": d, "tok_s": v}
                                   for (e, k, d), v in samples.items()]}, f, indent=1)
    print(f"\nfinished in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
