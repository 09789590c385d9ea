// Decode attention over a SlotCache on the CPU: every token of a packed pass in one call (each decoding row,
// and each token of a prompt chunk as a row of its own), each reading only its own slot's columns [start,
// end). Built on first use by agent_r1/rollout/decode_attention.py.
//
// Why: at decode each row has one query per head, so attention is a matrix-vector product per (row, kv
// head) and is bound by reading the keys and values. PyTorch's SDPA runs it as a batch of tiny GEMMs that
// read fp32 keys at ~10 GB/s on two cores; this reads each key and value once for all the query heads that
// share it (GQA) and stays in L1 for the scores (FlashDecoding's split of the work by sequence and head;
// vLLM's CPU paged attention does the same over pages).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cfloat>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

// Keys and values may be stored in bf16 (`LocalEngine(kv_cache_dtype=torch.bfloat16)`): half the bytes to read, and
// each element widened to fp32 in registers. Scores, softmax and sums are fp32 whatever the storage.
inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) {  // bf16 is fp32's top half: a shift, which any compiler vectorizes
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Ask for the key (or value) kAhead positions on while this one is used (the rows' loops, portable and
// intrinsics). A row's keys for a kv head are one stream of W x 128 (bf16) or 256 (fp32) bytes, read while
// its scores are computed; the hardware prefetcher alone kept too few reads in flight for that. At 64
// rows x 416 columns read from memory (benchmarks/attention.py; docs/log/measurements.md): AVX-512 over fp32
// from ~88% of memory speed to all of it, over bf16 from 60-75% to ~82%; an AVX2 build's loops 16%
// faster over fp32 and 35-45% over bf16. The sums do not change.
constexpr int64_t kAhead = 32;
template <typename T>
inline void prefetch_key(const T* x, int64_t D) {  // a key or value of D elements
  for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(x) + b, 0, 3);
}

// scores p[g * W + w] = scale * q_g . k_w for the G query heads of one kv head, keys loaded once
template <int G, typename T>
void scores(const float* q, const T* k, int64_t k_stride, int64_t W, int64_t D, float scale, float* p) {
  for (int64_t w = 0; w < W; ++w) {
    const T* kw = k + w * k_stride;
    if (w + kAhead < W) prefetch_key(kw + kAhead * k_stride, D);
    float acc[G];
    for (int g = 0; g < G; ++g) acc[g] = 0.f;
#pragma omp simd reduction(+ : acc[:G])
    for (int64_t d = 0; d < D; ++d) {
      const float kd = widen(kw[d]);
      for (int g = 0; g < G; ++g) acc[g] += q[g * D + d] * kd;
    }
    for (int g = 0; g < G; ++g) p[g * W + w] = acc[g] * scale;
  }
}

template <typename T>
void scores_any(int64_t G, const float* q, const T* k, int64_t ks, int64_t W, int64_t D, float sc, float* p) {
  switch (G) {
    case 1: return scores<1>(q, k, ks, W, D, sc, p);
    case 2: return scores<2>(q, k, ks, W, D, sc, p);
    case 3: return scores<3>(q, k, ks, W, D, sc, p);
    case 4: return scores<4>(q, k, ks, W, D, sc, p);
    default:  // more query heads a kv head than any bundled model has: one head at a time
      for (int64_t g = 0; g < G; ++g) scores<1>(q + g * D, k, ks, W, D, sc, p + g * W);
  }
}

// The scores and the weighted sum of one (row, kv head) with intrinsics; null: the portable loops above
// A tile: up to 16 consecutive tokens of one prompt chunk (one slot, each reading one column more than the
// one before), one query head; what `chunk_tile` needs to know about it.
struct Tile {
  const float* q;     // the first token's query for this head
  int64_t q_stride;   // from one token's query to the next
  float* o;           // the first token's output for this head
  int64_t m;          // tokens, 1 .. 16
  int64_t start;      // the first column any token reads (the first token's start: starts never fall)
  const int64_t* a;   // [m] each token's first column
  const int64_t* b;   // [m] each token's end column
};

template <typename T>
struct Simd {
  void (*scores)(const float*, const T*, int64_t, int64_t, float, float*) = nullptr;
  void (*values)(const float*, const T*, int64_t, int64_t, float*) = nullptr;
  // a tile of chunk tokens for `chunk_heads` query heads over keys and values from its start (row strides ks,
  // vs), head_dim D, with scratch [chunk_heads, W + D, 16] floats; null: the portable loops (`chunk_tile_loops`)
  void (*chunk)(const Tile&, const T*, int64_t, const T*, int64_t, int64_t, float, float*) = nullptr;
  int chunk_heads = 0;
};

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// The same work with intrinsics, for head_dim 64 or 128 (ND = head_dim / kVec registers a key): AVX-512's
// 16 lanes where the CPU has them, else AVX2's 8 (most laptops; x86-64-v3).
//
// Why: the loops above leave the compiler one horizontal sum of a register's lanes per key and query head,
// and those sums, not the memory, bound the kernel (AVX-512 over bf16: ~40-55% of the machine's read speed;
// an AVX2 build over fp32: ~75%; docs/log/measurements.md). Here a register's worth of keys' products are summed
// together, by a transpose-and-add tree (~3 instructions a key, not ~8), each key is loaded and widened once
// for all G query heads, and the weighted sum of the values stays in registers. What is summed is the same;
// only the order of the fp32 additions differs (~1e-7).
#if defined(__AVX512F__)
using Vec = __m512;
constexpr int kVec = 16;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vset1(float x) { return _mm512_set1_ps(x); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline void vstore(float* p, Vec x) { _mm512_storeu_ps(p, x); }
inline float vreduce(Vec x) { return _mm512_reduce_add_ps(x); }
inline Vec vload(const float* x) { return _mm512_loadu_ps(x); }
inline Vec vload(const c10::BFloat16* x) {  // 16 bf16 widened: zero-extend to 32 bits, shift to the top
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// lane j of the result = the sum of v[j]'s 16 lanes
inline Vec sum_lanes(const Vec* v) {
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] of keys 2i, 2i+1
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: the lane's sum of keys 4i .. 4i + 3
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44), _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)  // [keys 8i..8i+3: lanes 0+1, 2+3 | keys 8i+4..8i+7: lanes 0+1, 2+3]
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}
#else
using Vec = __m256;
constexpr int kVec = 8;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset1(float x) { return _mm256_set1_ps(x); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline void vstore(float* p, Vec x) { _mm256_storeu_ps(p, x); }
inline float vreduce(Vec x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline Vec vload(const float* x) { return _mm256_loadu_ps(x); }
inline Vec vload(const c10::BFloat16* x) {  // 8 bf16 widened: zero-extend to 32 bits, shift to the top
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// lane j of the result = the sum of v[j]'s 8 lanes
inline Vec sum_lanes(const Vec* v) {
  __m256 t[4], u[2];
  for (int i = 0; i < 4; ++i)  // per 128-bit half: [a01, a23, b01, b23] of keys 2i (a), 2i + 1 (b)
    t[i] = _mm256_hadd_ps(v[2 * i], v[2 * i + 1]);
  for (int i = 0; i < 2; ++i)  // per half: the half's sums of keys 4i .. 4i + 3
    u[i] = _mm256_hadd_ps(t[2 * i], t[2 * i + 1]);
  return _mm256_add_ps(_mm256_permute2f128_ps(u[0], u[1], 0x20), _mm256_permute2f128_ps(u[0], u[1], 0x31));
}
#endif

template <int G, int ND, typename T>
void scores_simd(const float* q, const T* k, int64_t ks, int64_t W, float scale, float* p) {
  Vec qv[G][ND];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < ND; ++c) qv[g][c] = vload(q + (g * ND + c) * kVec);
  const Vec sc = vset1(scale);
  int64_t w = 0;
  for (; w + kVec <= W; w += kVec) {
    Vec acc[G][kVec];  // a register's worth of keys' products; what does not fit in the registers spills to L1
    for (int j = 0; j < kVec; ++j) {
      const T* kw = k + (w + j) * ks;
      if (w + j + kAhead < W) prefetch_key(kw + kAhead * ks, ND * kVec);
      for (int g = 0; g < G; ++g) acc[g][j] = vzero();
      for (int c = 0; c < ND; ++c) {
        const Vec x = vload(kw + c * kVec);
        for (int g = 0; g < G; ++g) acc[g][j] = vfma(qv[g][c], x, acc[g][j]);
      }
    }
    for (int g = 0; g < G; ++g) vstore(p + g * W + w, vmul(sum_lanes(acc[g]), sc));
  }
  for (; w < W; ++w) {  // the last W % kVec keys one at a time
    const T* kw = k + w * ks;
    Vec acc[G];
    for (int g = 0; g < G; ++g) acc[g] = vzero();
    for (int c = 0; c < ND; ++c) {
      const Vec x = vload(kw + c * kVec);
      for (int g = 0; g < G; ++g) acc[g] = vfma(qv[g][c], x, acc[g]);
    }
    for (int g = 0; g < G; ++g) p[g * W + w] = vreduce(acc[g]) * scale;
  }
}

// o[g] = sum_w p[g * W + w] * v_w, the G x ND sums in registers, each value loaded and widened once
template <int G, int ND, typename T>
void values_simd(const float* p, const T* v, int64_t vs, int64_t W, float* o) {
  Vec acc[G][ND];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < ND; ++c) acc[g][c] = vzero();
  for (int64_t w = 0; w < W; ++w) {
    const T* vw = v + w * vs;
    if (w + kAhead < W) prefetch_key(vw + kAhead * vs, ND * kVec);
    Vec pw[G];
    for (int g = 0; g < G; ++g) pw[g] = vset1(p[g * W + w]);
    for (int c = 0; c < ND; ++c) {
      const Vec x = vload(vw + c * kVec);
      for (int g = 0; g < G; ++g) acc[g][c] = vfma(pw[g], x, acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < ND; ++c) vstore(o + (g * ND + c) * kVec, acc[g][c]);
}
#endif

#if defined(__AVX512F__)
// e^x for 16 lanes: 2^n * e^r with n = round(x / ln 2) and |r| <= ln 2 / 2, e^r by its Taylor series to r^7
// (relative error < 2e-8 before rounding, at the level of libm's expf); scalef gives 0 where 2^n underflows
// (x = -inf included).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));  // e^-104 is 0 in fp32; keeps n finite
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln 2 in two parts: r exact
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 y = _mm512_set1_ps(1.f / 5040);
  for (const float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f})
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(y, n);
}

// A tile of a prompt chunk: 16 tokens' queries for one query head in the 16 lanes of a register, so that each
// key is read once for all of them (a row a token read it once per token: a chunk of k tokens reads its
// keys k times, from L2 or L3, and on a machine reading 19 GB/s that made a 1,000-token chunk slower than
// SDPA's flash kernel). The scores are then a small GEMM, [16, D] x [D, keys], with the queries transposed
// (QT[d] = 16 lanes) and each key element broadcast to G x R accumulators (the G query heads of the kv
// head, R keys); the softmax runs lane by lane; the weighted sum of the values is a second GEMM, J of the
// head's dims at a time.
//
// Each lane's sums depend on its own query and columns only (in column order; masked columns add exact
// zeros), so a token gets the same output bit for bit whatever tile it falls in: however a pass cut its
// prompt into chunks, whichever tokens share its tile. Only the order of the fp32 additions differs from a
// row's (~1e-7).
template <int G, int ND, typename T>
void chunk_tile(const Tile& t, const T* k, int64_t ks, const T* v, int64_t vs, int64_t, float scale, float* s) {
  constexpr int64_t D = ND * 16;
  constexpr int R = G == 1 ? 16 : G == 2 ? 12 : G == 3 ? 8 : 6;  // G x R accumulators: FMA chains in flight
  constexpr int J = G == 1 ? 16 : G <= 3 ? 8 : 4;                 // G x J accumulators of the weighted sums
  const int64_t W = t.b[t.m - 1] - t.start;
  alignas(64) float qt[G * D * 16];  // [g, d, lane]
  for (int g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d)
      for (int64_t l = 0; l < 16; ++l) qt[(g * D + d) * 16 + l] = l < t.m ? t.q[l * t.q_stride + g * D + d] : 0.f;
  const __m512 sc = _mm512_set1_ps(scale);
  auto sg = [&](int g, int64_t w) { return s + (g * W + w) * 16; };  // [g, w, lane]: the scores, then weights
  int64_t w = 0;
  for (; w + R <= W; w += R) {  // sg(g, w) = the 16 lanes' scores for key w, summed over d in order
    __m512 acc[G][R];
    for (int g = 0; g < G; ++g)
      for (int r = 0; r < R; ++r) acc[g][r] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
      __m512 qd[G];
      for (int g = 0; g < G; ++g) qd[g] = _mm512_load_ps(qt + (g * D + d) * 16);
      for (int r = 0; r < R; ++r) {
        const __m512 kd = _mm512_set1_ps(widen(k[(w + r) * ks + d]));
        for (int g = 0; g < G; ++g) acc[g][r] = _mm512_fmadd_ps(qd[g], kd, acc[g][r]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int r = 0; r < R; ++r) _mm512_storeu_ps(sg(g, w + r), _mm512_mul_ps(acc[g][r], sc));
  }
  for (; w < W; ++w) {
    __m512 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
      const __m512 kd = _mm512_set1_ps(widen(k[w * ks + d]));
      for (int g = 0; g < G; ++g) acc[g] = _mm512_fmadd_ps(_mm512_load_ps(qt + (g * D + d) * 16), kd, acc[g]);
    }
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(sg(g, w), _mm512_mul_ps(acc[g], sc));
  }
  // the softmax of each lane over its own columns [a, b), the others exact zeros: every lane reads the columns
  // [full_lo, full_hi), only the few at either side need a mask
  alignas(64) float lo[16], hi[16];
  int64_t full_lo = 0, full_hi = W;
  for (int64_t l = 0; l < 16; ++l) {
    lo[l] = l < t.m ? static_cast<float>(t.a[l] - t.start) : 0.f;  // a padding lane reads nothing
    hi[l] = l < t.m ? static_cast<float>(t.b[l] - t.start) : 0.f;
    if (l < t.m) full_lo = std::max(full_lo, t.a[l] - t.start), full_hi = std::min(full_hi, t.b[l] - t.start);
  }
  full_hi = std::max(full_hi, full_lo);
  const __m512 lov = _mm512_load_ps(lo), hiv = _mm512_load_ps(hi);
  auto reads = [&](int64_t w) -> __mmask16 {  // the lanes that read column w
    const __m512 x = _mm512_set1_ps(static_cast<float>(w));
    return _mm512_cmp_ps_mask(x, lov, _CMP_GE_OQ) & _mm512_cmp_ps_mask(x, hiv, _CMP_LT_OQ);
  };
  __m512 iv[G];  // 1 / each lane's sum of weights
  for (int g = 0; g < G; ++g) {
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (w = 0; w < full_lo; ++w) mx = _mm512_mask_max_ps(mx, reads(w), mx, _mm512_loadu_ps(sg(g, w)));
    for (; w < full_hi; ++w) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sg(g, w)));
    for (; w < W; ++w) mx = _mm512_mask_max_ps(mx, reads(w), mx, _mm512_loadu_ps(sg(g, w)));
    mx = _mm512_maskz_mov_ps(static_cast<__mmask16>((1u << t.m) - 1), mx);  // a padding lane: 0, not -inf
    __m512 total = _mm512_setzero_ps();
    for (w = 0; w < W; ++w) {
      __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sg(g, w)), mx));
      if (w < full_lo || w >= full_hi) e = _mm512_maskz_mov_ps(reads(w), e);
      _mm512_storeu_ps(sg(g, w), e);
      total = _mm512_add_ps(total, e);  // lane by lane, in column order
    }
    iv[g] = _mm512_div_ps(_mm512_set1_ps(1.f), total);
  }
  for (int64_t c = 0; c < D; c += J) {  // o[l, g, c + j] = sum_w sg(g, w)[l] * v[w, c + j] / total[l]
    __m512 acc[G][J];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < J; ++j) acc[g][j] = _mm512_setzero_ps();
    for (w = 0; w < W; ++w) {
      __m512 p[G];
      for (int g = 0; g < G; ++g) p[g] = _mm512_loadu_ps(sg(g, w));
      const T* vw = v + w * vs + c;
      for (int j = 0; j < J; ++j) {
        const __m512 x = _mm512_set1_ps(widen(vw[j]));
        for (int g = 0; g < G; ++g) acc[g][j] = _mm512_fmadd_ps(p[g], x, acc[g][j]);
      }
    }
    for (int g = 0; g < G; ++g) {
      alignas(64) float ot[J * 16];  // [j, lane]
      for (int j = 0; j < J; ++j) _mm512_store_ps(ot + j * 16, _mm512_mul_ps(acc[g][j], iv[g]));
      for (int64_t l = 0; l < t.m; ++l)
        for (int j = 0; j < J; ++j) t.o[l * t.q_stride + g * D + c + j] = ot[j * 16 + l];
    }
  }
}
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// The intrinsics for G query heads of head_dim ND x kVec: the rows' where the G x ND sums of the values fit
// in the registers (`rows`), and AVX-512's tile; an AVX2 build's tiles are the portable loops'
// (`with_tile_loops`)
template <int G, int ND, typename T>
Simd<T> simd_of(bool rows) {
#if defined(__AVX512F__)
  return {rows ? scores_simd<G, ND, T> : nullptr, rows ? values_simd<G, ND, T> : nullptr, chunk_tile<G, ND, T>, G};
#else
  return {rows ? scores_simd<G, ND, T> : nullptr, rows ? values_simd<G, ND, T> : nullptr, nullptr, 0};
#endif
}

template <typename T, int ND>
Simd<T> simd_for_group(int64_t G) {
  switch (G) {
    case 1: return simd_of<1, ND, T>(ND <= 24);
    case 2: return simd_of<2, ND, T>(2 * ND <= 24);
    case 3: return simd_of<3, ND, T>(3 * ND <= 24);
    case 4: return simd_of<4, ND, T>(4 * ND <= 24);
    default:  // more query heads a kv head than any bundled model has: a tile one query head at a time
      return simd_of<1, ND, T>(false);
  }
}

template <typename T>
Simd<T> simd_for(int64_t G, int64_t D) {
  return D == 64 ? simd_for_group<T, 64 / kVec>(G) : D == 128 ? simd_for_group<T, 128 / kVec>(G) : Simd<T>{};
}
#else
template <typename T>
Simd<T> simd_for(int64_t, int64_t) { return {}; }  // the portable loops only
#endif

// The tile with portable loops, for any CPU and head_dim: a lane is an element of a fixed-length array the
// compiler vectorizes (two AVX2 registers, four NEON ones), so each key is read once for the tile's 16 tokens
// and the kv head's G query heads, as with the intrinsics (a row a token read it 16 times: 2-2.4x slower on
// an AVX2 build, docs/log/measurements.md). A lane's sums are its own and in column order here too, so a token's
// output does not depend on its tile. No infinities: the build assumes none (-ffast-math).
constexpr int kLanes = 16;

// e^x for x <= 0 in plain arithmetic the compiler vectorizes on any CPU: 2^n * e^r with n = round(x / ln 2)
// and |r| <= ln 2 / 2, e^r by its Taylor series to r^7 (exp16's method; relative error < 2e-8 before
// rounding). A call to libm's expf in a loop is one scalar call a lane wherever the compiler has no vector
// library (clang on macOS; gcc without OpenMP's simd declarations), and was most of a tile's softmax on
// AVX2. Below -87 it gives e^-87 (~1.6e-38, fp32's smallest normal): a weight no softmax sum, which holds
// its maximum's weight of 1, can see (a select of 0 there kept gcc from vectorizing the loop).
inline float exp_lane(float x) {
  x = std::max(x, -87.f);
  const float t = x * 1.44269504088896341f;
  const int32_t ni = static_cast<int32_t>(t - 0.5f);  // x <= 0: truncation of t - 0.5 rounds t to nearest
  const float n = static_cast<float>(ni);
  float r = x - n * 0.693145751953125f;  // ln 2 in two parts: r exact
  r = r - n * 1.428606765330187045e-06f;
  const float y =
      ((((((1.f / 5040 * r + 1.f / 720) * r + 1.f / 120) * r + 1.f / 24) * r + 1.f / 6) * r + 0.5f) * r + 1.f) * r +
      1.f;
  const float two_n = std::bit_cast<float>((ni + 127) << 23);  // 2^n, n in [-126, 0]
  return y * two_n;
}

// s[g, w + r, lane] = scale * q_g[lane] . k[w + r] for R keys, summed over d in order
template <int G, int R, typename T>
void tile_scores(const float* qt, const T* k, int64_t ks, int64_t D, int64_t W, int64_t w, float scale, float* s) {
  float acc[G][R][kLanes] = {};
  for (int64_t d = 0; d < D; ++d)
    for (int r = 0; r < R; ++r) {
      const float kd = widen(k[(w + r) * ks + d]);
      for (int g = 0; g < G; ++g) {
        const float* qd = qt + (g * D + d) * kLanes;
#pragma omp simd
        for (int l = 0; l < kLanes; ++l) acc[g][r][l] += qd[l] * kd;
      }
    }
  for (int g = 0; g < G; ++g)
    for (int r = 0; r < R; ++r)
      for (int l = 0; l < kLanes; ++l) s[(g * W + w + r) * kLanes + l] = acc[g][r][l] * scale;
}

// o[g, c + j, lane] += sum over w in [w0, w1) of s[g, w, lane] * v[w, c + j], for J of the head's dims, in
// column order (the partial sums go back to o exactly, so blocks of columns change no bit of the result)
template <int G, int J, typename T>
void tile_values(const float* s, const T* v, int64_t vs, int64_t D, int64_t W, int64_t w0, int64_t w1, int64_t c,
                 float* o) {
  float acc[G][J][kLanes];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < J; ++j)
      for (int l = 0; l < kLanes; ++l) acc[g][j][l] = o[(g * D + c + j) * kLanes + l];
  for (int64_t w = w0; w < w1; ++w)
    for (int j = 0; j < J; ++j) {
      const float x = widen(v[w * vs + c + j]);
      for (int g = 0; g < G; ++g) {
        const float* p = s + (g * W + w) * kLanes;
#pragma omp simd
        for (int l = 0; l < kLanes; ++l) acc[g][j][l] += p[l] * x;
      }
    }
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < J; ++j)
      for (int l = 0; l < kLanes; ++l) o[(g * D + c + j) * kLanes + l] = acc[g][j][l];
}

template <int G, typename T>
void chunk_tile_loops(const Tile& t, const T* k, int64_t ks, const T* v, int64_t vs, int64_t D, float scale,
                      float* s) {
  constexpr int R = G >= 4 ? 1 : 6 / G;  // G x R x 16 accumulators: 12 AVX2 registers
  const int64_t W = t.b[t.m - 1] - t.start;
  float* qt = s + G * W * kLanes;  // [g, d, lane] the queries, transposed
  for (int g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d)
      for (int64_t l = 0; l < kLanes; ++l)
        qt[(g * D + d) * kLanes + l] = l < t.m ? t.q[l * t.q_stride + g * D + d] : 0.f;
  int64_t w = 0;
  for (; w + R <= W; w += R) tile_scores<G, R>(qt, k, ks, D, W, w, scale, s);
  for (; w < W; ++w) tile_scores<G, 1>(qt, k, ks, D, W, w, scale, s);
  int64_t lo[kLanes], hi[kLanes];  // each lane's columns [lo, hi); a padding lane reads none
  for (int64_t l = 0; l < kLanes; ++l) {
    lo[l] = l < t.m ? t.a[l] - t.start : 0;
    hi[l] = l < t.m ? t.b[l] - t.start : 0;
  }
  float inv[G * kLanes];  // 1 / each lane's sum of weights
  for (int g = 0; g < G; ++g) {
    float mx[kLanes], total[kLanes] = {};
    for (int l = 0; l < kLanes; ++l) mx[l] = -FLT_MAX;
    for (w = 0; w < W; ++w) {  // `&`, not `&&`: no branch in the lanes' loop, which must vectorize
      const float* x = s + (g * W + w) * kLanes;
#pragma omp simd
      for (int l = 0; l < kLanes; ++l) mx[l] = (w >= lo[l]) & (w < hi[l]) ? std::max(mx[l], x[l]) : mx[l];
    }
    for (w = 0; w < W; ++w) {  // a lane's weights, exact zeros where it does not read, summed in column order
      float* x = s + (g * W + w) * kLanes;
#pragma omp simd
      for (int l = 0; l < kLanes; ++l) {
        const float reads = static_cast<float>((w >= lo[l]) & (w < hi[l]));  // 1 or 0: a select would not vectorize
        x[l] = exp_lane(std::min(x[l] - mx[l], 0.f)) * reads;
        total[l] += x[l];
      }
    }
    for (int l = 0; l < kLanes; ++l) inv[g * kLanes + l] = l < t.m ? 1.f / total[l] : 0.f;
  }
  // The weighted sums, 64 columns at a time: every dim reads those columns' weights (G x 64 x 16 floats, in
  // L1), where a pass over all W columns for each J dims read the whole [G, W, 16] from L2, once a load per
  // FMA. The queries are read by now: their room [g, d, lane] holds the sums.
  constexpr int J = R;
  constexpr int64_t kBlock = 64;
  float* o = qt;
  std::fill(o, o + G * D * kLanes, 0.f);
  for (int64_t w0 = 0; w0 < W; w0 += kBlock) {
    const int64_t w1 = std::min(w0 + kBlock, W);
    int64_t c = 0;
    for (; c + J <= D; c += J) tile_values<G, J>(s, v, vs, D, W, w0, w1, c, o);
    for (; c < D; ++c) tile_values<G, 1>(s, v, vs, D, W, w0, w1, c, o);
  }
  for (int g = 0; g < G; ++g)
    for (int64_t l = 0; l < t.m; ++l)
      for (int64_t d = 0; d < D; ++d) t.o[l * t.q_stride + g * D + d] = o[(g * D + d) * kLanes + l] * inv[g * kLanes + l];
}

// The portable tile for G query heads a kv head: up to 4 at once, more one at a time
template <typename T>
Simd<T> with_tile_loops(Simd<T> simd, int64_t G) {
  if (simd.chunk) return simd;
  switch (G) {
    case 1: simd.chunk = chunk_tile_loops<1, T>, simd.chunk_heads = 1; break;
    case 2: simd.chunk = chunk_tile_loops<2, T>, simd.chunk_heads = 2; break;
    case 3: simd.chunk = chunk_tile_loops<3, T>, simd.chunk_heads = 3; break;
    case 4: simd.chunk = chunk_tile_loops<4, T>, simd.chunk_heads = 4; break;
    default: simd.chunk = chunk_tile_loops<1, T>, simd.chunk_heads = 1;
  }
  return simd;
}

// What a thread takes: a decoding row (or a lone prompt token), or a tile of up to 16 consecutive tokens of a
// prompt chunk (`chunk_tile`), for one kv head.
struct Unit {
  int64_t row, m;  // rows row .. row + m - 1
  bool tile;
};

// The rows as units: a run of rows in one slot, each reading one column more than the one before, is a
// prompt chunk (two decoding rows never share a slot), cut into tiles of 16.
std::vector<Unit> units_of(const int64_t* sp, const int64_t* ap, const int64_t* bp, int64_t n) {
  std::vector<Unit> units;
  for (int64_t i = 0; i < n;) {
    int64_t j = i + 1;
    while (j < n && sp[j] == sp[i] && bp[j] == bp[j - 1] + 1 && ap[j] >= ap[j - 1]) ++j;
    if (j - i == 1) {
      units.push_back({i, 1, false});
    } else {
      for (int64_t r = i; r < j; r += kLanes) units.push_back({r, std::min<int64_t>(kLanes, j - r), true});
    }
    i = j;
  }
  return units;
}

// Job boundaries (a job: one unit and kv head, in order) that give each thread about the same work: a prompt
// chunk's tokens read hundreds or thousands of columns each, a decoding row's as few as one, and an even split
// of the jobs would leave one thread waiting on the other.
std::vector<int64_t> balanced_split(const std::vector<Unit>& units, const int64_t* ap, const int64_t* bp, int64_t H) {
  const int64_t n = static_cast<int64_t>(units.size());
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n * H));
  constexpr int64_t kJobCost = 16;  // a job's own cost beside its columns (its softmax, its output)
  constexpr int64_t kTileCost = 2;  // a tile of 16 tokens costs about as much as this many rows (measured)
  auto cost = [&](const Unit& u) {
    const int64_t W = bp[u.row + u.m - 1] - ap[u.row];
    return (W + kJobCost) * (u.tile ? kTileCost : 1);
  };
  int64_t total = 0;
  for (const Unit& u : units) total += cost(u) * H;
  std::vector<int64_t> split{0};
  int64_t done = 0;
  for (int64_t job = 0; job < n * H && static_cast<int64_t>(split.size()) < threads; ++job) {
    done += cost(units[job / H]);
    if (done * threads >= total * static_cast<int64_t>(split.size())) split.push_back(job + 1);
  }
  split.push_back(n * H);
  return split;
}

// One row's attention for kv head h: the G query heads' scores over its columns, their softmax, the weighted sum
template <typename T>
void attend_row(const Simd<T>& simd, const float* q, const T* k, int64_t ks, const T* v, int64_t vs, int64_t G,
                int64_t D, int64_t W, float sc, float* p, float* o) {
  if (simd.scores)
    simd.scores(q, k, ks, W, sc, p);
  else
    scores_any(G, q, k, ks, W, D, sc, p);
  for (int64_t g = 0; g < G; ++g) {  // softmax over the row's columns
    float* pg = p + g * W;
    float m = pg[0];
    for (int64_t w = 1; w < W; ++w) m = pg[w] > m ? pg[w] : m;
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t w = 0; w < W; ++w) {
      pg[w] = std::exp(pg[w] - m);
      total += pg[w];
    }
    const float inv = 1.f / total;
    for (int64_t w = 0; w < W; ++w) pg[w] *= inv;
  }
  if (simd.values) {  // the weighted sum of values, each value loaded once
    simd.values(p, v, vs, W, o);
    return;
  }
  for (int64_t x = 0; x < G * D; ++x) o[x] = 0.f;
  for (int64_t w = 0; w < W; ++w) {
    const T* vw = v + w * vs;
    if (w + kAhead < W) prefetch_key(vw + kAhead * vs, D);
    for (int64_t g = 0; g < G; ++g) {
      const float pw = p[g * W + w];
      float* og = o + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) og[d] += pw * widen(vw[d]);
    }
  }
}

// The work of `decode_attention` for keys and values stored as T (checked by the caller).
template <typename T>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const int64_t* sp, const int64_t* ap,
            const int64_t* bp, float sc, const at::Tensor& out, bool portable) {
  const int64_t H = q.size(1), G = q.size(2), D = q.size(3);
  const Simd<T> simd = with_tile_loops(portable ? Simd<T>{} : simd_for<T>(G, D), G);
  const float* qp = q.data_ptr<float>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  float* op = out.data_ptr<float>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  const std::vector<Unit> units = units_of(sp, ap, bp, q.size(0));
  const std::vector<int64_t> split = balanced_split(units, ap, bp, H);
  at::parallel_for(0, static_cast<int64_t>(split.size()) - 1, 1, [&](int64_t first, int64_t last) {
    std::vector<float> buf;  // a row's [G, W] scores, then weights; a tile's [G, W + D, 16]
    for (int64_t job = split[first]; job < split[last]; ++job) {
      const Unit& u = units[job / H];
      const int64_t h = job % H, i = u.row, s = sp[i], a = ap[i], W = bp[i + u.m - 1] - a;
      const T* kb = kp + s * ks0 + h * ks1 + a * ks2;
      const T* vb = vp + s * vs0 + h * vs1 + a * vs2;
      buf.resize(u.tile ? kLanes * G * (W + D) : G * W);
      if (!u.tile) {
        attend_row(simd, qp + (i * H + h) * G * D, kb, ks2, vb, vs2, G, D, W, sc, buf.data(), op + (i * H + h) * G * D);
        continue;
      }
      for (int64_t g = 0; g < G; g += simd.chunk_heads) {
        const int64_t at = (i * H + h) * G * D + g * D;
        simd.chunk({qp + at, H * G * D, op + at, u.m, a, ap + i, bp + i}, kb, ks2, vb, vs2, D, sc, buf.data());
      }
    }
  });
}

// q [n, H, G, D] fp32 contiguous; k, v [slots, H, capacity, D] fp32 or bf16 (unit stride in D); slots,
// starts, ends [n] int64; out [n, H, G, D] fp32 contiguous. Row i attends to columns starts[i] .. ends[i] - 1
// of slot slots[i].
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
         const at::Tensor& starts, const at::Tensor& ends, double scale, const at::Tensor& out, bool portable) {
  const auto kv = k.scalar_type();
  TORCH_CHECK(q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat && v.scalar_type() == kv &&
                  (kv == at::kFloat || kv == at::kBFloat16),
              "decode_attention: q and out float32, keys and values float32 or bfloat16 alike");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k.stride(3) == 1 && v.stride(3) == 1,
              "decode_attention: q and out contiguous, keys and values with unit stride in head_dim");
  const int64_t n = q.size(0), H = q.size(1), D = q.size(3);
  TORCH_CHECK(k.dim() == 4 && v.sizes() == k.sizes() && k.size(1) == H && k.size(3) == D && out.sizes() == q.sizes(),
              "decode_attention: q [n, H, G, D], k and v [slots, H, capacity, D], out like q");
  for (const at::Tensor* t : {&slots, &starts, &ends})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == n,
                "decode_attention: slots, starts and ends are n contiguous int64");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* ap = starts.data_ptr<int64_t>();
  const int64_t* bp = ends.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(0 <= sp[i] && sp[i] < k.size(0) && 0 <= ap[i] && ap[i] < bp[i] && bp[i] <= k.size(2),
                "decode_attention: row ", i, " reads columns [", ap[i], ", ", bp[i], ") of slot ", sp[i],
                ": outside the cache or empty");
  const float sc = static_cast<float>(scale);
  if (kv == at::kBFloat16)
    attend<c10::BFloat16>(q, k, v, sp, ap, bp, sc, out, portable);
  else
    attend<float>(q, k, v, sp, ap, bp, sc, out, portable);
}

void decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
                      const at::Tensor& starts, const at::Tensor& ends, double scale, const at::Tensor& out) {
  run(q, k, v, slots, starts, ends, scale, out, false);
}

// The portable loops alone, whatever this CPU has: what a CPU without AVX-512 or AVX2 runs, testable on one with it
void decode_attention_portable(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& slots, const at::Tensor& starts, const at::Tensor& ends,
                               double scale, const at::Tensor& out) {
  run(q, k, v, slots, starts, ends, scale, out, true);
}

// Rotary embedding of a packed pass's queries and keys, and the keys and values stored at their slots and
// columns: what transformers' `apply_rotary_pos_emb` and `SlotCache`'s update do in ~20 tensor ops a layer
// (slices, a negation, a concatenation, products, sums, two scattered writes), in one pass over the tokens
// (`kv_cache.FusedSlotAttention`; what it saves: docs/log/measurements.md).
//
// The same floating-point operations in the same order as transformers' (x * cos + rotate_half(x) * sin, each
// product rounded, no fused multiply-add), so the keys and the attention's queries are bitwise what they are
// on the reference path: the engine's log-probs stay those of the tested path.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
template <typename T>
void rope_store_as(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                   const at::Tensor& sin, const at::Tensor& buf, const int64_t* sp, const int64_t* cp) {
  const int64_t n = q.size(0), Hq = q.size(1), H = k.size(1), D = q.size(2), half = D / 2;
  float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* cs = cos.data_ptr<float>();
  const float* sn = sin.data_ptr<float>();
  T* bp = buf.data_ptr<T>();
  const int64_t b0 = buf.stride(0), b1 = buf.stride(1), b2 = buf.stride(2), b3 = buf.stride(3);
  at::parallel_for(0, n, 16, [&](int64_t first, int64_t last) {
    std::vector<float> x(D), rotated(D);
    for (int64_t i = first; i < last; ++i) {
      const float* c = cs + i * D;
      const float* s = sn + i * D;
      auto rotate = [&](const float* in, float* out) {  // out may be in: read into x first
        std::memcpy(x.data(), in, D * sizeof(float));
        for (int64_t d = 0; d < half; ++d) {
          const float a = x[d] * c[d], b = -x[d + half] * s[d];
          out[d] = a + b;
        }
        for (int64_t d = half; d < D; ++d) {
          const float a = x[d] * c[d], b = x[d - half] * s[d];
          out[d] = a + b;
        }
      };
      for (int64_t h = 0; h < Hq; ++h) rotate(qp + (i * Hq + h) * D, qp + (i * Hq + h) * D);
      T* key = bp + sp[i] * b1 + cp[i] * b3;
      T* value = key + b0;
      for (int64_t h = 0; h < H; ++h) {
        rotate(kp + (i * H + h) * D, rotated.data());
        const float* vh = vp + (i * H + h) * D;
        for (int64_t d = 0; d < D; ++d) {
          key[h * b2 + d] = static_cast<T>(rotated[d]);
          value[h * b2 + d] = static_cast<T>(vh[d]);
        }
      }
    }
  });
}
#pragma GCC pop_options

// q [n, Hq, D], k and v [n, H, D] fp32 contiguous; cos, sin [n, D] fp32 contiguous; buf a layer's [2, slots, H,
// capacity, D] (fp32 or bf16, unit stride in D); slots, cols [n] int64. Rotates q in place and writes token
// i's rotated key and its value at column cols[i] of slot slots[i].
void rope_store(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                const at::Tensor& sin, const at::Tensor& buf, const at::Tensor& slots, const at::Tensor& cols) {
  for (const at::Tensor* t : {&q, &k, &v, &cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "rope_store: q, k, v, cos, sin contiguous float32");
  const int64_t n = q.size(0), D = q.size(2);
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && k.size(0) == n && k.size(2) == D &&
                  D % 2 == 0 && cos.sizes() == at::IntArrayRef({n, D}) && sin.sizes() == cos.sizes(),
              "rope_store: q [n, Hq, D], k and v [n, H, D], cos and sin [n, D], D even");
  TORCH_CHECK(buf.dim() == 5 && buf.size(0) == 2 && buf.size(2) == k.size(1) && buf.size(4) == D &&
                  buf.stride(4) == 1 && (buf.scalar_type() == at::kFloat || buf.scalar_type() == at::kBFloat16),
              "rope_store: buf [2, slots, H, capacity, D] float32 or bfloat16, unit stride in D");
  for (const at::Tensor* t : {&slots, &cols})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == n,
                "rope_store: slots and cols are n contiguous int64");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* cp = cols.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(0 <= sp[i] && sp[i] < buf.size(1) && 0 <= cp[i] && cp[i] < buf.size(3), "rope_store: token ", i,
                " goes to column ", cp[i], " of slot ", sp[i], ": outside the cache");
  if (buf.scalar_type() == at::kBFloat16)
    rope_store_as<c10::BFloat16>(q, k, v, cos, sin, buf, sp, cp);
  else
    rope_store_as<float>(q, k, v, cos, sin, buf, sp, cp);
}

// Whether this build has the intrinsics (for SmolLM2's shape: head_dim 64, 3 query heads a kv head)
bool decode_attention_simd() { return simd_for<float>(3, 64).scores != nullptr; }

}  // namespace

TORCH_LIBRARY(agent_r1, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor starts, Tensor ends, float scale, "
        "Tensor(a!) out) -> ()");
  m.def("decode_attention_portable(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor starts, Tensor ends, "
        "float scale, Tensor(a!) out) -> ()");
  m.def("decode_attention_simd() -> bool", &decode_attention_simd);
  m.def("rope_store(Tensor(a!) q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(b!) buf, Tensor slots, "
        "Tensor cols) -> ()");
  m.impl("rope_store", c10::DispatchKey::CPU, &rope_store);
  m.impl("decode_attention", c10::DispatchKey::CPU, &decode_attention);
  m.impl("decode_attention_portable", c10::DispatchKey::CPU, &decode_attention_portable);
}
