"""An engine's model calls, recorded and replayed without it: the runner calls (prefill,
decode, verify: their arguments, each slot's rows before the call, the logits that came back)
and the cache operations the engine made between them (slot moves, reallocations), in order.
Replayed on a fresh cache of the same runner, a call sequence gives the logits it gave in the
engine where the runtime computes a call the same way every time (on the CPU: bit for bit, a
test); where a replay differs from the engine's run or from another replay, what varies lies
below the engine's scheduling: in the runner's calls into onnxruntime (the CUDA check's
``engine_repeatability``; on an H200 with onnxruntime-gpu 1.31.1, fp16:
bench/results/cuda-repeat.json).

What is recorded: the fused runner's calls and the cache's moves and reallocations, with each
slot's rows (``used``, ``retained``) before each. That is the whole cache state of an engine
with the prefix cache off; the pool's copies into a slot, and the portable runner's own
``extend`` and attention mask, are not recorded: such engines are refused.
"""
from __future__ import annotations

import numpy as np

CALLS = ("prefill", "decode", "verify")
CACHE_OPS = ("move", "_reallocate")


def _logits(name: str, out) -> np.ndarray:
    """A call's logits as one float32 array (a copy: the runner's buffers are reused)."""
    lg = out.logits if name == "prefill" else (out[0] if name == "decode" else out)
    if isinstance(lg, list):
        lg = np.stack([np.asarray(x) for x in lg])
    return np.array(lg, np.float32)


class Recording:
    """Installs itself on a started engine's runner and cache (``Engine.runner``): every call
    and cache operation from then on, the ones made inside a call (a runner growing the cache,
    a prefill going a row at a time) left to the replay to repeat."""

    def __init__(self, engine):
        self.sched = engine.runner.sched
        self.lm, self.kv = engine.runner.lm, self.sched.kv
        if engine.runner.prefix is not None:
            raise ValueError("the engine has a prefix cache: its copies into slots are not "
                             "recorded (make the engine with --prefix-cache-mb 0)")
        if getattr(self.lm, "kind", None) != "fused":
            raise ValueError(f"a {getattr(self.lm, 'kind', '?')} runner: only the fused "
                             f"runner's cache state is recorded")
        self.capacity, self.max_batch = int(self.kv.capacity), self.kv.max_batch
        self.ops: list[dict] = []
        self.logits: list[np.ndarray] = []
        self._depth = 0
        # (whether each was the object's own attribute: a method of its class is uncovered
        # again on stop, not set on the object)
        self._originals = [(o, name, vars(o).get(name)) for o, names in
                           ((self.lm, CALLS), (self.kv, CACHE_OPS)) for name in names]
        for name in CALLS:
            setattr(self.lm, name, self._call(name, getattr(self.lm, name)))
        for name in CACHE_OPS:
            setattr(self.kv, name, self._cache_op(name, getattr(self.kv, name)))

    def stop(self) -> "Recording":
        """The runner and cache as they were: nothing more is recorded. Raises where the
        engine replaced its cache meanwhile (a failed iteration): the recording is not whole."""
        for obj, name, own in self._originals:
            if own is None:
                vars(obj).pop(name, None)
            else:
                setattr(obj, name, own)
        if self.sched.kv is not self.kv:
            raise RuntimeError("the engine replaced its KV cache while recording (a failed "
                               "iteration): the recording is not whole")
        return self

    def _state(self, kv) -> dict:
        return {"used": kv.used.copy(), "retained": kv.retained.copy()}

    def _call(self, name: str, f):
        def call(kv, *a, **k):
            top = self._depth == 0 and kv is self.kv  # (not a Score job's private cache)
            if top:
                self.ops.append({"op": name, "args": _copy(a), "kw": dict(k), **self._state(kv)})
            self._depth += 1
            try:
                out = f(kv, *a, **k)
            finally:
                self._depth -= 1
            if top:
                self.logits.append(_logits(name, out))
            return out
        return call

    def _cache_op(self, name: str, f):
        def op(*a):
            if self._depth == 0:
                self.ops.append({"op": name, "args": list(a), "kw": {}, **self._state(self.kv)})
            return f(*a)
        return op


def _copy(args) -> list:
    """A call's arguments, detached from the engine's lists and arrays."""
    out = []
    for x in args:
        if isinstance(x, np.ndarray):
            out.append(x.copy())
        elif isinstance(x, list):
            out.append([list(r) if isinstance(r, (list, np.ndarray)) else r for r in x])
        else:
            out.append(x)
    return out


def replay(lm, rec: Recording) -> list[np.ndarray]:
    """The recorded sequence on a fresh cache of ``lm`` (each op after the slots' rows are set
    as they were): each call's logits."""
    kv = lm.new_cache(rec.max_batch, capacity=rec.capacity)
    out = []
    for op in rec.ops:
        kv.used[:], kv.retained[:] = op["used"], op["retained"]
        if op["op"] in CACHE_OPS:
            getattr(kv, op["op"])(*op["args"])
        else:
            out.append(_logits(op["op"], getattr(lm, op["op"])(kv, *op["args"], **op["kw"])))
    return out


def differing(a: list[np.ndarray], b: list[np.ndarray]) -> dict:
    """How many calls' logits differ between two runs of one sequence, the first of them,
    and the largest difference."""
    if len(a) != len(b):
        raise ValueError(f"{len(a)} calls against {len(b)}")
    apart = [i for i, (x, y) in enumerate(zip(a, b)) if x.shape != y.shape
             or not np.array_equal(x, y)]
    worst = max((float(np.abs(a[i] - b[i]).max()) for i in apart
                 if a[i].shape == b[i].shape), default=0.0)
    return {"calls": len(a), "differing": len(apart), "first": apart[0] if apart else None,
            "max_abs_logit": worst}
