// SwiGLU for the fused graph's gated feed-forward: x (..., 2F) holding [gate; up] gives
// silu(gate) * up (..., F), silu(g) = g / (1 + e^-g). It takes the place of the four ops the
// export writes for it (Split, Sigmoid, Mul, Mul), which onnxruntime runs as three kernels
// (Split, QuickGelu, Mul), each a pass over the activations and a dispatch of its own: at a
// decode step, a few thousand floats a layer, the dispatches are the cost.
// artifact/native_swiglu.py rewrites the graph and checks this op against those ops on load.
//
// Element-wise: a row's values do not depend on the call's other rows or its shape.
#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace {

using namespace kvs;

constexpr int64_t kSerialFloats = 1 << 16;  // below this many outputs a call, no pool
constexpr int64_t kRowsPerTask = 8;

struct Rows {
  const float* x;
  float* out;
  int64_t rows, F;
};

inline v8 silu_times(v8 g, v8 u) {
  return g / (splat(1.f) + exp8(splat(0.f) - g)) * u;
}

void rows_task(void* data, size_t index) {
  const Rows& r = *static_cast<const Rows*>(data);
  const int64_t r0 = static_cast<int64_t>(index) * kRowsPerTask;
  const int64_t r1 = std::min(r.rows, r0 + kRowsPerTask), F = r.F;
  for (int64_t row = r0; row < r1; ++row) {
    const float* g = r.x + row * 2 * F;
    const float* u = g + F;
    float* o = r.out + row * F;
    int64_t i = 0;
    for (; i + 8 <= F; i += 8) store8(o + i, silu_times(load8(g + i), load8(u + i)));
    for (; i < F; ++i) o[i] = silu_times(splat(g[i]), splat(u[i]))[0];
  }
}

struct Kernel {
  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    try {
      Ort::KernelContext ctx(context);
      auto x = ctx.GetInput(0);
      auto shape = x.GetTensorTypeAndShapeInfo().GetShape();
      if (shape.empty() || shape.back() % 2)
        throw std::runtime_error("kvserve SwiGLU: the last axis must hold [gate; up]");
      const int64_t F = shape.back() / 2;
      int64_t rows = 1;
      for (size_t i = 0; i + 1 < shape.size(); ++i) rows *= shape[i];
      shape.back() = F;
      auto out = ctx.GetOutput(0, shape);
      Rows r{x.GetTensorData<float>(), out.GetTensorMutableData<float>(), rows, F};
      const size_t tasks = static_cast<size_t>((rows + kRowsPerTask - 1) / kRowsPerTask);
      if (rows * F < kSerialFloats || tasks < 2)
        for (size_t t = 0; t < tasks; ++t) rows_task(&r, t);
      else
        ctx.ParallelFor(rows_task, tasks, 0, &r);
    } catch (const std::exception& e) {
      return Ort::GetApi().CreateStatus(ORT_INVALID_ARGUMENT, e.what());
    }
    return nullptr;
  }
};

struct Op : Ort::CustomOpBase<Op, Kernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi&, const OrtKernelInfo*, void** kernel) const {
    *kernel = new Kernel();
    return nullptr;
  }
  const char* GetName() const { return "SwiGLU"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace

const OrtCustomOp* kvs::swiglu_op() {
  static const Op op;
  return &op;
}
