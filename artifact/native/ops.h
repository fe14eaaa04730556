// The custom ops of kvserve's native library (domain ai.kvserve), registered by library.cc.
#pragma once

struct OrtCustomOp;

namespace kvs {

const OrtCustomOp* attention_op();  // KVAttention (attention.cc)
const OrtCustomOp* swiglu_op();     // SwiGLU (swiglu.cc)

}  // namespace kvs
