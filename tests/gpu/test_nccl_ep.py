"""ExpertParallelLayer over NCCL: the gloo tests' ranks (tests/helpers/ep_worker.py), each on
its own GPU (cuda:<rank>), against the single-process CUDA layer of the same seed: ragged
prefill chunked differently per rank, a rank with no tokens, a left-padded batch, decode, the
caches equal, and the refusals raised on every rank. Skipped, saying why, where fewer than 2
GPUs exist (benchmarks/gpu_check.sh runs it where a machine has them)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "helpers"))
import ep_worker  # noqa: E402

torch = pytest.importorskip("torch")


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(_gpus() < 2, reason=f"NCCL expert parallelism needs 2 GPUs, this machine has {_gpus()}")
@pytest.mark.parametrize("placement_kind", ["contiguous", "one_rank_gets_nothing"])
def test_expert_parallel_layer_over_nccl_equals_the_single_process_layer(placement_kind, tmp_path):
    import torch.distributed as dist
    if not dist.is_nccl_available():
        pytest.skip("this torch has no NCCL backend")
    problem = ep_worker.spawn_ranks(2, str(tmp_path / "rendezvous"), placement_kind, backend="nccl")
    if problem:
        pytest.fail(problem)
