"""The SIMT executor catches real defects: builds of the executor with a defect planted in a
real kernel (behind Q3_MUTANT(n), kernels/cuda/common.cuh; the list is MUTANTS in
benchmarks/simt_check.py) run the kernel self-check, and each defect must be reported by the
mechanism meant for it: the twin, the race check (results that differ across the thread
schedules), the executor's own error naming kernel, block and thread, or AddressSanitizer.
One plant per mechanism here (each variant compiles only the file with its plant, a few
seconds), each checked on the cases of the planted kernel's launchers;
`python benchmarks/simt_check.py --mutants`, which CI runs, checks all of them on every case,
and that each shows in its own kernel's cases alone."""
import functools
import importlib.util
import os
import re
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
_spec = importlib.util.spec_from_file_location("simt_check", os.path.join(ROOT, "benchmarks", "simt_check.py"))
simt_check = sys.modules.setdefault("simt_check", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(simt_check)

pytestmark = pytest.mark.skipif(simt_check._setup().find_cuda_headers() is None,
                                reason="the CUDA toolkit's headers are needed to build the executor (CI has them)")
MUTANTS = {m.id: m for m in simt_check.MUTANTS}


@functools.lru_cache(maxsize=None)
def run(mutant_id: int) -> dict:
    """The kernel check on the executor with defect mutant_id planted (built on first use),
    focused: the cases of the launchers that run the planted code (Mutant.launchers) alone.
    That the other kernels' cases stay right under each defect is simt_check.py --mutants'
    part (CI), which checks every case of every variant."""
    m = MUTANTS[mutant_id]
    return simt_check.run_check(simt_check.build_variant(m.id, sanitized=m.sanitized), sanitized=m.sanitized,
                                kernels=m.launchers)


def cases_of(r: dict, *prefixes: str) -> tuple[list, list]:
    """The run's cases whose names start with one of prefixes, and the others."""
    mine = [c for c in r["cases"] if c["case"].startswith(prefixes)]
    return mine, [c for c in r["cases"] if not c["case"].startswith(prefixes)]


def test_a_focused_check_runs_the_cases_of_the_named_launchers_alone():
    """check_kernels(kernels=...) runs the cases with one of the named launchers and no other,
    and refuses a name no case has (a focused mutant check cannot silently run nothing)."""
    r = simt_check.run_check(None, kernels=("attention_probs", "moe_route"))
    kinds = {c["kernel"] for c in r["cases"]}
    assert r["returncode"] == 0 and kinds == {"attention_probs", "moe_route"}, (kinds, r["stderr"][-2000:])
    assert all(c["ok"] for c in r["cases"]) and len(r["cases"]) >= 10
    bad = simt_check.run_check(None, kernels=("attention_probs", "no_such_launcher"))
    assert "no case exercises 'no_such_launcher'" in bad["stderr"], bad["stderr"][-2000:]


def test_each_planted_defect_is_written_once_in_the_kernels_and_listed():
    """Every Q3_MUTANT(n) in kernels/cuda/ is one of simt_check's MUTANTS and each of those is
    planted exactly once: the list and the sources cannot drift apart."""
    planted = []
    for name in os.listdir(os.path.join(ROOT, "kernels", "cuda")):
        with open(os.path.join(ROOT, "kernels", "cuda", name), encoding="utf-8") as f:
            planted += [int(n) for n in re.findall(r"Q3_MUTANT\((\d+)\)", f.read())]
    assert sorted(planted) == sorted(MUTANTS) and len(MUTANTS) >= 8
    assert all(len(simt_check.plant_sites(n)) == 1 for n in MUTANTS)
    assert {m.expect for m in MUTANTS.values()} <= set(simt_check.MECHANISMS)
    assert all(m.launchers and all(isinstance(x, str) for x in m.launchers) for m in MUTANTS.values())


def test_a_barrier_removed_between_two_uses_of_a_tile_shows_in_the_race_check():
    """matmul_tc_kernel without the barrier that keeps the next k slice from being staged over
    the one other warps still read: the schedule that runs each warp ahead to its next barrier
    gives other results than the lockstep ones (agree is False), for its cases only. (With
    the warps in lockstep in every schedule, as before, this defect went unseen.)"""
    r = run(10)
    mine, others = cases_of(r, "matmul tensor cores", "matmul WMMA only")
    assert len(mine) >= 2 and r["returncode"] == 0
    assert all(not c["agree"] for c in mine), mine
    assert all(c["agree"] and c["ok"] for c in others)


def test_an_attention_mask_one_key_too_far_fails_against_the_twin():
    """attention_kernel sees one key past the causal mask (n_past + t + 2 keys): its cases
    (4 hand-made, 120 at the listed shapes, 48 of them over an fp16 cache, 55 at other head
    dims, group sizes and cache dtypes, 20 over hidden keys) are off from the twin, every
    result is still the same under each schedule (no race); the tensor-core kernel's, hidden keys and trees among them, stay right. Under a
    tree the extra key is one of the call's tokens, which the query's row of the tree hides
    (a token never sees a later one), except for the call's last token, which reads one byte
    past its row: the next sequence's tree (its first byte set: the cases of two sequences are
    off) or the zero row the check lays after the last tree (one sequence: right)."""
    r = run(2)
    mine, others = cases_of(r, "attention bf16", "attention, ", "attention split-KV", "attention f32",
                            "attention f16", "attention hidden keys")
    assert len(mine) == 199 and all(c["max_err"] > 100 * c["tol"] for c in mine), mine
    trees, others = cases_of({"cases": others}, "attention tree")
    two_seqs = [c for c in trees if ", cached: " in c["case"]]
    assert len(two_seqs) == 12 and all(c["max_err"] > 100 * c["tol"] for c in two_seqs), trees
    assert len(trees) == 24 and all(c["ok"] for c in trees if c not in two_seqs)
    assert all(c["agree"] for c in r["cases"]) and all(c["ok"] for c in others)
    assert sum(c["case"].startswith("attention tc hidden keys") for c in others) == 5
    assert sum(c["case"].startswith("attention tc tree") for c in others) == 8


def test_hidden_keys_seen_fail_against_the_twin_where_a_query_has_one_to_see():
    """attention_kernel never reading the flags of a token mask (every key of [first_key, i]
    attended, hidden or not): the cases over hidden keys whose queries have a hidden key in
    their range (holes, right padding, a batch mixing flags and none, a long hidden run; each
    on the decode, split and prefill paths) are far off the CPU kernel; those whose hidden
    keys all lie before the first key (first_key still read: queries before it see only
    themselves) stay right, as do the tensor-core kernel's and every case without flags, on
    every schedule. Under a tree: the cases after cached tokens with hidden keys among them
    are off, those of a fresh sequence (no flags) right."""
    r = run(20)
    hidden, others = cases_of(r, "attention hidden keys")
    before_first = [c for c in hidden if "first rows hidden" in c["case"]]
    seen = [c for c in hidden if c not in before_first]
    assert len(before_first) == 4 and len(seen) == 16, hidden
    assert all(c["max_err"] > 100 * c["tol"] for c in seen), seen
    trees, others = cases_of({"cases": others}, "attention tree")
    flagged = [c for c in trees if ", cached: " in c["case"]]
    assert len(trees) == 24 and len(flagged) == 12, trees
    assert all(c["max_err"] > 100 * c["tol"] for c in flagged), flagged
    assert all(c["ok"] for c in trees if c not in flagged)
    assert all(c["ok"] for c in before_first) and all(c["ok"] for c in others)
    assert sum(c["case"].startswith("attention tc hidden keys") for c in others) == 5
    assert all(c["agree"] for c in r["cases"])


def test_a_tree_never_read_fails_against_the_twin_where_it_hides_a_key():
    """attention_kernel never reading a call's tree (every key of [first_key, i] seen, as a
    causal call): the tree cases on the split-KV and block-per-token paths whose tree hides a
    key from some query (branches, each token alone, a random tree; the chain's second
    sequence, whose tree branches) are far off the CPU kernel; a chain in a fresh sequence (the
    causal mask) and a one-token tree stay right, as do the tensor-core kernel's and every case
    without a tree, on every schedule."""
    r = run(21)
    trees, others = cases_of(r, "attention tree")
    causal = [c for c in trees if "chain, fresh" in c["case"] or c["case"].endswith("fresh: 1 token split")]
    hidden = [c for c in trees if c not in causal]
    assert len(causal) == 6 and len(hidden) == 18, trees
    assert all(c["max_err"] > 100 * c["tol"] for c in hidden), hidden
    assert all(c["ok"] for c in causal) and all(c["ok"] for c in others)
    assert sum(c["case"].startswith("attention tc tree") for c in others) == 8
    assert all(c["agree"] for c in r["cases"])


def test_a_wrong_lane_mask_is_the_executors_error_naming_kernel_block_and_thread():
    """__match_any_sync(0x0000ffff) reached by all 32 lanes of moe_route_kernel's warp: the
    launch fails at the first lane outside the mask, and the message says which."""
    error = run(6).get("error", "")
    m = re.search(r"kernel moe_route_kernel, block \(0, 0, 0\), thread \((\d+), 0, 0\): "
                  r"kernels/cuda/moe_grouped\.cu:\d+ with mask 0x0000ffff, which does not name the calling lane (\d+)",
                  error)
    assert m and m.group(1) == m.group(2) and int(m.group(2)) >= 16, error


def test_a_misaligned_16_byte_load_fails_the_launch_as_on_a_gpu():
    """A uint4 load from the bf16 KV cache one element (2 bytes) off: the executor's
    alignment check (-fsanitize=alignment, handled in kernels/simt/reports.cpp) fails the
    launch with the kernel, block, thread, source line and address."""
    error = run(5).get("error", "")
    m = re.search(r"kernel attention_tc_kernel, block \(\d+, 0, 0\), thread \(\d+, 0, 0\): "
                  r"kernels/cuda/attention_tc\.cu:\d+: \w+ (?:\w+ )*misaligned address (0x[0-9a-f]+) of type "
                  r"'[^']*uint4', which needs 16-byte alignment", error)
    assert m and int(m.group(1), 16) % 16 == 2, error


def test_a_barrier_in_a_divergent_branch_is_reported_as_a_deadlock():
    """__syncthreads inside `if (lane < nj)`: on a partial key tile the lanes past nj wait at
    the warp reduction while the others wait at the barrier; the executor names both."""
    error = run(7).get("error", "")
    assert re.search(r"kernel attention_kernel, block \(\d+, \d+, 0\): deadlock at a barrier while other threads "
                     r"wait at a warp primitive: threads 0-\d+ at __syncthreads kernels/cuda/attention\.cu:\d+; "
                     r"threads \d+-31 at a warp primitive", error), error


def test_a_launch_past_48_kib_without_raising_the_limit_is_the_executors_error():
    """q3_attention_cuda without its cudaFuncSetAttribute call: the first case whose tiles
    need more than the default 48 KiB of dynamic shared memory (head_dim 192 and 256: 50 to
    98 KiB) fails its launch as on a GPU, the message naming the kernel and the bytes."""
    error = run(8).get("error", "")
    m = re.search(r"kernel attention_kernel: launch with (\d+) bytes of dynamic shared memory, past the kernel's "
                  r"limit of 49152 \(48 KiB unless cudaFuncSetAttribute\(MaxDynamicSharedMemorySize\) raises it", error)
    assert m and 48 * 1024 < int(m.group(1)) <= 99840, error


def test_a_shared_index_one_past_its_array_is_addresssanitizers_report():
    """matmul_tc_kernel's warps stash fragments in out[warp + 1] of float out[4][16][16]: the
    results stay right (each warp reads back what it wrote), but the last warp writes just
    past the array, a heap block of exactly its size in the executor built with
    AddressSanitizer, which stops the process; the executor adds where the abort came from."""
    r = run(4)
    assert r["returncode"] != 0 and "cases" not in r
    assert "ERROR: AddressSanitizer: heap-buffer-overflow" in r["stderr"], r["stderr"][-3000:]
    assert re.search(r"located 0 bytes (to the right of|after) 4096-byte region", r["stderr"]), r["stderr"][-3000:]
    assert re.search(r"in matmul_tc_kernel\(.*kernels/cuda/matmul_tc\.cu:\d+", r["stderr"])
    assert re.search(r"simt: aborted in kernel matmul_tc_kernel, block \(\d+, \d+, 0\), thread \(\d+, 0, 0\)",
                     r["stderr"]), r["stderr"][-3000:]


def test_an_fp8_scale_from_the_wrong_column_block_fails_against_the_twin():
    """gemv_fp8_kernel takes 16-byte chunk c's block scale from block c / 9 instead of c / 8:
    from column 128 on, some chunks are scaled by their neighbour block's scale. Its cases on
    16-byte loads with K >= 256 are far off the twin (the one-element-a-lane ones, K = 100 and
    w unaligned, and the FP8 MoE kernels, which instantiate the right block size, stay
    right); no schedule changes a result."""
    r = run(11)
    mine, others = cases_of(r, "fp8 matmul GEMV")
    wide = [c for c in mine if "K=400" in c["case"] or "K=4096" in c["case"] or "K=256" in c["case"]]
    wide = [c for c in wide if "unaligned" not in c["case"] or "x unaligned" in c["case"]]
    assert len(wide) >= 16 and all(c["max_err"] > 100 * c["tol"] for c in wide), wide
    assert all(c["ok"] for c in mine if "K=100" in c["case"] or "w unaligned" in c["case"])
    assert all(c["agree"] for c in r["cases"]) and all(c["ok"] for c in others)


def test_an_attention_map_from_the_wrong_kv_head_fails_against_the_cpu_kernel():
    """attention_probs_kernel with query head h reading KV head h % Hkv instead of h / G: every
    map case with more than one KV head and more than one query head on each is far off the CPU
    kernel; the cases where both give the same head (G = 1, or one KV head) stay right, as does
    the decode step whose queries all see only themselves (first rows hidden: a probability of
    1 whatever the head) and the fresh calls whose tree leaves each token alone (the same), and
    no schedule changes a result."""
    r = run(12)
    mine, others = cases_of(r, "attention probs")
    same_head = [c for c in mine if "G=1 " in c["case"] or "after 300, G=2" in c["case"]
                 or c["case"] == "attention probs hidden keys, first rows hidden: decode"
                 or c["case"].startswith("attention probs tree, alone, fresh")]
    wrong = [c for c in mine if c not in same_head]
    assert len(same_head) == 5 and len(wrong) == 35, mine
    assert all(c["max_err"] > 100 * c["tol"] for c in wrong), wrong
    assert all(c["ok"] for c in same_head) and all(c["ok"] for c in others)
    assert all(c["agree"] for c in r["cases"])


def test_rows_taken_by_half_fail_against_the_twin():
    """take_rows moving H 16-bit units a row instead of H x element size / 2 (a split layer's
    rows, qwen3layer/placement/hybrid.py): the cases of fp32 rows are off the twin (half of
    each row not moved); the bf16 and fp16 rows' cases, where both sizes agree, stay right"""
    r = run(13)
    mine, others = cases_of(r, "take + add rows")
    fp32 = [c for c in mine if "fp32 rows" in c["case"]]
    assert len(fp32) == 2 and not any(c["ok"] for c in fp32), mine
    halves = [c for c in mine if "bf16 rows" in c["case"] or "fp16 rows" in c["case"]]
    assert len(halves) == 2 and all(c["ok"] for c in halves) and all(c["ok"] for c in others)


def test_gptq_groups_run_together_across_a_k_slice_fail_against_the_twin():
    """gemv_int4_kernel with each K slice's groups run together (the whole slice scaled by its
    first group's scale and zero): exactly the cases whose slices cross a group's end are off
    the twin, the g32 matrix of K = 384 (48 word rows over 32 slices, groups of 4 rows) at each
    T and K = 4096 (4 groups a slice); where slices lie inside groups (groups of 128 and 64
    inputs, one group, desc_act's own path) the results stay right, on every schedule."""
    r = run(19)
    mine, others = cases_of(r, "int4 matmul GEMV")
    crossing = [c for c in mine if " g32 v1 " in c["case"] and "desc_act" not in c["case"]]
    assert len(crossing) == 5 and all(c["max_err"] > 100 * c["tol"] for c in crossing), crossing
    assert all(c["ok"] for c in mine if c not in crossing) and len(mine) == 26
    assert all(c["agree"] for c in r["cases"]) and all(c["ok"] for c in others)


def test_gptq_g_idx_ignored_fails_only_the_desc_act_dequantizations():
    """int4_dequant_kernel taking input k's group as k G / K instead of g_idx[k]: the two
    desc_act matrices (g_idx a shuffle) dequantize wrong, bit for bit against the twin; where
    g_idx is k / group the kernel never reads it and the five other cases stay exact."""
    r = run(14)
    mine, others = cases_of(r, "int4 dequant")
    desc_act = [c for c in mine if "desc_act" in c["case"]]
    assert len(desc_act) == 2 and not any(c["ok"] for c in desc_act), mine
    assert len(mine) == 7 and all(c["ok"] for c in mine if c not in desc_act)
    assert all(c["ok"] for c in others)


def test_a_defect_that_shows_in_another_kernels_cases_is_flagged():
    """simt_check.py --mutants fails a defect whose full check fails a case of a kernel it is
    not planted in (elsewhere): read on a made-up run, cases of the mutant's own launchers
    (attention) may fail, a failing or racy case of another launcher is named."""
    m = MUTANTS[2]
    case = lambda name, kernel, ok=True, agree=True: {"case": name, "kernel": kernel, "ok": ok, "agree": agree}
    run = {"cases": [case("attention a", "attention", ok=False), case("rmsnorm", "rmsnorm"),
                     case("moe", "moe_gate_up+moe_down+moe_combine")]}
    assert simt_check.elsewhere(m, run) == []
    run["cases"] += [case("matmul x", "matmul", ok=False), case("router y", "router_topk", agree=False)]
    assert [c["case"] for c in simt_check.elsewhere(m, run)] == ["matmul x", "router y"]
    assert simt_check.elsewhere(m, {"error": "stopped"}) == []
