"""Static evidence of the decode kernels' speed, from the compiled SASS (no GPU needed).

    python benchmarks/sass_check.py                  the decode kernels of qwen3layer/libq3cuda.so
    python benchmarks/sass_check.py --arch sm_90     one architecture only (default: every SASS in it)
    python benchmarks/sass_check.py --library X.o --kernel NAME:BLOCK[:SMEM][:wide] ...   any binary

Reads the machine code of each kernel in DECODE_KERNELS for each architecture the library
holds (cuobjdump -sass and -res-usage; cuobjdump comes with the CUDA toolkit or the
nvidia-cuda-cuobjdump wheel, which the test extras install) and checks three things:

  wide loads  a kernel that streams weights (or another large operand) has 16-byte global
              loads (LDG.E.128, or wider) inside a loop of its code: a loop being the
              instructions between a backward branch and its target;
  local       it uses no local memory: no LDL/STL instruction and no stack frame (what
              -res-usage calls STACK and LOCAL), wherever in the kernel; local memory is the
              slow path of a register array indexed at run time or of spilled registers;
  occupancy   its registers, and its shared memory (static, plus the dynamic bytes its
              launch asks for at the real geometry, plus the 1 KiB the hardware reserves per
              block), allow at least 2 blocks of its launch's size on one SM: 65536 registers
              allocated per warp in units of 256 over 4 sub-partitions; 164 KiB of shared
              memory on sm_80, 228 KiB on sm_90 and sm_100, 100 KiB on sm_120. The blocks/SM
              column also counts the SM's thread and block limits (it names what binds), but
              the verdict is on registers and shared memory, as the requirement has it.

One line per kernel and architecture (name, arch, registers, blocks/SM, 16-byte loads in
loops, narrower global loads in loops, local memory, verdict), then a summary; exit status
1 when any check fails (or a kernel of the table is missing from the library: the table
names each kernel as it is compiled), 2 when the binary or cuobjdump is not there.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBRARY = os.path.join(ROOT, "qwen3layer", "libq3cuda.so")


@dataclasses.dataclass
class Expect:
    """What a kernel must show: its launch's block size and dynamic shared memory (bytes, at
    the real geometry: head_dim 128, 16 query heads per KV head, 128 experts) and whether it
    streams a large operand with 16-byte loads."""
    name: str
    source: str
    block: int
    dynamic_smem: int = 0
    wide_loads: bool = False


# The kernels a decode step runs (csrc/cuda/passes.c, decode_graph.c), as their launchers
# launch them. wide_loads: the kernels that stream weights (row_dots.cuh's 16-byte weight
# loads). attention_kernel streams the KV cache through shared memory tiles; the issue's
# requirement for it is a conflict-free tile with q and the accumulator in registers, so its
# tile loads are reported (narrower loads column) but not required to be 16 bytes wide.
DECODE_KERNELS = [
    Expect("rmsnorm_kernel", "rmsnorm.cu", 512),                   # threads_for(4096): RMSNORM_THREADS
    Expect("add_rmsnorm_kernel", "rmsnorm.cu", 512),
    Expect("gemv_kernel", "matmul.cu", 256, wide_loads=True),      # 8 warps, a weight row each
    Expect("gemv_pairs_kernel", "matmul.cu", 256, wide_loads=True),  # 8 warps, two rows each
    Expect("gate_up_kernel", "matmul.cu", 256, wide_loads=True),
    Expect("qk_rope_kv_kernel", "qk_rope_kv.cu", 256),             # WARPS 8
    Expect("attention_kernel", "attention.cu", 512, 2 * 32 * 128 * 4),  # G * 32; 2 KEY_TILE x D fp32
    Expect("combine_kernel", "attention.cu", 256),
    # a step asking for the attention maps (return_attention) also runs this one: key rows read
    # a dim a lane (coalesced 2- or 4-byte loads), so 16-byte loads are not required of it
    Expect("attention_probs_kernel", "attention_probs.cu", 256),  # PROBS_THREADS
    Expect("router_kernel", "router.cu", 128),
    Expect("moe_route_kernel", "moe_grouped.cu", 256, 128 * 4),    # ROUTE_THREADS; an int32 per expert
    # the expert kernels: one template each, an instance per weight-row reader (<dense_rows>:
    # bf16 rows; <fp8_rows>: fp8.cuh's fp8_row_dots, 16-byte loads of 16 e4m3)
    Expect("moe_gate_up_kernel", "moe_grouped.cu", 256, wide_loads=True),  # GROUP_WARPS 8
    Expect("moe_down_kernel", "moe_grouped.cu", 256, wide_loads=True),
    Expect("moe_combine_kernel", "moe_grouped.cu", 256),           # COMBINE_THREADS
    # FP8 weights (fp8.cuh's fp8_row_dots: 16-byte loads of 16 e4m3)
    Expect("gemv_fp8_kernel", "matmul_fp8.cu", 256, wide_loads=True),  # FP8_GEMV_WARPS 8
    # GPTQ int4 weights (int4.cuh's tile: 16-byte loads of 4 words, 32 nibbles, a lane)
    Expect("gemv_int4_kernel", "matmul_int4.cu", 256, wide_loads=True),  # INT4_THREADS
    Expect("moe_gate_up_int4_kernel", "moe_grouped.cu", 256, wide_loads=True),
    Expect("moe_down_int4_kernel", "moe_grouped.cu", 256, wide_loads=True),
    # a step of a layer split over the GPU and the host (qwen3layer/placement/hybrid.py): the
    # rows with a host expert taken out, the host's sums added back; a block a row
    Expect("take_rows_kernel", "elementwise.cu", 256),
    Expect("add_rows_kernel", "elementwise.cu", 256),
]

# per SM: (shared memory bytes, max threads, max blocks); all have 65536 registers. The shared
# memory and block limits as the toolkit's own occupancy calculator has them (cuda_occupancy.h of
# CUDA 13.0: cudaOccMaxBlocksPerMultiprocessor, the shared memory configurations per major).
# Threads are not in it: sm_110's 1536 is read off the rule every SM of 24 blocks keeps (sm_89,
# sm_101, sm_12x: 48 warps); the verdict is on registers and shared memory, not threads.
ARCH = {80: (164 * 1024, 2048, 32), 86: (100 * 1024, 1536, 16), 87: (164 * 1024, 1536, 16),
        89: (100 * 1024, 1536, 24), 90: (228 * 1024, 2048, 32), 100: (228 * 1024, 2048, 32),
        103: (228 * 1024, 2048, 32), 110: (228 * 1024, 1536, 24), 120: (100 * 1024, 1536, 24),
        121: (100 * 1024, 1536, 24)}
REGISTERS, REG_UNIT, SUB_PARTITIONS, SMEM_RESERVED = 65536, 256, 4, 1024

INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
BRANCH = re.compile(r"\bBRA(?:\.[A-Z0-9]+)*\s+(?:!?U?P[T0-9]+,\s*)?0x([0-9a-f]+)")
GLOBAL_LOAD = re.compile(r"\bLDG\.E((?:\.[A-Z0-9_]+)*)")
LOCAL = re.compile(r"\b(LDL|STL)(?:\.[A-Z0-9]+)*\b")
RES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def find_cuobjdump() -> Optional[str]:
    """$CUOBJDUMP, then PATH, the nvidia-cuda-cuobjdump wheel (nvidia/<cu*>/bin), the toolkit."""
    found = [os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump")]
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        found += sorted(glob.glob(os.path.join(root, "*", "bin", "cuobjdump")))
    found += [os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "cuobjdump")]
    return next((f for f in found if f and os.access(f, os.X_OK)), None)


def tool_env(tool: str) -> dict:
    """The environment to run cuobjdump in: its own folder first on PATH, since its -sass runs
    nvdisasm (from 13.5 on), which the wheels put beside it (nvidia-cuda-nvdisasm)."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # not a Python tool (.ci/sanitize)
    env["PATH"] = os.pathsep.join([os.path.dirname(os.path.abspath(tool)), env.get("PATH", "")])
    return env


def run_tool(tool: str, *args: str) -> str:
    """cuobjdump's standard output; a failure raises ToolError with its own message."""
    r = subprocess.run([tool, *args], capture_output=True, text=True, env=tool_env(tool))
    if r.returncode:
        raise ToolError(f"{os.path.basename(tool)} {' '.join(args[:-1])}: exit {r.returncode}: "
                        f"{r.stderr.strip() or r.stdout.strip()[-400:]}")
    return r.stdout


class ToolError(RuntimeError):
    pass


def base_name(mangled: str) -> str:
    """gemv_kernel of _Z11gemv_kernelPf... (the name as written in the source)."""
    m = re.match(r"_Z(\d+)", mangled)
    return mangled[m.end():m.end() + int(m.group(1))] if m else mangled


@dataclasses.dataclass
class Function:
    regs: int = 0
    stack: int = 0
    shared: int = 0
    local: int = 0
    code: List[tuple] = dataclasses.field(default_factory=list)  # (address, instruction)


def sass_archs(tool: str, binary: str) -> List[int]:
    out = run_tool(tool, "--list-elf", binary)
    return sorted({int(a) for a in re.findall(r"\.sm_(\d+)\.cubin", out)})


TEMPLATE_ARG = re.compile(r"Li(-?\d+)E|(\d+)")  # an int argument, or a class's name (its length first)


def instance_name(mangled: str) -> str:
    """gemv_kernel<16> of _Z11gemv_kernelILi16EEv... and moe_gate_up_kernel<fp8_rows> of
    _Z18moe_gate_up_kernelI8fp8_rowsEv... (a template's integer and class arguments), else the
    base name: each instance of a template is its own function, with its own registers."""
    m = re.match(r"_Z(\d+)", mangled)
    if not m:
        return mangled
    rest, args = mangled[m.end() + int(m.group(1)):], []
    if not rest.startswith("I"):
        return base_name(mangled)
    at = 1
    while at < len(rest) and rest[at] != "E":
        a = TEMPLATE_ARG.match(rest, at)
        if not a:  # an argument of another kind: the base name, as before
            return base_name(mangled)
        if a.group(1) is not None:
            args.append(a.group(1))
            at = a.end()
        else:
            args.append(rest[a.end():a.end() + int(a.group(2))])
            at = a.end() + int(a.group(2))
    return base_name(mangled) + f"<{','.join(args)}>"


def read_functions(tool: str, binary: str, arch: int, names) -> Dict[str, Function]:
    """The kernels `names` (as in the source) of `binary` compiled for sm_<arch>, each template
    instance apart (keyed by instance_name): their resources and their instructions (only theirs
    disassembled: -fun, by the mangled names)."""
    funcs: Dict[str, Function] = {}
    mangled = []
    res = run_tool(tool, "-res-usage", "-arch", f"sm_{arch}", binary)
    for name, usage in re.findall(r"Function (\S+):\s*\n\s*(REG:.*)", res):
        if base_name(name) in names:
            funcs[instance_name(name)] = Function(*map(int, RES.search(usage).groups()))
            mangled.append(name)
    if not mangled:
        return funcs
    sass = run_tool(tool, "-sass", "-arch", f"sm_{arch}", "-fun", ",".join(mangled), binary)
    current = None
    for line in sass.splitlines():
        head = re.search(r"Function : (\S+)", line)
        if head:
            current = funcs.get(instance_name(head.group(1)))
        elif current is not None:
            m = INSTR.search(line)
            if m:
                current.code.append((int(m.group(1), 16), m.group(2)))
    return funcs


def loop_ranges(code: List[tuple]) -> List[tuple]:
    """(first, last) addresses of each loop: a branch back to an address at or before it."""
    ranges = []
    for addr, ins in code:
        m = BRANCH.search(ins)
        if m and int(m.group(1), 16) <= addr:
            ranges.append((int(m.group(1), 16), addr))
    return ranges


def blocks_per_sm(f: Function, e: Expect, arch: int) -> tuple:
    """(blocks by registers, by shared memory, by threads and the block limit)."""
    smem_sm, threads_sm, blocks_sm = ARCH.get(arch, ARCH[max(a for a in ARCH if a <= arch)])
    warps = (e.block + 31) // 32
    per_warp = -(-max(f.regs, 1) * 32 // REG_UNIT) * REG_UNIT
    by_regs = (REGISTERS // SUB_PARTITIONS // per_warp) * SUB_PARTITIONS // warps
    smem = f.shared + e.dynamic_smem + SMEM_RESERVED
    by_smem = smem_sm // smem
    return by_regs, by_smem, min(threads_sm // e.block, blocks_sm)


def check(f: Optional[Function], e: Expect, arch: int, label: str = "") -> tuple:
    """(the printed row, the reasons it fails: [] when it passes) for the function f of e
    (label: its instance's name, where e is a template)."""
    if f is None:
        return [e.name, f"sm_{arch}", "-", "-", "-", "-", "-", "FAIL: not in the binary"], ["missing"]
    loops = loop_ranges(f.code)
    in_loop = [ins for addr, ins in f.code if any(a <= addr <= b for a, b in loops)]
    loads = [GLOBAL_LOAD.search(ins) for ins in in_loop]
    wide = sum(1 for m in loads if m and re.search(r"\.(128|256)\b", m.group(1)))
    narrow = sum(1 for m in loads if m) - wide
    local_ins = [ins for _, ins in f.code if LOCAL.search(ins)]
    by_regs, by_smem, by_threads = blocks_per_sm(f, e, arch)
    blocks = min(by_regs, by_smem, by_threads)
    binds = [n for n, v in (("regs", by_regs), ("smem", by_smem), ("threads", by_threads)) if v == blocks]
    fails = []
    if e.wide_loads and wide == 0:
        fails.append("no 16-byte global load in a loop")
    if local_ins or f.stack or f.local:
        fails.append(f"local memory ({len(local_ins)} LDL/STL, stack {f.stack} B)")
    if by_regs < 2:
        fails.append(f"{f.regs} registers x {e.block} threads: {by_regs} block/SM")
    if by_smem < 2:
        fails.append(f"{f.shared + e.dynamic_smem} B shared: {by_smem} block/SM")
    local = f"{len(local_ins)} LDL/STL, stack {f.stack}" if local_ins or f.stack or f.local else "none"
    row = [label or e.name, f"sm_{arch}", str(f.regs), f"{blocks} ({'/'.join(binds)})",
           f"{wide}" + ("" if e.wide_loads else " (not required)"), str(narrow), local,
           "ok" if not fails else "FAIL: " + "; ".join(fails)]
    return row, fails


def parse_kernel(spec: str) -> Expect:
    """NAME:BLOCK[:SMEM][:wide] for --kernel."""
    parts = spec.split(":")
    wide = parts[-1] == "wide"
    if wide:
        parts = parts[:-1]
    if len(parts) not in (2, 3):
        raise argparse.ArgumentTypeError(f"--kernel: expected NAME:BLOCK[:SMEM][:wide], got {spec!r}")
    return Expect(parts[0], "", int(parts[1]), int(parts[2]) if len(parts) == 3 else 0, wide)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--library", default=LIBRARY, help="a library, object or cubin (default: libq3cuda.so)")
    parser.add_argument("--arch", action="append", help="sm_NN to check (repeatable; default: every SASS in it)")
    parser.add_argument("--kernel", action="append", type=parse_kernel,
                        help="NAME:BLOCK[:SMEM][:wide] instead of the decode kernels' table (repeatable)")
    args = parser.parse_args(argv)
    tool = find_cuobjdump()
    if tool is None:
        print("sass_check: cuobjdump not found (pip install nvidia-cuda-cuobjdump, or the CUDA toolkit's)",
              file=sys.stderr)
        return 2
    if not os.path.exists(args.library):
        print(f"sass_check: {args.library} not found (built where nvcc is: python setup.py build_ext --inplace)",
              file=sys.stderr)
        return 2
    archs = [int(a.split("_")[-1]) for a in args.arch] if args.arch else sass_archs(tool, args.library)
    if not archs:
        print(f"sass_check: {args.library} holds no SASS", file=sys.stderr)
        return 2
    kernels = args.kernel or DECODE_KERNELS
    head = ["kernel", "arch", "regs", "blocks/SM", "16-byte loads in loops", "narrower loads in loops",
            "local memory", "verdict"]
    rows, failed = [], {}
    for arch in archs:
        funcs = read_functions(tool, args.library, arch, {e.name for e in kernels})
        for e in kernels:
            instances = sorted((k for k in funcs if k == e.name or k.startswith(e.name + "<")),
                               key=lambda k: ([int(v) for v in re.findall(r"<(-?\d+)[,>]", k[len(e.name):])], k))
            for label in instances or [e.name]:
                row, fails = check(funcs.get(label), e, arch, label)
                rows.append(row)
                if fails:
                    failed.setdefault(label, []).append(f"sm_{arch}")
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head) - 1)]
    for r in [head] + rows:
        print(" | ".join(v.ljust(w) for v, w in zip(r, widths)) + " | " + r[-1])
    print(f"sass: {len(kernels)} kernels ({len(rows) // len(archs)} functions) x {len(archs)} architectures ({os.path.basename(args.library)}), "
          f"{len(failed)} failed" + (": " + ", ".join(f"{k} ({' '.join(a)})" for k, a in failed.items())
                                     if failed else ""))
    return 1 if failed else 0


def run(argv=None) -> int:
    """main, with a cuobjdump that cannot read the library (or cannot disassemble: nvdisasm
    missing) reported as such: exit 2, as for a missing tool, never as a kernel verdict."""
    try:
        return main(argv)
    except ToolError as e:
        print(f"sass_check: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(run())
