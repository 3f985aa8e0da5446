"""benchmarks/sass_check.py, the static check of the decode kernels' machine code: it must
fail on kernels planted with each defect it looks for (a run-time indexed register array in
local memory, 4-byte loads where 16-byte ones are expected, a 16-byte load outside the loop
only, registers or shared memory that leave one block per SM), pass their repaired twins, and
read the real library: every decode kernel on every architecture the build compiled (the
fatbinary holds exactly the targets build_info reports). Needs nvcc and cuobjdump (the test
extras install the nvidia-cuda-cuobjdump wheel); the CI step runs the check itself on the
library, where it must pass."""
import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest

import qwen3layer as q3

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
SCRIPT = os.path.join(ROOT, "benchmarks", "sass_check.py")
spec = importlib.util.spec_from_file_location("sass_check", SCRIPT)
sass_check = importlib.util.module_from_spec(spec)
sys.modules["sass_check"] = sass_check  # its dataclasses look their module up
spec.loader.exec_module(sass_check)

NVCC = shutil.which("nvcc") or (os.path.exists("/usr/local/cuda/bin/nvcc") and "/usr/local/cuda/bin/nvcc")
CUOBJDUMP = sass_check.find_cuobjdump()
pytestmark = pytest.mark.skipif(not (NVCC and CUOBJDUMP), reason="needs nvcc and cuobjdump (pip install "
                                "nvidia-cuda-cuobjdump; the test extras do)")

PLANTED = r"""
// a register array indexed at run time lives in local memory; the weights come 4 bytes a load
__global__ void bad_stream_kernel(float *y, const float *w, const int *idx, int n) {
    float acc[16];
    for (int i = 0; i < 16; i++) acc[i] = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) acc[idx[i] & 15] += w[i];
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += acc[i];
    y[threadIdx.x] = s;
}
// the repair: 16-byte loads in the loop, one accumulator in a register
__global__ void good_stream_kernel(float *y, const float4 *w, int n4) {
    float s = 0.0f;
    for (int i = threadIdx.x; i < n4; i += blockDim.x) {
        const float4 v = w[i];
        s += v.x + v.y + v.z + v.w;
    }
    y[threadIdx.x] = s;
}
// a 16-byte load before the loop, 4-byte loads in it: the loop is what must stream wide
__global__ void wide_outside_kernel(float *y, const float4 *head, const float *w, int n) {
    const float4 h = head[threadIdx.x];
    float s = h.x + h.y + h.z + h.w;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += w[i];
    y[threadIdx.x] = s;
}
// 48 live accumulators: 64 registers, so one block of 1024 threads per SM (four of 256)
__global__ void greedy_kernel(float *y, const float4 *w, int n4) {
    float a[48];
#pragma unroll
    for (int j = 0; j < 48; j++) a[j] = 0.0f;
    for (int i = threadIdx.x; i < n4; i += blockDim.x) {
        const float4 v = w[i];
#pragma unroll
        for (int j = 0; j < 48; j++) a[j] = a[j] * v.x + v.y * (float)j + v.z;
    }
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < 48; j++) s += a[j] * a[j];
    y[threadIdx.x] = s;
}
// a template whose instances differ: N = 4 keeps its array in registers, N = 64 indexes it at
// run time (local memory); each instance is its own function and is checked apart
template <int N>
__global__ void instances_kernel(float *y, const float4 *w, const int *idx, int n4) {
    float a[N];
#pragma unroll
    for (int j = 0; j < N; j++) a[j] = 0.0f;
    for (int i = threadIdx.x; i < n4; i += blockDim.x) {
        const float4 v = w[i];
        if (N > 8) a[idx[i] % N] += v.x + v.y + v.z + v.w;
        else {
#pragma unroll
            for (int j = 0; j < N; j++) a[j] += v.x * (float)j + v.y * v.z - v.w;
        }
    }
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < N; j++) s += a[j];
    y[threadIdx.x] = s;
}
template __global__ void instances_kernel<4>(float *, const float4 *, const int *, int);
template __global__ void instances_kernel<64>(float *, const float4 *, const int *, int);
"""


def run(*args):
    r = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=600)
    rows = {}
    for line in r.stdout.splitlines()[1:-1]:
        cells = [c.strip() for c in line.split(" | ")]
        rows[(cells[0], cells[1], len([k for k in rows if k[:2] == (cells[0], cells[1])]))] = cells
    return r, rows


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("planted")
    src, cubin = folder / "planted.cu", folder / "planted.cubin"
    src.write_text(PLANTED)
    # nvcc is not Python: under .ci/sanitize the suite runs with the ASan runtime in LD_PRELOAD,
    # which nvcc's own processes must not get (it crashed with status 139 there)
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    subprocess.run([NVCC, "-cubin", "-arch", "sm_90", "-O3", str(src), "-o", str(cubin)], check=True, env=env)
    return str(cubin)


def test_each_planted_defect_fails_the_check_and_its_repair_passes(planted):
    r, rows = run("--library", planted, "--kernel", "bad_stream_kernel:256:wide",
                  "--kernel", "good_stream_kernel:256:wide", "--kernel", "wide_outside_kernel:256:wide",
                  "--kernel", "greedy_kernel:1024", "--kernel", "greedy_kernel:256",
                  "--kernel", "good_stream_kernel:256:120000")
    assert r.returncode == 1, r.stdout + r.stderr
    bad = rows[("bad_stream_kernel", "sm_90", 0)]
    assert "FAIL" in bad[-1] and "local memory" in bad[-1] and "no 16-byte global load in a loop" in bad[-1]
    assert bad[4] == "0" and int(bad[5]) >= 1 and "LDL/STL" in bad[6]
    good = rows[("good_stream_kernel", "sm_90", 0)]
    assert good[-1] == "ok" and int(good[4]) >= 1 and good[6] == "none"
    outside = rows[("wide_outside_kernel", "sm_90", 0)]
    assert outside[-1] == "FAIL: no 16-byte global load in a loop"
    greedy_1024, greedy_256 = rows[("greedy_kernel", "sm_90", 0)], rows[("greedy_kernel", "sm_90", 1)]
    regs = int(greedy_1024[2])
    assert regs > 32  # 32 registers is the most that lets two blocks of 1024 threads share 65536
    assert greedy_1024[3].startswith("1 ") and "registers x 1024 threads: 1 block/SM" in greedy_1024[-1]
    assert greedy_256[-1] == "ok" and int(greedy_256[3].split()[0]) >= 2
    big_smem = rows[("good_stream_kernel", "sm_90", 1)]
    assert big_smem[3] == "1 (smem)" and big_smem[-1] == "FAIL: 120000 B shared: 1 block/SM"  # 228 KiB per SM
    assert r.stdout.splitlines()[-1].startswith("sass: 6 kernels (6 functions) x 1 architectures (planted.cubin), "
                                                "4 failed")


def test_each_instance_of_a_template_kernel_is_checked_apart(planted):
    """gemv_kernel<8> and <16> are two functions with their own registers: one that spills
    must fail under its own name, not be hidden (or blamed) by its sibling."""
    r, rows = run("--library", planted, "--kernel", "instances_kernel:256:wide")
    assert r.returncode == 1, r.stdout + r.stderr
    assert rows[("instances_kernel<4>", "sm_90", 0)][-1] == "ok"
    assert "local memory" in rows[("instances_kernel<64>", "sm_90", 0)][-1]
    assert r.stdout.splitlines()[-1].startswith("sass: 1 kernels (2 functions) x 1 architectures (planted.cubin), "
                                                "1 failed: instances_kernel<64> (sm_90)")


def test_a_kernel_missing_from_the_binary_fails(planted):
    r, rows = run("--library", planted, "--kernel", "gemv_kernel:256:wide")
    assert r.returncode == 1 and rows[("gemv_kernel", "sm_90", 0)][-1] == "FAIL: not in the binary"


def test_registers_per_sm_follow_the_allocation_rules():
    e = sass_check.Expect("k", "", 1024)
    f = sass_check.Function(regs=32)
    assert sass_check.blocks_per_sm(f, e, 90) == (2, 228, 2)  # 1024 registers a warp: 16 warps a sub-partition
    f.regs = 33  # 1056 -> 1280 a warp: 12 warps a sub-partition, 48 an SM, one block of 32
    assert sass_check.blocks_per_sm(f, e, 90)[0] == 1
    f.shared = 48 * 1024  # + 1 KiB reserved: 4 blocks in 228 KiB, 2 in sm_120's 100 KiB
    assert sass_check.blocks_per_sm(f, sass_check.Expect("k", "", 256), 90)[1] == 4
    assert sass_check.blocks_per_sm(f, sass_check.Expect("k", "", 256), 120)[1] == 2
    assert sass_check.blocks_per_sm(sass_check.Function(regs=32), e, 120)[2] == 1  # 1536 threads an SM


@pytest.mark.skipif(not q3.cuda.built(), reason="no libq3cuda.so in this build")
def test_the_library_holds_exactly_the_targets_build_info_reports():
    listed = subprocess.run([CUOBJDUMP, "--list-elf", "--list-ptx", q3.cuda.LIBRARY], capture_output=True,
                            text=True, check=True).stdout.splitlines()
    sass = {line.rsplit(".", 2)[-2] for line in listed if line.endswith(".cubin")}
    ptx = {"compute_" + line.rsplit(".", 2)[-2][3:] for line in listed if line.endswith(".ptx")}
    targets = q3.build_info()["cuda_targets"]
    assert sorted(sass | ptx) == sorted(targets)
    assert sass_check.sass_archs(CUOBJDUMP, q3.cuda.LIBRARY) == [80, 87, 90, 100, 110, 120, 121]


@pytest.mark.skipif(not q3.cuda.built(), reason="no libq3cuda.so in this build")
def test_every_decode_kernel_is_read_on_every_architecture():
    # the verdicts are the CI step's (.ci/run); here: the table reaches every kernel, and the
    # kernels that stream weights with row_dots' 16-byte loads show them in their loops
    r, rows = run()
    assert r.returncode in (0, 1), r.stderr
    for e in sass_check.DECODE_KERNELS:
        for arch in ("sm_80", "sm_87", "sm_90", "sm_100", "sm_110", "sm_120", "sm_121"):
            found = [row for (name, a, _), row in rows.items()
                     if a == arch and (name == e.name or name.startswith(e.name + "<"))]
            assert found, (e.name, arch)
            for row in found:  # each template instance (gemv_kernel<8>, <16>) on a row of its own
                assert row[-1] != "FAIL: not in the binary" and int(row[2]) > 0
                if e.wide_loads:
                    assert int(row[4]) >= 1, row
    assert ("gemv_kernel<16>", "sm_120", 0) in rows
    # the grouped experts: one template a kernel, an instance per weight-row reader
    for name in ("moe_gate_up_kernel", "moe_down_kernel"):
        assert {(f"{name}<{r}>", "sm_90", 0) for r in ("dense_rows", "fp8_rows")} <= set(rows)


def test_a_template_instance_is_named_by_its_integer_and_class_arguments():
    assert sass_check.instance_name("_Z11gemv_kernelILi16EEvPfPKfPKv8q3_dtypellli") == "gemv_kernel<16>"
    assert sass_check.instance_name("_Z18moe_gate_up_kernelI8fp8_rowsEvPfPKfPKiPKlS5_T_ll") == \
        "moe_gate_up_kernel<fp8_rows>"
    assert sass_check.instance_name("_Z1kILi-3E10dense_rowsEvv") == "k<-3,dense_rows>"
    assert sass_check.instance_name("_Z13router_kernelPiPfPKfliii") == "router_kernel"
    assert sass_check.instance_name("_Z16moe_tiles_kernelILb1EEvPf") == "moe_tiles_kernel"  # a bool: not told apart


# the table's block sizes against the sources, for the kernels whose launch block is a named
# constant: the launcher's block expression (found in the source) evaluated with its #defines
LAUNCH_BLOCKS = {
    "rmsnorm_kernel": ("rmsnorm.cu", "RMSNORM_THREADS"),  # threads_for(n): n >= RMSNORM_THREADS
    "add_rmsnorm_kernel": ("rmsnorm.cu", "RMSNORM_THREADS"),
    "router_kernel": ("router.cu", "ROUTER_WARPS * 32"),
    "qk_rope_kv_kernel": ("qk_rope_kv.cu", "WARPS * 32"),
    "attention_probs_kernel": ("attention_probs.cu", "PROBS_THREADS"),
}


def test_the_table_records_the_launchers_block_sizes():
    table = {e.name: e for e in sass_check.DECODE_KERNELS}
    for name, (source, expr) in LAUNCH_BLOCKS.items():
        with open(os.path.join(ROOT, "kernels", "cuda", source)) as f:
            text = f.read()
        assert table[name].source == source
        launch = re.search(r"Q3_LAUNCH\(%s,[^;]*;" % name, text, re.S)
        assert launch and (expr in launch.group(0) or "threads_for" in launch.group(0)), name
        if "threads_for" in launch.group(0):
            assert re.search(r"threads_for\(int64_t n\) \{ return n >= %s \? %s :" % (expr, expr), text), name
        defines = dict(re.findall(r"^#define (\w+) (\d+)\b", text, re.M))
        assert eval(re.sub(r"[A-Z_]+", lambda m: defines[m.group(0)], expr)) == table[name].block, name


def test_a_cuobjdump_that_cannot_disassemble_is_exit_2_not_a_verdict(tmp_path):
    """cuobjdump 13.5's -sass runs nvdisasm; without it (the nvidia-cuda-nvdisasm wheel) the
    check must say so and exit 2, as for a missing tool, not fail kernels or crash."""
    fake = tmp_path / "cuobjdump"
    fake.write_text("#!/bin/sh\necho \"cuobjdump fatal   : Could not find executable file 'nvdisasm'\" >&2\nexit 1\n")
    fake.chmod(0o755)
    r = subprocess.run([sys.executable, SCRIPT, "--library", str(fake)], capture_output=True, text=True,
                       env={**os.environ, "CUOBJDUMP": str(fake)}, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "sass_check: cuobjdump --list-elf: exit 1: cuobjdump fatal" in r.stderr and "nvdisasm" in r.stderr
    assert "Traceback" not in r.stderr
