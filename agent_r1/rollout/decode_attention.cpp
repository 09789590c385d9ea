// Decode attention over a SlotCache on the CPU: every decoding row of a packed pass in one call, each row
// reading only its own slot's columns [start, end). Built on first use by agent_r1/rollout/decode_attention.py.
//
// Why: at decode each row has one query per head, so attention is a matrix-vector product per (row, kv
// head) and is bound by reading the keys and values. PyTorch's SDPA runs it as a batch of tiny GEMMs that
// read fp32 keys at ~10 GB/s on two cores; this reads each key and value once for all the query heads that
// share it (GQA) and stays in L1 for the scores (FlashDecoding's split of the work by sequence and head;
// vLLM's CPU paged attention does the same over pages).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

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

// scores p[g * W + w] = scale * q_g . k_w for the G query heads of one kv head, keys loaded once
template <int G, typename T>
void scores(const float* q, const T* k, int64_t k_stride, int64_t W, int64_t D, float scale, float* p) {
  for (int64_t w = 0; w < W; ++w) {
    const T* kw = k + w * k_stride;
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

// The work of `decode_attention` for keys and values stored as T (checked by the caller).
template <typename T>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const int64_t* sp, const int64_t* ap,
            const int64_t* bp, float sc, const at::Tensor& out) {
  const int64_t n = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3);
  const float* qp = q.data_ptr<float>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  float* op = out.data_ptr<float>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  at::parallel_for(0, n * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;  // [G, W] the scores, then the weights
    for (int64_t job = begin; job < end; ++job) {
      const int64_t i = job / H, h = job % H, s = sp[i], a = ap[i], W = bp[i] - a;
      buf.resize(G * W);
      float* p = buf.data();
      scores_any(G, qp + job * G * D, kp + s * ks0 + h * ks1 + a * ks2, ks2, W, D, sc, p);
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
      float* o = op + job * G * D;  // the weighted sum of values, each value loaded once
      for (int64_t x = 0; x < G * D; ++x) o[x] = 0.f;
      const T* vb = vp + s * vs0 + h * vs1 + a * vs2;
      for (int64_t w = 0; w < W; ++w) {
        const T* vw = vb + w * vs2;
        for (int64_t g = 0; g < G; ++g) {
          const float pw = p[g * W + w];
          float* og = o + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) og[d] += pw * widen(vw[d]);
        }
      }
    }
  });
}

// q [n, H, G, D] fp32 contiguous; k, v [slots, H, capacity, D] fp32 or bf16 (unit stride in D); slots,
// starts, ends [n] int64; out [n, H, G, D] fp32 contiguous. Row i attends to columns starts[i] .. ends[i] - 1
// of slot slots[i].
void decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
                      const at::Tensor& starts, const at::Tensor& ends, double scale, const at::Tensor& out) {
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
    attend<c10::BFloat16>(q, k, v, sp, ap, bp, sc, out);
  else
    attend<float>(q, k, v, sp, ap, bp, sc, out);
}

}  // namespace

TORCH_LIBRARY(agent_r1, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor starts, Tensor ends, float scale, "
        "Tensor(a!) out) -> ()");
  m.impl("decode_attention", c10::DispatchKey::CPU, &decode_attention);
}
