"""Clients of the kvserve gRPC service: Python library (sync + asyncio), CLI, batch scoring."""
from .client import (AsyncClient, Client, Completion, GenerateEvent, KvserveError, ModelInfo,
                     RetryPolicy, ScoredToken, ScoreResult, TokenEvent, TopLogprob)

__all__ = ["AsyncClient", "Client", "Completion", "GenerateEvent", "KvserveError", "ModelInfo",
           "RetryPolicy", "ScoredToken", "ScoreResult", "TokenEvent", "TopLogprob"]
