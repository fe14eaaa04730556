// The entry point onnxruntime calls when a session registers kvserve's native library
// (SessionOptions.register_custom_ops_library): the ops of ops.h in the domain ai.kvserve.
// Built against onnxruntime's 1.21 API headers (API version 21), which every later onnxruntime
// serves.
#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT

#include <mutex>
#include <vector>

#include "ops.h"

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL
RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) {  // an onnxruntime older than 1.21: say so through its first API
    const OrtApi* first = api_base->GetApi(1);
    return first ? first->CreateStatus(ORT_FAIL, "kvserve's native library needs onnxruntime "
                                                 ">= 1.21") : nullptr;
  }
  Ort::InitApi(api);
  static std::vector<Ort::CustomOpDomain> domains;  // alive as long as the sessions
  static std::mutex lock;
  try {
    Ort::CustomOpDomain domain("ai.kvserve");
    domain.Add(kvs::attention_op());
    domain.Add(kvs::swiglu_op());
    Ort::UnownedSessionOptions(options).Add(domain);
    std::lock_guard<std::mutex> guard(lock);
    domains.push_back(std::move(domain));
  } catch (const std::exception& e) {
    return api->CreateStatus(ORT_FAIL, e.what());
  }
  return nullptr;
}
