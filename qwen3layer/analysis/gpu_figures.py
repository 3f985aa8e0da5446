"""The machine figures the predictions use where nothing is measured: one H200's copy rate and
bf16 matrix rate, and a PCIe 5.0 x16 link's rate, each with where it comes from.
benchmarks/bench_cuda.py --predict takes the H200's (a GPU run measures both on its own device
and uses those instead); qwen3layer.analysis.costs_hybrid.Machine takes all three as its defaults."""

# bytes/s a device-to-device copy reaches on an H200 SXM (141 GB of HBM3e): NVIDIA's H200
# datasheet gives 4.8 TB/s of memory bandwidth; a copy reaches about 90% of it. This is the
# figure the project planned with; bench_cuda.py's "device copy" line measures it on a GPU.
H200_COPY_BYTES_PER_S = 4.3e12

# FLOP/s of a large bf16 matrix product on an H200 SXM: the datasheet's dense bf16 tensor-core
# peak is 989 TFLOP/s (1,979 with 2:4 sparsity); cuBLAS reaches about 80% of it on large
# squares. The figure the project planned with; bench_cuda.py's "bf16 matrix rate" line
# measures it (torch's matmul of 8192^3) on a GPU.
H200_BF16_FLOPS = 790e12

# bytes/s each way over PCIe 5.0 x16: 32 GT/s a lane x 16 lanes with 128b/130b encoding is
# 63 GB/s (the PCIe 5.0 specification); pinned host <-> device copies reach about 50 of it
# after packet headers and flow control. An assumed figure, not one measured here.
PCIE5_X16_BYTES_PER_S = 50e9
