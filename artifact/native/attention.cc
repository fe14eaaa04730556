// kvserve's CPU attention for the fused graph: an onnxruntime custom op that takes the place
// of com.microsoft GroupQueryAttention where the graph uses the subset kvserve exports
// (packed q/k/v, the KV cache in place, rotate-half RoPE from cos/sin tables, query_seqlens,
// a sliding window, soft-capping). artifact/native_attention.py rewrites the graph in memory
// and checks this op against onnxruntime's own on every load.
//
// Row b of a call: T = seqlens_k[b] + 1 rows in its cache after the call, Q = query_seqlens[b]
// new tokens at cache rows (and positions) [T - Q, T); query j attends to the keys
// [max(0, p - window + 1), p], p = T - Q + j. Query rows past Q (a right-padded row's padding)
// give zeros. The new K/V rows are written into the cache (present == past: in place).
//
// Each (row, kv head, block of queries) is one task on onnxruntime's intra-op pool; a task
// reads each key and value row once for all the query heads that share it.
#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace {

using namespace kvs;

constexpr int kMaxGroup = 16;     // query heads per kv head handled together
constexpr int64_t kMaxHead = 256;  // the largest head size (weighted<0>'s accumulators)
constexpr int64_t kQueryBlock = 16;  // queries per task
constexpr int64_t kKeyTile = 32;     // keys read once for all of a task's query heads
constexpr int64_t kSerialWork = 1 << 14;  // below this many multiply-adds a call, no pool

struct Attrs {
  int64_t heads = 0, kv_heads = 0, window = -1;
  float scale = 0.f, softcap = 0.f;
};

// One call's tensors and sizes, shared by its tasks.
struct Call {
  Attrs a;
  int64_t B, S, D, M, G, blocks;
  const float* q;  // (B, S, H, D): rotated queries
  float* k;        // (B, Hkv, M, D): the cache, new rows written
  float* v;
  float* out;      // (B, S, H, D)
  const int32_t* total;  // per row: T
  const int32_t* qlen;   // per row: Q
  int64_t max_keys;      // the longest key range of any query (the work estimate)
  std::atomic<bool> failed{false};  // a task could not get its scratch memory
};

// Lane i of the result: the sum of a[i]'s lanes (eight horizontal sums at once).
inline v8 reduce8(const v8* a) {
  v8 t[4], u[2];
  for (int i = 0; i < 4; ++i)
    t[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
  for (int i = 0; i < 2; ++i)
    u[i] = __builtin_shufflevector(t[2 * i], t[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(t[2 * i], t[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  return __builtin_shufflevector(u[0], u[1], 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(u[0], u[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

// s[t] = scale * q . K[t] for t in [0, n): eight keys at a time (eight independent sums).
// CH: the head's 8-float chunks (0: taken from ``chunks`` at run time).
template <int CH>
void scores(const float* q, const float* K, int64_t n, int64_t chunks, float scale, float* s) {
  const int64_t C = CH ? CH : chunks, D = C * 8;
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    v8 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = splat(0.f);
    const float* k = K + t * D;
    for (int64_t ch = 0; ch < C; ++ch) {
      const v8 qv = load8(q + ch * 8);
      for (int i = 0; i < 8; ++i) acc[i] = fmadd(qv, load8(k + i * D + ch * 8), acc[i]);
    }
    store8(s + t, reduce8(acc) * splat(scale));
  }
  for (; t < n; ++t) {
    v8 acc = splat(0.f);
    for (int64_t ch = 0; ch < C; ++ch) acc = fmadd(load8(q + ch * 8), load8(K + t * D + ch * 8), acc);
    s[t] = hsum(acc) * scale;
  }
}

// acc = acc * carry + sum_t p[t] V[t]: one accumulator a chunk (independent sums), keys in
// order.
template <int CH>
void weighted(const float* p, const float* V, int64_t n, int64_t chunks, float carry,
              float* acc_io) {
  const int64_t C = CH ? CH : chunks, D = C * 8;
  constexpr int kMax = CH ? CH : 32;
  v8 acc[kMax];
  for (int64_t ch = 0; ch < C; ++ch) acc[ch] = load8(acc_io + ch * 8) * splat(carry);
  for (int64_t t = 0; t < n; ++t) {
    const v8 w = splat(p[t]);
    const float* v = V + t * D;
    for (int64_t ch = 0; ch < C; ++ch) acc[ch] = fmadd(w, load8(v + ch * 8), acc[ch]);
  }
  for (int64_t ch = 0; ch < C; ++ch) store8(acc_io + ch * 8, acc[ch]);
}

// One query head's running softmax over the key tiles seen so far (flash attention's online
// form): the largest score m, the sum l of exp(score - m), the weighted values (D floats).
struct Running {
  float m, l;
  float* acc;
};

// Scores s[0, n) of keys [t, t + n) into the running state r: exponentials taken against the
// new largest score, the old sums scaled to it.
template <int CH>
void absorb(Running& r, float* s, const float* V, int64_t n, int64_t chunks, float softcap) {
  if (softcap > 0.f)
    for (int64_t t = 0; t < n; ++t) s[t] = softcap * std::tanh(s[t] / softcap);
  v8 m8 = splat(r.m);
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const v8 x = load8(s + t);
    m8 = x > m8 ? x : m8;
  }
  float m = m8[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, m8[i]);
  for (; t < n; ++t) m = std::max(m, s[t]);
  const float carry = exp8(splat(r.m - m))[0];  // (r.m = -inf at first: 0)
  v8 sum8 = splat(0.f);
  for (t = 0; t + 8 <= n; t += 8) {
    const v8 e = exp8(load8(s + t) - splat(m));
    store8(s + t, e);
    sum8 += e;
  }
  float sum = hsum(sum8);
  for (; t < n; ++t) {
    s[t] = exp8(splat(s[t] - m))[0];
    sum += s[t];
  }
  weighted<CH>(s, V, n, chunks, carry, r.acc);
  r.l = r.l * carry + sum;
  r.m = m;
}

// One task: row b, kv head h, queries [j0, j1) of the call, every query head of the group.
// Keys go by in tiles of kKeyTile at fixed cache rows (multiples of the tile), each read once
// for all the task's query heads. A query's arithmetic depends on its position, its window and
// the tiles alone, never on the call's other rows or its number of queries: a row computed in a
// decode step, a verification or any split of a prompt comes out the same, bit for bit.
template <int CH>
void attend(const Call& c, int64_t b, int64_t h, int64_t j0, int64_t j1) {
  const int64_t D = c.D, H = c.a.heads, G = c.G, chunks = D / 8;
  const int64_t T = c.total[b], Q = c.qlen[b], P = T - Q;
  const float* K = c.k + (b * c.a.kv_heads + h) * c.M * D;
  const float* V = c.v + (b * c.a.kv_heads + h) * c.M * D;
  const int64_t jv = std::min(j1, Q);  // queries past Q: a right-padded row's padding
  for (int64_t j = std::max(j0, jv); j < j1; ++j)
    std::memset(c.out + ((b * c.S + j) * H + h * G) * D, 0, G * D * sizeof(float));
  if (j0 >= jv) return;
  const int64_t nq = jv - j0, window = c.a.window;
  thread_local std::vector<float> scratch;
  const size_t need = static_cast<size_t>(nq * G * D + kKeyTile);
  if (scratch.size() < need) scratch.resize(need);
  float* s = scratch.data();
  float* accs = s + kKeyTile;
  thread_local std::vector<Running> run;
  run.resize(static_cast<size_t>(nq * G));
  for (int64_t i = 0; i < nq * G; ++i) run[i] = {-INFINITY, 0.f, accs + i * D};
  std::memset(accs, 0, nq * G * D * sizeof(float));
  auto lo_of = [&](int64_t p) { return window > 0 ? std::max<int64_t>(0, p - window + 1) : 0; };
  const int64_t first = lo_of(P + j0) / kKeyTile * kKeyTile, last = P + jv - 1;
  for (int64_t t0 = first; t0 <= last; t0 += kKeyTile) {
    for (int64_t j = j0; j < jv; ++j) {
      const int64_t p = P + j, a = std::max(t0, lo_of(p)), z = std::min(t0 + kKeyTile - 1, p);
      if (a > z) continue;
      for (int64_t g = 0; g < G; ++g) {
        const float* q = c.q + ((b * c.S + j) * H + h * G + g) * D;
        scores<CH>(q, K + a * D, z - a + 1, chunks, c.a.scale, s);
        absorb<CH>(run[(j - j0) * G + g], s, V + a * D, z - a + 1, chunks, c.a.softcap);
      }
    }
  }
  for (int64_t j = j0; j < jv; ++j)
    for (int64_t g = 0; g < G; ++g) {
      const Running& r = run[(j - j0) * G + g];
      float* out = c.out + ((b * c.S + j) * H + h * G + g) * D;
      const v8 inv = splat(1.f / r.l);
      for (int64_t ch = 0; ch < chunks; ++ch) store8(out + ch * 8, load8(r.acc + ch * 8) * inv);
    }
}

void run_task(const Call& c, size_t index) {
  const int64_t blk = static_cast<int64_t>(index) % c.blocks;
  const int64_t rest = static_cast<int64_t>(index) / c.blocks;
  const int64_t h = rest % c.a.kv_heads, b = rest / c.a.kv_heads;
  const int64_t j0 = blk * kQueryBlock, j1 = std::min(c.S, j0 + kQueryBlock);
  switch (c.D) {
    case 32: return attend<4>(c, b, h, j0, j1);
    case 64: return attend<8>(c, b, h, j0, j1);
    case 128: return attend<16>(c, b, h, j0, j1);
    default: return attend<0>(c, b, h, j0, j1);
  }
}

void task(void* data, size_t index) {
  Call& c = *static_cast<Call*>(data);
  try {
    run_task(c, index);
  } catch (...) {  // (not through onnxruntime's pool: std::terminate; Compute rethrows)
    c.failed.store(true);
  }
}


// Rotate-half RoPE of one head vector at position p (R = rotated pairs).
inline void rotate(float* x, const float* cos, const float* sin, int64_t R) {
  for (int64_t i = 0; i < R; ++i) {
    const float a = x[i], b = x[i + R];
    x[i] = a * cos[i] - b * sin[i];
    x[i + R] = b * cos[i] + a * sin[i];
  }
}

struct Kernel {
  Attrs a;

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    try {
      Compute(context);
    } catch (const std::exception& e) {
      return Ort::GetApi().CreateStatus(ORT_INVALID_ARGUMENT, e.what());
    }
    return nullptr;
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto qkv = ctx.GetInput(0), past_k = ctx.GetInput(1), past_v = ctx.GetInput(2);
    auto seqlens = ctx.GetInput(3), qlens = ctx.GetInput(4);
    auto cos_in = ctx.GetInput(5), sin_in = ctx.GetInput(6);
    const bool rotary = static_cast<const OrtValue*>(cos_in) != nullptr;
    const auto qshape = qkv.GetTensorTypeAndShapeInfo().GetShape();
    const auto kshape = past_k.GetTensorTypeAndShapeInfo().GetShape();
    if (qshape.size() != 3 || kshape.size() != 4) throw std::runtime_error("kvserve attention: bad ranks");
    const int64_t B = qshape[0], S = qshape[1], H = a.heads, Hkv = a.kv_heads;
    const int64_t M = kshape[2], D = kshape[3];
    if (kshape[0] != B || kshape[1] != Hkv || qshape[2] != (H + 2 * Hkv) * D)
      throw std::runtime_error("kvserve attention: shapes do not agree");
    if (D % 8 || D > kMaxHead)
      throw std::runtime_error("kvserve attention: a head size not a multiple of 8 up to 256");
    if (past_v.GetTensorTypeAndShapeInfo().GetShape() != kshape ||
        seqlens.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(B) ||
        qlens.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(B))
      throw std::runtime_error("kvserve attention: counters or value cache of another shape");
    auto out = ctx.GetOutput(0, {B, S, H * D});
    auto pres_k = ctx.GetOutput(1, kshape), pres_v = ctx.GetOutput(2, kshape);
    float* k = pres_k.GetTensorMutableData<float>();
    float* v = pres_v.GetTensorMutableData<float>();
    const size_t cache = static_cast<size_t>(B * Hkv * M * D) * sizeof(float);
    if (k != past_k.GetTensorData<float>()) std::memcpy(k, past_k.GetTensorData<float>(), cache);
    if (v != past_v.GetTensorData<float>()) std::memcpy(v, past_v.GetTensorData<float>(), cache);
    const int32_t* sk = seqlens.GetTensorData<int32_t>();
    const int32_t* ql = qlens.GetTensorData<int32_t>();
    int64_t R = 0, table = 0;
    const float *cos = nullptr, *sin = nullptr;
    if (rotary) {
      const auto cshape = cos_in.GetTensorTypeAndShapeInfo().GetShape();
      if (static_cast<const OrtValue*>(sin_in) == nullptr || cshape.size() != 2 ||
          sin_in.GetTensorTypeAndShapeInfo().GetShape() != cshape)
        throw std::runtime_error("kvserve attention: cos and sin tables of one 2-D shape");
      table = cshape[0];
      R = cshape[1];
      if (2 * R > D) throw std::runtime_error("kvserve attention: rotary wider than a head");
      cos = cos_in.GetTensorData<float>();
      sin = sin_in.GetTensorData<float>();
    }
    std::vector<int32_t> total(B), qn(B);
    int64_t max_keys = 1;
    for (int64_t b = 0; b < B; ++b) {
      if (sk[b] < 0 || sk[b] >= M || ql[b] < 0 || ql[b] > S)
        throw std::runtime_error("kvserve attention: a row's lengths do not fit its cache");
      total[b] = sk[b] + 1;
      qn[b] = ql[b];
      if (total[b] < qn[b] || (rotary && total[b] > table))
        throw std::runtime_error("kvserve attention: a row's lengths do not fit its cache");
      max_keys = std::max<int64_t>(max_keys, total[b]);
    }
    if (a.window > 0) max_keys = std::min<int64_t>(max_keys, a.window);
    thread_local std::vector<float> qbuf;
    qbuf.resize(static_cast<size_t>(B * S * H * D));
    const float* x = qkv.GetTensorData<float>();
    const int64_t W = (H + 2 * Hkv) * D;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t P = total[b] - qn[b];
      for (int64_t j = 0; j < qn[b]; ++j) {
        const float* row = x + (b * S + j) * W;
        float* qd = qbuf.data() + (b * S + j) * H * D;
        std::memcpy(qd, row, H * D * sizeof(float));
        const int64_t p = P + j;
        for (int64_t h = 0; h < Hkv; ++h) {
          float* kd = k + ((b * Hkv + h) * M + p) * D;
          std::memcpy(kd, row + (H + h) * D, D * sizeof(float));
          std::memcpy(v + ((b * Hkv + h) * M + p) * D, row + (H + Hkv + h) * D, D * sizeof(float));
          if (rotary) rotate(kd, cos + p * R, sin + p * R, R);
        }
        if (rotary)
          for (int64_t h = 0; h < H; ++h) rotate(qd + h * D, cos + p * R, sin + p * R, R);
      }
    }
    Call c{a, B, S, D, M, H / Hkv, (S + kQueryBlock - 1) / kQueryBlock, qbuf.data(), k, v,
           out.GetTensorMutableData<float>(), total.data(), qn.data(), max_keys, {false}};
    const size_t tasks = static_cast<size_t>(B * Hkv * c.blocks);
    int64_t work = 0;  // multiply-adds, about
    for (int64_t b = 0; b < B; ++b) work += qn[b] * std::min<int64_t>(total[b], max_keys);
    work *= 2 * H * D;
    if (tasks == 1 || work < kSerialWork)
      for (size_t i = 0; i < tasks; ++i) task(&c, i);
    else
      ctx.ParallelFor(task, tasks, 0, &c);
    if (c.failed.load()) throw std::runtime_error("kvserve attention: out of memory");
  }
};

struct Op : Ort::CustomOpBase<Op, Kernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const {
    try {
      Ort::ConstKernelInfo ki(info);
      auto* k = new Kernel();
      k->a.heads = ki.GetAttribute<int64_t>("num_heads");
      k->a.kv_heads = ki.GetAttribute<int64_t>("kv_num_heads");
      k->a.window = ki.GetAttribute<int64_t>("local_window_size");
      k->a.scale = ki.GetAttribute<float>("scale");
      k->a.softcap = ki.GetAttribute<float>("softcap");
      const int64_t G = k->a.kv_heads > 0 ? k->a.heads / k->a.kv_heads : 0;
      if (G < 1 || G > kMaxGroup || G * k->a.kv_heads != k->a.heads) {
        delete k;
        return api.CreateStatus(ORT_INVALID_ARGUMENT, "kvserve attention: unsupported head counts");
      }
      *kernel = k;
    } catch (const std::exception& e) {
      return api.CreateStatus(ORT_INVALID_ARGUMENT, e.what());
    }
    return nullptr;
  }
  const char* GetName() const { return "KVAttention"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 7; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return (i == 3 || i == 4) ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i >= 5 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace

const OrtCustomOp* kvs::attention_op() {
  static const Op op;
  return &op;
}
