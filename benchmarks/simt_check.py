"""What the SIMT executor covers, in one command.

    python benchmarks/simt_check.py              every kernel case on the executor
    python benchmarks/simt_check.py --mutants    ... then each planted defect, which must be caught

Runs q3.cuda.emulate() + q3.cuda.check_kernels() (each CUDA kernel against its CPU twin under
the executor's three thread schedules) in a subprocess with the package's libq3simt.so (it
builds nothing for this), prints a table (kernel, cases, schedules, result) and ends with
exactly one line `simt: K kernels, C cases, M/M planted defects caught`.

With --mutants it then builds, for each defect planted in kernels/cuda/*.cu behind
Q3_MUTANT(n) (kernels/cuda/common.cuh), a variant of the executor compiled with
-DQ3_MUTANT_ID=n (setup.py's recipe, simt_recipe; only the files with the plant are compiled
again, the others' objects are the package build's, setup.py's SIMT_OBJECTS, or built once
there and reused), runs the kernel
check against it in a subprocess and decides whether the defect was caught: a case over its
tolerance (the twin), a case whose results differ across schedules (the race check), the
executor's error (a launch that fails, naming kernel, block and thread), or a sanitizer's
report (the shared-memory overflow needs the variant built with AddressSanitizer, run with
gcc's libasan preloaded as .ci/sanitize does). One row per defect: what was planted, where,
and what caught it. Each check is of every case, and the defect must show in the cases of its
own kernel's launchers alone (Mutant.launchers): a case of another kernel that fails or differs
across schedules fails the run too (the planted code is in one kernel; tests/executor/
test_simt_mutants.py runs the focused checks, of those launchers' cases only). Exit status 1
when a planted defect is not caught or shows elsewhere, or a real case fails.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.path.join(ROOT, "build", "simt-check")

# the kernels each case of csrc/check/kernel_check.c runs, by the start of its name (the first
# match wins; a template kernel's instances by name<argument>, where they run different code);
# a case that matches none is shown as a row of its own
CASE_KERNELS = [
    ("add + rmsnorm", ["add_rmsnorm_kernel"]),
    ("rmsnorm", ["rmsnorm_kernel"]),
    ("matmul tensor cores", ["matmul_tc_kernel"]),
    ("matmul WMMA only", ["matmul_tc_kernel"]),
    ("matmul cuBLAS", ["round_bf16_kernel", "cuBLAS"]),
    ("matmul GEMV 2 rows a warp", ["gemv_pairs_kernel"]),
    ("matmul ", ["gemv_kernel"]),
    ("gate + up", ["gate_up_kernel"]),
    ("qk_norm", ["qk_rope_kv_kernel"]),
    ("qk_rope_kv", ["qk_rope_kv_kernel"]),
    ("attention tensor cores", ["attention_tc_kernel"]),
    ("attention tc", ["attention_tc_kernel"]),
    ("attention split-KV", ["attention_kernel", "combine_kernel"]),
    ("attention probs", ["attention_probs_kernel"]),
    ("attention", ["attention_kernel"]),
    ("router", ["router_kernel"]),
    ("decode_prepare", ["decode_prepare_kernel"]),
    ("moe_route", ["moe_route_kernel"]),
    ("moe gate_up + down + combine", ["moe_gate_up_kernel<dense_rows>", "moe_down_kernel<dense_rows>",
                                      "moe_combine_kernel"]),
    ("moe prefill gate_up + down", ["moe_tiles_kernel"]),
    ("moe prefill combine_csr", ["moe_combine_csr_kernel"]),
    ("moe prefill tiles + combine_csr", ["moe_tiles_kernel", "moe_combine_csr_kernel"]),
    ("fp8 matmul GEMV", ["gemv_fp8_kernel"]),
    ("fp8 dequant", ["fp8_dequant_kernel"]),
    ("fp8 moe gate_up + down", ["moe_gate_up_kernel<fp8_rows>", "moe_down_kernel<fp8_rows>"]),
    ("int4 matmul GEMV", ["gemv_int4_kernel"]),
    ("int4 dequant", ["int4_dequant_kernel"]),
    ("int4 moe gate_up + down", ["moe_gate_up_int4_kernel", "moe_down_int4_kernel"]),
    ("swiglu", ["swiglu_kernel"]),
    ("gather + scatter_add", ["gather_kernel", "scatter_add_kernel"]),
    ("convert", ["from_f32_kernel", "to_f32_kernel"]),
    ("take + add rows", ["take_rows_kernel", "add_rows_kernel"]),
]

# what catches a defect: a case over its tolerance, a case whose results differ across the
# schedules, the executor's error (a launch that fails), a sanitizer's report
MECHANISMS = {"twin": "the twin", "race": "the race check", "executor": "the executor's error",
              "asan": "AddressSanitizer", "ubsan": "UBSan", "crash": "a crash"}


@dataclasses.dataclass(frozen=True)
class Mutant:
    """A defect planted behind Q3_MUTANT(id) in kernels/cuda/ (kernel: the function that
    has it), the mechanism expected to catch it (a key of MECHANISMS), and the launchers of
    the kernel check's cases that run the planted code (the harness's names, ops_cuda.h's):
    a full check of the variant must find the defect in their cases alone (every other case
    passes and agrees across schedules), and a focused one runs only their cases."""
    id: int
    what: str
    kernel: str
    expect: str
    launchers: tuple
    sanitized: bool = False  # caught only in the variant built with AddressSanitizer


MUTANTS = [
    Mutant(1, "__syncthreads removed: the K/V tile is read before every thread staged it", "attention_kernel",
           "race", ("attention",)),
    Mutant(2, "attention mask one key too far: n_keys = n_past + t + 2", "attention_kernel", "twin", ("attention",)),
    # its wrong offsets place pairs past the end of `rows`: in the plain executor the
    # overflow corrupts the heap (a crash, or allocator slack at small E); AddressSanitizer
    # names it
    Mutant(3, "wrong shuffle offset in a reduction: the warp scan's __shfl_up_sync by o + 1",
           "moe_route_kernel", "asan", ("moe_route",), sanitized=True),
    Mutant(4, "shared index one past its array: out[warp + 1] of float[4][16][16]", "matmul_tc_kernel", "asan",
           ("matmul_tc", "matmul_wmma"), sanitized=True),
    Mutant(5, "16-byte load at an odd offset: uint4 from the bf16 cache + 1 element", "attention_tc_kernel",
           "executor", ("attention",)),
    Mutant(6, "wrong lane mask: __match_any_sync(0x0000ffff) called by all 32 lanes", "moe_route_kernel",
           "executor", ("moe_route",)),
    Mutant(7, "__syncthreads inside a divergent branch (if (lane < nj), on a partial tile)", "attention_kernel",
           "executor", ("attention",)),
    Mutant(8, "cudaFuncSetAttribute skipped: head_dim 256 (66-98 KiB of shared memory) at the 48 KiB default",
           "q3_attention_cuda", "executor", ("attention",)),
    Mutant(9, "__syncwarp removed: RoPE reads a head dim another lane wrote", "qk_rope_kv_kernel", "race",
           ("qk_rope_kv",)),
    Mutant(10, "__syncthreads removed: the next k slice is staged over one other warps still read",
           "matmul_tc_kernel", "race", ("matmul_tc", "matmul_wmma")),
    Mutant(11, "FP8 block scale from the wrong column block: 16-byte chunk c's scale block c / 9, not c / 8",
           "gemv_fp8_kernel", "twin", ("matmul_fp8", "fp8_dequant", "moe_gate_up_fp8")),
    Mutant(12, "attention map from the wrong KV head: query head h reads h % Hkv, not h / G",
           "attention_probs_kernel", "twin", ("attention_probs",)),
    Mutant(13, "rows taken as H 16-bit units, not H x element size / 2: half of each fp32 row moved",
           "q3_take_rows_cuda", "twin", ("take_rows",)),
    Mutant(14, "GPTQ g_idx ignored in the dequantization: input k's group taken as k G / K, not g_idx[k]",
           "int4_dequant_kernel", "twin", ("int4_dequant",)),
    Mutant(15, "accumulate ignored: the int4 GEMV overwrites y instead of adding to it", "gemv_int4_kernel", "twin",
           ("matmul_int4",)),
    Mutant(16, "GPTQ zero from the wrong column: output n dequantized with the zero nibble of n ^ 1",
           "int4_dequant_kernel", "twin", ("int4_dequant",)),
    Mutant(17, "__syncthreads removed: the up tile's sums land in shared memory before all threads read the gate's",
           "moe_gate_up_int4_kernel", "race", ("moe_gate_up_int4",)),
    Mutant(18, "int4 down projection of the wrong expert: block column a reads expert a, not the a-th active one",
           "moe_down_int4_kernel", "twin", ("moe_down_int4",)),
    Mutant(19, "GPTQ groups of a K slice run together: the GEMV scales a slice by its first group's scale and zero",
           "gemv_int4_kernel", "twin", ("matmul_int4",)),
    Mutant(20, "hidden keys seen: a token mask's flags never read, every key of [first_key, i] attended",
           "attention_kernel", "twin", ("attention",)),
    Mutant(21, "a call's tree ignored: the query's row of its tree never read, every key of [first_key, i] seen",
           "attention_kernel", "twin", ("attention",)),
]

CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import qwen3layer as q3
q3.cuda.emulate(sys.argv[2] or None)
try:
    out = {"cases": q3.cuda.check_kernels(kernels=sys.argv[3].split(",") if sys.argv[3] else None)}
except RuntimeError as e:
    out = {"error": str(e)}
print("simt_check:" + json.dumps(out), flush=True)
"""


def _setup():
    """setup.py as a module (its setup() call runs only as __main__): the build's recipe."""
    spec = importlib.util.spec_from_file_location("q3_setup", os.path.join(ROOT, "setup.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _InRoot:
    """cwd = the checkout (setup.py's recipe has relative paths), and no preloaded sanitizer
    runtime for the compiler (under .ci/sanitize the tests run with libasan preloaded)."""

    def __enter__(self):
        self.cwd, self.preload = os.getcwd(), os.environ.pop("LD_PRELOAD", None)
        os.chdir(ROOT)

    def __exit__(self, *exc):
        os.chdir(self.cwd)
        if self.preload is not None:
            os.environ["LD_PRELOAD"] = self.preload


def plant_sites(mutant_id: int) -> list[str]:
    """'file:line' of each place in kernels/cuda/ where Q3_MUTANT(mutant_id) is written."""
    sites, folder = [], os.path.join(ROOT, "kernels", "cuda")
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if f"Q3_MUTANT({mutant_id})" in line:
                    sites.append(f"{name}:{number}")
    return sites


def asan_env() -> dict:
    """The environment of a run of a variant built with AddressSanitizer: gcc's libasan (and
    libstdc++, as .ci/sanitize) preloaded, every report fatal."""
    def gcc_file(name):
        return subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
    env = dict(os.environ)
    preload = f"{gcc_file('libasan.so')}:{gcc_file('libstdc++.so.6')}"
    env["LD_PRELOAD"] = preload + (":" + env["LD_PRELOAD"] if env.get("LD_PRELOAD") else "")
    env["ASAN_OPTIONS"] = "detect_leaks=0:halt_on_error=1:abort_on_error=1:allocator_may_return_null=1:symbolize=1"
    env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1:abort_on_error=1"
    return env


def build_variant(mutant_id: Optional[int], sanitized: bool = False, quiet: bool = True) -> str:
    """Builds libq3simt.so with defect mutant_id planted (None: none) in build/simt-check/
    <plain|asan>/ and returns its path. The objects without the defect are built once per
    flavour and reused; the files that hold Q3_MUTANT(mutant_id) are compiled again with
    -DQ3_MUTANT_ID (all of them where a header holds it). The AddressSanitizer flavour
    instruments the executor's runtime (kernels/simt/*.cpp: its fiber switches must tell the
    sanitizer) and the planted files; the other kernels are the plain flavour's objects, as a
    sanitizer's report there would be another kernel's, not the defect's (and the sanitized
    suite, .ci/sanitize, checks every kernel instrumented)."""
    s = _setup()
    flavour = "asan" if sanitized else "plain"
    with _InRoot():
        include = s.find_cuda_headers()
        if include is None:
            raise RuntimeError("simt_check: the CUDA toolkit's headers (cuda_runtime.h, cuda_bf16.h) were not found")
        cxx, flags, link, sources, headers = s.simt_recipe(include, s.sanitize_flags("address,undefined")
                                                           if sanitized else [])
        saved = sys.stdout
        try:
            if quiet:
                sys.stdout = open(os.devnull, "w")
            if sanitized:
                _, plain_flags, _, _, _ = s.simt_recipe(include, [])
                objects = s.compile_objects(cxx, plain_flags, sources, headers, os.path.join(ROOT, s.SIMT_OBJECTS))
                runtime = [src for src in sources if src.startswith("kernels/simt/")]
                instrumented = s.compile_objects(cxx, flags, runtime, headers, os.path.join(BUILD, flavour, "base"))
                replace = dict(zip(runtime, instrumented))
                objects = [replace.get(src, obj) for src, obj in zip(sources, objects)]
            else:  # the package build's own objects where it made them (setup.py's SIMT_OBJECTS)
                objects = s.compile_objects(cxx, flags, sources, headers, os.path.join(ROOT, s.SIMT_OBJECTS))
            name = "libq3simt.so"
            if mutant_id is not None:
                planted = [src for src in sources + headers if f"Q3_MUTANT({mutant_id})" in open(src).read()]
                if not planted:
                    raise RuntimeError(f"simt_check: Q3_MUTANT({mutant_id}) is planted nowhere in kernels/")
                again = sources if any(p in headers for p in planted) else planted
                mutated = s.compile_objects(cxx, flags + [f"-DQ3_MUTANT_ID={mutant_id}"], again, headers,
                                            os.path.join(BUILD, flavour, f"mutant-{mutant_id}"))
                replace = dict(zip(again, mutated))
                objects = [replace.get(src, obj) for src, obj in zip(sources, objects)]
                name = f"libq3simt-mutant-{mutant_id}.so"
            if sanitized:  # the instrumented objects first: the linker keeps their copies of inline functions
                plain_dir = os.path.join(ROOT, s.SIMT_OBJECTS) + os.sep
                objects.sort(key=lambda obj: obj.startswith(plain_dir))
            target = os.path.join(BUILD, flavour, name)
            s.link_library(cxx, objects, link, target)
        finally:
            if quiet:
                sys.stdout.close()
                sys.stdout = saved
    return target


def run_check(library: Optional[str], sanitized: bool = False, timeout: float = 900,
              kernels: Optional[tuple] = None) -> dict:
    """q3.cuda.check_kernels() on the executor `library` (None: the package's) in a fresh
    process, the cases of the launchers `kernels` alone where given: {'cases': [...]} or
    {'error': the executor's message}, with 'returncode', 'stderr' and 'seconds'."""
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", CHILD, ROOT, library or "", ",".join(kernels or ())],
                       capture_output=True, text=True,
                       timeout=timeout, env=asan_env() if sanitized else None, cwd=ROOT)
    out = {}
    for line in r.stdout.splitlines():
        if line.startswith("simt_check:"):
            out = json.loads(line[len("simt_check:"):])
    out.update(returncode=r.returncode, stderr=r.stderr, seconds=time.monotonic() - t0)
    return out


def _shorten(text: str, n: int = 240) -> str:
    return text if len(text) <= n else text[:n - 3] + "..."


def verdict(run: dict) -> dict:
    """What reported a defect in a run: {mechanism: a line on what it said} (empty: nothing)."""
    found = {}
    stderr = run.get("stderr", "")
    aborted = re.search(r"simt: aborted in (.*)", stderr)
    where = f"; aborted in {aborted.group(1)}" if aborted else ""
    asan = re.search(r"ERROR: AddressSanitizer: (\S+)", stderr)
    if asan:  # what, where in a kernel's source, and against which block of memory
        frame = re.search(r"#\d+ 0x[0-9a-f]+ in (\w+)\(.*? (kernels/cuda/\S+:\d+)", stderr)
        region = re.search(r"is located (.*? region)", stderr)
        found["asan"] = (asan.group(1) + (f" in {frame.group(1)} at {frame.group(2)}" if frame else "")
                         + (f", {region.group(1)}" if region else "") + where)
    ubsan = re.search(r"runtime error: (.*)", stderr)
    if ubsan:
        found["ubsan"] = _shorten(ubsan.group(0)) + where
    if run.get("returncode") and not found:
        found["crash"] = f"exit status {run['returncode']}{where}: " + _shorten(" | ".join(stderr.strip().splitlines()[-3:]))
    if "error" in run:
        found["executor"] = _shorten(run["error"])
    cases = run.get("cases", [])
    over = [c for c in cases if not c["max_err"] <= c["tol"]]
    racy = [c for c in cases if not c["agree"]]
    if over:
        found["twin"] = (f"{len(over)} case(s) over tolerance, e.g. {over[0]['case']}: "
                         f"err {over[0]['max_err']:.3g} > tol {over[0]['tol']:g}")
    if racy:
        found["race"] = f"{len(racy)} case(s) differ across schedules, e.g. {racy[0]['case']}"
    return found


def kernel_files() -> dict:
    """{kernel function: its file} of every __global__ function in kernels/cuda/*.cu."""
    found = {}
    folder = os.path.join(ROOT, "kernels", "cuda")
    for name in sorted(os.listdir(folder)):
        if name.endswith(".cu"):
            text = open(os.path.join(folder, name), encoding="utf-8").read()
            for m in re.finditer(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\s*\(", text):
                found[m.group(1)] = name
    return found


def kernel_rows(cases: list[dict]) -> list[dict]:
    """The table's rows: per kernel, its cases, schedules and result (ok, or the failures)."""
    rows = {}
    for c in cases:
        kernels = next((k for prefix, k in CASE_KERNELS if c["case"].startswith(prefix)), [f"? ({c['case']})"])
        for k in kernels:
            rows.setdefault(k, []).append(c)
    files = kernel_files()
    table = []
    for kernel, group in rows.items():
        bad = [c for c in group if not c["ok"]]
        worst = max((c["max_err"] / c["tol"] if c["tol"] else (0.0 if c["max_err"] == 0 else float("inf")))
                    for c in group)
        result = (f"ok (worst err/tol {worst:.2g})" if not bad else "FAILED: " + "; ".join(
            f"{c['case']}: err {c['max_err']:.3g} tol {c['tol']:g} agree {c['agree']}" for c in bad))
        file = files.get(kernel.split("<")[0], "cuBLAS" if kernel == "cuBLAS" else "?")  # an instance: its template's
        table.append({"kernel": kernel, "file": file,
                      "cases": len(group), "schedules": sorted({c["schedules"] for c in group}), "ok": not bad,
                      "result": result})
    return table


def print_kernel_table(table: list[dict], covered_from: dict) -> None:
    """The rows of kernel_rows, then the __global__ functions no case runs."""
    print(f"{'kernel':<30} {'file':<17} {'cases':>5} {'schedules':>9}  result")
    for r in table:
        schedules = ",".join(map(str, r["schedules"]))
        print(f"{r['kernel']:<30} {r['file']:<17} {r['cases']:>5} {schedules:>9}  {r['result']}")
    missing = sorted(set(covered_from) - {r["kernel"].split("<")[0] for r in table})
    if missing:
        print("not run by any case: " + ", ".join(f"{k} ({covered_from[k]})" for k in missing))


def elsewhere(m: Mutant, run: dict) -> list:
    """The cases of a full run of m's variant that do not run its launchers (m.launchers) and
    still fail or differ across schedules: a defect must show in its own kernel's cases alone."""
    return [c for c in run.get("cases", [])
            if not set(c["kernel"].split("+")) & set(m.launchers) and not (c["ok"] and c["agree"])]


def check_mutants(mutants: list, jobs: int = 1):
    """Builds each mutant's variant (one at a time: the build works in the checkout), then runs
    the kernel check on the variants, `jobs` at a time (each in a process of its own); yields,
    for each mutant in order as soon as its check is done, {'sites', 'found' (verdict),
    'caught', 'elsewhere' (cases of other kernels that fail), 'build_s', 'run_s', 'run'}."""
    built = []
    for m in mutants:
        t0 = time.monotonic()
        built.append((m, build_variant(m.id, sanitized=m.sanitized), time.monotonic() - t0))
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        runs = pool.map(lambda b: run_check(b[1], sanitized=b[0].sanitized), built)
        for (m, _, build_s), run in zip(built, runs):
            found = verdict(run)
            yield {"sites": plant_sites(m.id), "found": found, "caught": bool(found), "elsewhere": elsewhere(m, run),
                   "build_s": build_s, "run_s": run["seconds"], "run": run}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mutants", action="store_true", help="also build and check every planted defect")
    parser.add_argument("--only", type=lambda s: [int(x) for x in s.split(",")], default=None,
                        help="with --mutants: these defects only (ids, comma-separated)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="with --mutants: kernel checks run at once, one process each (default: the cores)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs: expected at least 1, got {args.jobs}")
    t0 = time.monotonic()

    real = run_check(None)
    cases = real.get("cases", [])
    if "error" in real or real["returncode"]:
        print(f"simt_check: the kernel check failed: {real.get('error') or real['stderr'][-2000:]}")
    table = kernel_rows(cases)
    print_kernel_table(table, kernel_files())
    failed = bool(real.get("error") or real["returncode"] or not all(c["ok"] for c in cases))
    print(f"real kernels: {len(cases)} cases in {real['seconds']:.1f} s")

    caught = ran = misplaced = 0
    if args.mutants:
        mutants = [m for m in MUTANTS if args.only is None or m.id in args.only]
        print()
        print(f"{'#':>2}  {'where':<21} {'kernel':<22} {'planted defect':<82} caught by")
        build_s = run_s = 0.0
        for m, r in zip(mutants, check_mutants(mutants, args.jobs)):
            ran += 1
            caught += r["caught"]
            build_s += r["build_s"]
            run_s += r["run_s"]
            where = ", ".join(r["sites"]) or "(not planted)"
            what = m.what + (" (ASan build)" if m.sanitized else "")
            by = "; ".join(f"{MECHANISMS[k]}: {v}" for k, v in r["found"].items()) or "NOT CAUGHT"
            if r["found"] and m.expect not in r["found"]:
                by += f" (expected: {MECHANISMS[m.expect]})"
            if r["elsewhere"]:
                misplaced += 1
                by += (f"; BUT ALSO in {len(r['elsewhere'])} case(s) of other kernels, e.g. "
                       f"{r['elsewhere'][0]['case']} ({r['elsewhere'][0]['kernel']})")
            print(f"{m.id:>2}  {where:<21} {m.kernel:<22} {what:<82} {by}", flush=True)
        print(f"planted defects: {ran} variants built in {build_s:.1f} s, checked in {run_s:.1f} s "
              f"(process seconds, {args.jobs} at a time)")
    print(f"total {time.monotonic() - t0:.1f} s")
    print(f"simt: {len(table)} kernels, {len(cases)} cases, {caught}/{ran} planted defects caught")
    if misplaced:
        print(f"simt_check: {misplaced} planted defect(s) also failed cases of kernels they are not in")
    return 1 if failed or caught < ran or misplaced else 0


if __name__ == "__main__":
    sys.exit(main())
