"""Clients of the kvserve gRPC service: Python library (sync + asyncio), CLI, batch scoring."""
