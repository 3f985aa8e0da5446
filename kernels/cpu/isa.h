/* Each C file of kernels/cpu/ is compiled once per instruction set (setup.py: "portable" for
 * the architecture's baseline, on x86-64 "avx2" with FMA and "avx512", on aarch64 "neon"
 * (ARMv8.0 ASIMD; portable there is scalar: the reference the others are checked against),
 * "neon_bf16" (ARMv8.6 with BF16) and "sve" (ARMv8.2 SVE, vector-length agnostic where the
 * compiler vectorises loops)). Q3_ISA names
 * the variant being compiled; Q3_CPU_FN(q3_op) names a definition for it: q3_op_cpu_avx2. */
#ifndef Q3_KERNELS_CPU_ISA_H
#define Q3_KERNELS_CPU_ISA_H

#ifndef Q3_ISA
#define Q3_ISA portable
#endif
#define Q3_STR_(x) #x
#define Q3_STR(x) Q3_STR_(x)
#define Q3_ISA_NAME Q3_STR(Q3_ISA)
#define Q3_CPU_CAT_(name, isa) name##_cpu_##isa
#define Q3_CPU_CAT(name, isa) Q3_CPU_CAT_(name, isa)
#define Q3_CPU_FN(name) Q3_CPU_CAT(name, Q3_ISA)

/* #if Q3_CPU_TWINS: the CPU twins of the CUDA kernels (twins.h), which call the portable
 * kernels by name: compiled in the portable variant that qwen3layer._testing links
 * (-DQ3_TWINS=1, setup.py), never into the shipped _C */
#define Q3_ISA_IS_portable 1
#define Q3_ISA_IS_avx2 0
#define Q3_ISA_IS_avx512 0
#define Q3_ISA_IS_neon 0
#define Q3_ISA_IS_neon_bf16 0
#define Q3_ISA_IS_sve 0
#define Q3_ISA_IS_(isa) Q3_ISA_IS_##isa
#define Q3_ISA_IS(isa) Q3_ISA_IS_(isa)
#define Q3_ISA_PORTABLE Q3_ISA_IS(Q3_ISA)
/* #if Q3_ISA_BFDOT: the neon_bf16 variant (where its BFDOT products are compiled) */
#define Q3_ISA_BFDOT_portable 0
#define Q3_ISA_BFDOT_avx2 0
#define Q3_ISA_BFDOT_avx512 0
#define Q3_ISA_BFDOT_neon 0
#define Q3_ISA_BFDOT_neon_bf16 1
#define Q3_ISA_BFDOT_sve 0
#define Q3_ISA_BFDOT_(isa) Q3_ISA_BFDOT_##isa
#define Q3_ISA_BFDOT_IS(isa) Q3_ISA_BFDOT_(isa)
#define Q3_ISA_BFDOT Q3_ISA_BFDOT_IS(Q3_ISA)
#ifndef Q3_TWINS
#define Q3_TWINS 0
#endif
#define Q3_CPU_TWINS (Q3_ISA_PORTABLE && Q3_TWINS)

#endif
