// The SIMT executor's <mma.h>: nvcuda::wmma for the shape and types the kernels use
// (16 x 16 x 16, bf16 inputs, fp32 accumulators). Every operation but fill_fragment and
// element access is a warp collective: the 32 lanes of the warp must all take part, and the
// hardware's rules are checked (pointers 32-byte aligned, ldm a multiple of 16 bytes).
// mma_sync computes the whole tile once, from every lane's fragments, in fp32 with the
// products in k order.
//
// The layout of a fragment is the executor's own (lane l holds elements 8l .. 8l + 7 of the
// tile, row-major over (row, col) for A and accumulators, (k, n) for B): a kernel that reads
// its elements by position in the hardware's layout is not checked by the executor; one
// that treats them uniformly (scales, activations) is.
#ifndef Q3_SIMT_MMA_H
#define Q3_SIMT_MMA_H

#include <cuda_bf16.h>

#include <type_traits>

#include <cuda_runtime.h> // the executor's

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <class Use, int M, int N, int K, class T, class Layout = void> class fragment {
    static_assert(M == 16 && N == 16 && K == 16, "the executor models the 16 x 16 x 16 shape");

  public:
    enum { num_elements = 8 };
    T x[num_elements];
};

template <class Use, class T, class L> inline void fill_fragment(fragment<Use, 16, 16, 16, T, L> &f, T v) {
    for (int i = 0; i < 8; i++) f.x[i] = v;
}
template <class Use, class L>
inline void fill_fragment(fragment<Use, 16, 16, 16, __nv_bfloat16, L> &f, float v) {
    for (int i = 0; i < 8; i++) f.x[i] = __float2bfloat16_rn(v);
}

} // namespace wmma
} // namespace nvcuda

namespace simt {

// the hardware's rules for a fragment's memory: 256-bit aligned, ldm a multiple of 16 bytes
void wmma_check(const void *p, unsigned ldm, size_t element_bytes, const char *op);
// the warp's lanes together: complete() sees every lane's context (kernels/simt/block.cpp)
void warp_all(const char *site, void *ctx, void (*complete)(void *const ctx[32], unsigned mask));

// element (r, c) of a 16 x 16 tile at p, stored row- or column-major with leading dimension ld
template <class T> inline T &tile_at(T *p, unsigned ld, bool row_major, int r, int c) {
    return row_major ? p[(size_t)r * ld + c] : p[(size_t)c * ld + r];
}

template <class F, class T> struct LoadCtx {
    F *frag;
    const T *p;
    unsigned ld;
    bool row_major;
};

template <class F, class T> inline void load_lane(F &f, const T *p, unsigned ld, bool row_major, int lane) {
    for (int i = 0; i < 8; i++) {
        const int e = lane * 8 + i;
        f.x[i] = tile_at(const_cast<T *>(p), ld, row_major, e / 16, e % 16);
    }
}

template <class F, class T> inline void load_sync(F &f, const T *p, unsigned ld, bool row_major, const char *op) {
    wmma_check(p, ld, sizeof(T), op);
    LoadCtx<F, T> me = {&f, p, ld, row_major};
    // each lane loads its own elements once all have arrived (a collective: all 32 take part)
    warp_all(op, &me, [](void *const ctx[32], unsigned) {
        for (int l = 0; l < 32; l++) {
            LoadCtx<F, T> *c = (LoadCtx<F, T> *)ctx[l];
            load_lane(*c->frag, c->p, c->ld, c->row_major, l);
        }
    });
}

} // namespace simt

namespace nvcuda {
namespace wmma {

template <class T, class L>
inline void load_matrix_sync(fragment<matrix_a, 16, 16, 16, T, L> &f, const T *p, unsigned ldm) {
    simt::load_sync(f, p, ldm, std::is_same<L, row_major>::value, "wmma::load_matrix_sync(matrix_a)");
}
// B is K x N: (k, n) at p[k * ldm + n] row-major, p[n * ldm + k] column-major
template <class T, class L>
inline void load_matrix_sync(fragment<matrix_b, 16, 16, 16, T, L> &f, const T *p, unsigned ldm) {
    simt::load_sync(f, p, ldm, std::is_same<L, row_major>::value, "wmma::load_matrix_sync(matrix_b)");
}
inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float> &f, const float *p, unsigned ldm,
                             layout_t layout) {
    simt::load_sync(f, p, ldm, layout == mem_row_major, "wmma::load_matrix_sync(accumulator)");
}

inline void store_matrix_sync(float *p, const fragment<accumulator, 16, 16, 16, float> &f, unsigned ldm,
                              layout_t layout) {
    simt::wmma_check(p, ldm, sizeof(float), "wmma::store_matrix_sync");
    struct Ctx {
        const fragment<accumulator, 16, 16, 16, float> *frag;
        float *p;
        unsigned ld;
        bool row_major;
    } me = {&f, p, ldm, layout == mem_row_major};
    simt::warp_all("wmma::store_matrix_sync", &me, [](void *const ctx[32], unsigned) {
        for (int l = 0; l < 32; l++) {
            const Ctx *c = (const Ctx *)ctx[l];
            for (int i = 0; i < 8; i++) {
                const int e = l * 8 + i;
                simt::tile_at(c->p, c->ld, c->row_major, e / 16, e % 16) = c->frag->x[i];
            }
        }
    });
}

// d = a b + c over the whole tile, from every lane's fragments (d may be c)
template <class T, class LA, class LB>
inline void mma_sync(fragment<accumulator, 16, 16, 16, float> &d, const fragment<matrix_a, 16, 16, 16, T, LA> &a,
                     const fragment<matrix_b, 16, 16, 16, T, LB> &b, const fragment<accumulator, 16, 16, 16, float> &c) {
    struct Ctx {
        fragment<accumulator, 16, 16, 16, float> *d;
        const fragment<matrix_a, 16, 16, 16, T, LA> *a;
        const fragment<matrix_b, 16, 16, 16, T, LB> *b;
        const fragment<accumulator, 16, 16, 16, float> *c;
    } me = {&d, &a, &b, &c};
    simt::warp_all("wmma::mma_sync", &me, [](void *const ctx[32], unsigned) {
        float A[16][16], B[16][16], C[16][16];
        for (int l = 0; l < 32; l++) {
            const Ctx *x = (const Ctx *)ctx[l];
            for (int i = 0; i < 8; i++) {
                const int e = l * 8 + i;
                A[e / 16][e % 16] = __bfloat162float(x->a->x[i]);
                B[e / 16][e % 16] = __bfloat162float(x->b->x[i]);
                C[e / 16][e % 16] = x->c->x[i];
            }
        }
        for (int l = 0; l < 32; l++) {
            const Ctx *x = (const Ctx *)ctx[l];
            for (int i = 0; i < 8; i++) {
                const int e = l * 8 + i, r = e / 16, col = e % 16;
                float s = C[r][col];
                for (int k = 0; k < 16; k++) s += A[r][k] * B[k][col];
                x->d->x[i] = s;
            }
        }
    });
}

} // namespace wmma
} // namespace nvcuda

#endif
