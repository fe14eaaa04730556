"""Torch references and small client helpers for the server tests."""
from __future__ import annotations

import contextlib

import numpy as np
import torch

from kvserve.model.generate import generate
from kvserve.model.sampling import SamplingParams, log_softmax
from kvserve.v1 import inference_pb2 as pb


def gen_request(prompt, max_new_tokens=16, *, ignore_eos=True, sampling=None, stop=(),
                stop_token_ids=(), min_new_tokens=0, **response):
    r = pb.GenerateRequest(
        stopping=pb.StoppingOptions(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos,
                                    stop=list(stop), stop_token_ids=list(stop_token_ids),
                                    min_new_tokens=min_new_tokens),
        sampling=sampling or pb.SamplingOptions(),
        response=pb.ResponseOptions(**response))
    if isinstance(prompt, str):
        r.text = prompt
    else:
        r.token_ids.ids.extend(prompt)
    return r


def collect(stream):
    chunks, complete = [], None
    for msg in stream:
        if msg.HasField("chunk"):
            assert complete is None
            chunks.append(msg.chunk)
        else:
            assert complete is None
            complete = msg.complete
    assert complete is not None, "the stream ended without a Complete event"
    return chunks, complete


def torch_generate(model, ids, n, params=SamplingParams()):
    return generate(model, [list(ids)], n, params).tokens[0]


@torch.no_grad()
def torch_step_logits(model, ids) -> np.ndarray:
    """Logits predicting the token after ``ids`` (full forward, no cache)."""
    x = torch.tensor([list(ids)])
    return model(x).logits[0, -1].float().numpy()


@torch.no_grad()
def torch_logprobs(model, ids) -> np.ndarray:
    """(T-1,) log p(ids[t] | ids[:t])."""
    x = torch.tensor([list(ids)])
    lp = log_softmax(model(x).logits[0].float().numpy())
    return lp[np.arange(len(ids) - 1), np.asarray(ids[1:])]


def to_params(s: pb.SamplingOptions) -> SamplingParams:
    return SamplingParams(
        temperature=s.temperature, top_k=s.top_k, top_p=s.top_p if s.HasField("top_p") else 1.0,
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        seed=s.seed if s.HasField("seed") else None)


# (tests/server/conftest.py keeps its own copies for tests/clients, which load that file by
# path; the test modules here import from this uniquely named module instead of `conftest`.)
def server_config(**kw):
    from kvserve.server.config import ServerConfig

    base = dict(host="127.0.0.1", port=0, metrics_port=-1, threads=1, max_batch=4,
                max_queue=16, drain_grace=2.0)
    base.update(kw)
    return ServerConfig(**base)


@contextlib.contextmanager
def running_app(artifact, **kw):
    """A real server (App) on a free loopback port; drained on exit."""
    from kvserve.server.app import App

    app = App(artifact.dir, server_config(**kw))
    app.load()
    app.start()
    try:
        yield app
    finally:
        app.drain(0.5)
