"""Shared-memory bank math of the decode attention kernel (kernels/cuda/attention.cu), which the
SIMT executor cannot see: its row stride (row_stride, read from the source) keeps the scoring
reads, the value reads and the bf16 staging stores free of bank conflicts, and its shared
memory fits what a block may opt into on every target. The model: 32 banks of 4 bytes; a
16-byte access is served 8 lanes (a quarter-warp) at a time, without conflict when those 8
lanes hit 8 different 16-byte bank groups."""
import os
import re

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def _source(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


SRC = _source("kernels/cuda/attention.cu")
OPS = _source("kernels/cuda/ops_cuda.h")
KEY_TILE = int(re.search(r"#define KEY_TILE (\d+)", SRC).group(1))
MAX_D = int(re.search(r"#define Q3_CUDA_MAX_HEAD_DIM (\d+)", OPS).group(1))
MAX_G = int(re.search(r"#define Q3_CUDA_MAX_GROUP (\d+)", OPS).group(1))
# the C expression of row_stride(D), as integer Python (C's / on non-negative ints is //)
_STRIDE = re.search(r"row_stride\(int D\) \{ return ([^;]+); \}", SRC).group(1).replace("/", "//")
HEAD_DIMS = range(2, MAX_D + 1, 2)  # the config takes even head dims only


def row_stride(D: int) -> int:
    return eval(_STRIDE, {"D": D})  # noqa: S307 - an arithmetic expression of this repository's source


def quarter_warp_conflicts(chunks) -> int:
    """The worst conflict degree of a warp's 16-byte accesses (32 chunk indices, lane order)."""
    worst = 1
    for q in range(4):
        groups = [c % 8 for c in chunks[8 * q:8 * q + 8]]
        worst = max(worst, max(groups.count(g) for g in set(groups)))
    return worst


def test_rows_hold_the_head_dims_in_an_odd_number_of_16_byte_chunks():
    for D in HEAD_DIMS:
        S = row_stride(D)
        assert S % 4 == 0 and S >= D and S - D < 8 and (S // 4) % 2 == 1, (D, S)


def test_scoring_reads_are_conflict_free_where_the_old_tile_was_32_way():
    """Lane j scores key j, reading chunk c of row j (kt[j S + 4 c]) for each c."""
    for D in HEAD_DIMS:
        S = row_stride(D)
        for c in range((D + 3) // 4):
            assert quarter_warp_conflicts([j * S // 4 + c for j in range(KEY_TILE)]) == 1, (D, c)
    # the tile before: kt[lane * D + i], 4-byte reads: every lane on one bank at D = 128
    old_banks = [(lane * 128 + 0) % 32 for lane in range(32)]
    assert max(old_banks.count(b) for b in set(old_banks)) == 32


def test_value_reads_are_conflict_free():
    """Lane reads chunk lane + 32 i of one value row: consecutive chunks."""
    for D in HEAD_DIMS:
        S = row_stride(D)
        for j in range(KEY_TILE):
            for i in range(MAX_D // 128):
                chunks = [j * S // 4 + lane + 32 * i for lane in range(32)]
                assert quarter_warp_conflicts(chunks) == 1, (D, j, i)


def test_bf16_staging_stores_are_conflict_free_for_rows_of_whole_quarter_warps():
    """Thread e of the tile stores the 16-byte load e (row e / per, chunk pair c = e % per,
    per = D / 8) as chunks 2c + h, then 2c + 1 - h, h = (c >> 2) & 1: conflict-free when
    D % 64 == 0, at most 2-way at the other D % 8 == 0 (the plain order, h = 0: 2-way)."""
    for D in range(8, MAX_D + 1, 8):
        S, per = row_stride(D), D // 8
        for warp in range(KEY_TILE * per // 32 + 1):
            es = [e for e in range(32 * warp, 32 * warp + 32)]
            if es[-1] >= KEY_TILE * per:
                break
            for second in (0, 1):
                chunks = []
                for e in es:
                    j, c = divmod(e, per)
                    h = (c >> 2) & 1
                    chunks.append(j * S // 4 + 2 * c + (1 - h if second else h))
                worst = quarter_warp_conflicts(chunks)
                assert worst == 1 if D % 64 == 0 else worst <= 2, (D, warp, second, worst)
    plain = [2 * c for c in range(32)]  # h = 0 for every thread, D = 256
    assert quarter_warp_conflicts(plain) == 2


def test_shared_memory_fits_every_targets_opt_in_limit():
    """kt, vt and a query row per warp: at most 99 KiB (101,376 bytes), the most a block may opt
    into on sm_86, sm_89 and sm_120 (sm_80: 163 KiB, sm_90: 227 KiB); past 48 KiB the launcher
    raises the kernel's attribute."""
    smem = re.search(r"const size_t smem = \(size_t\)\(2 \* KEY_TILE \+ G\) \* row_stride\(D\) \* sizeof\(float\);",
                     SRC)
    assert smem, "the launcher's shared memory formula changed: update this test"
    worst = max((2 * KEY_TILE + G) * row_stride(D) * 4 for D in HEAD_DIMS for G in range(1, MAX_G + 1))
    assert worst == (2 * KEY_TILE + MAX_G) * row_stride(MAX_D) * 4 == 99840 <= 101376
    assert (2 * KEY_TILE + 1) * row_stride(MAX_D) * 4 > 48 * 1024  # D = 256 needs the attribute at any G
    assert "cudaFuncAttributeMaxDynamicSharedMemorySize" in SRC
