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
#include <vector>

namespace {

// scores p[g * W + w] = scale * q_g . k_w for the G query heads of one kv head, keys loaded once
template <int G>
void scores(const float* q, const float* k, int64_t k_stride, int64_t W, int64_t D, float scale, float* p) {
  for (int64_t w = 0; w < W; ++w) {
    const float* kw = k + w * k_stride;
    float acc[G];
    for (int g = 0; g < G; ++g) acc[g] = 0.f;
#pragma omp simd reduction(+ : acc[:G])
    for (int64_t d = 0; d < D; ++d) {
      const float kd = kw[d];
      for (int g = 0; g < G; ++g) acc[g] += q[g * D + d] * kd;
    }
    for (int g = 0; g < G; ++g) p[g * W + w] = acc[g] * scale;
  }
}

void scores_any(int64_t G, const float* q, const float* k, int64_t ks, int64_t W, int64_t D, float sc, float* p) {
  switch (G) {
    case 1: return scores<1>(q, k, ks, W, D, sc, p);
    case 2: return scores<2>(q, k, ks, W, D, sc, p);
    case 3: return scores<3>(q, k, ks, W, D, sc, p);
    case 4: return scores<4>(q, k, ks, W, D, sc, p);
    default:  // more query heads a kv head than any bundled model has: one head at a time
      for (int64_t g = 0; g < G; ++g) scores<1>(q + g * D, k, ks, W, D, sc, p + g * W);
  }
}

// q [n, H, G, D] contiguous; k, v [slots, H, capacity, D] (unit stride in D); slots, starts, ends [n] int64;
// out [n, H, G, D] contiguous. Row i attends to columns starts[i] .. ends[i] - 1 of slot slots[i].
void decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
                      const at::Tensor& starts, const at::Tensor& ends, double scale, const at::Tensor& out) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "decode_attention: float32 only");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k.stride(3) == 1 && v.stride(3) == 1,
              "decode_attention: q and out contiguous, keys and values with unit stride in head_dim");
  const int64_t n = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3);
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
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  const float sc = static_cast<float>(scale);
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
      const float* vb = vp + s * vs0 + h * vs1 + a * vs2;
      for (int64_t w = 0; w < W; ++w) {
        const float* vw = vb + w * vs2;
        for (int64_t g = 0; g < G; ++g) {
          const float pw = p[g * W + w];
          float* og = o + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) og[d] += pw * vw[d];
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(agent_r1, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor starts, Tensor ends, float scale, "
        "Tensor(a!) out) -> ()");
  m.impl("decode_attention", c10::DispatchKey::CPU, &decode_attention);
}
