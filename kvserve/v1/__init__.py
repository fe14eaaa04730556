"""Generated gRPC stubs for kvserve.v1 (from protos/kvserve/v1 by the build)."""
