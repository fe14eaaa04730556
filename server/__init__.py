"""The gRPC service on onnxruntime. No torch anywhere in this package."""
