"""The prefix cache's device side: a pool of fixed-size KV blocks, and the two copies between a
KV slot and the pool. Which blocks hold which tokens is ``kvserve.server.prefix_cache``'s job.

A block is ``block_tokens`` consecutive rows of every layer's keys and values:
per layer, K and V pools of shape (n_blocks, Hkv, block_tokens, D). The pool is allocated once,
at its full size (``n_blocks`` from the byte cap), so it never grows past the cap; on CPU the
pages of blocks never written are not resident.

``FusedPrefixPool`` keeps the blocks where the fused runner keeps its cache (an OrtValue per
tensor on the provider's device) and copies with two small onnxruntime graphs on the same
provider, so the CPU tests run the code path CUDA runs, and each copy is ONE run for all
layers and all blocks:

- ``save`` (slot rows -> blocks, from any slots at once): per tensor, the whole buffer
  (max_batch, Hkv, C, D) seen as (max_batch * Hkv * C / bt, bt, D) rows of blocks, Gather of
  the m blocks' rows for every head in one index list (host-computed: (slot * Hkv + h) *
  C / bt + j, block-major), Reshape to (m, Hkv, bt, D), ScatterND into the pool at the pool's
  block ids. The ScatterND output is bound to the pool's own memory, which onnxruntime (CPU
  and CUDA) then updates in place instead of copying the pool first. The prompts of a batched
  prefill are saved by one run: 8 prompts of 2 blocks on the 6M bench model took 42 us where
  a run per prompt took 150 us in all (isolated; in the gRPC server's engine, among its
  threads, 0.3-0.6 ms a run).
- ``load`` (blocks -> a slot's first rows): per tensor, Gather of the block ids on axis 0,
  Transpose to (Hkv, m, bt, D), Reshape (Hkv, m * bt, D), Pad to (Hkv, C, D), the output bound
  to the slot's memory. The slot's rows after the prefix are zeroed: ``load`` takes an empty
  slot only (its next rows are prefilled right after).

``NumpyPrefixPool`` is the same for the portable runner's host buffers (numpy copies).

On the host the pool's pages are resident only once written, and the first write into a page
costs a page fault: a 63-block save into never-written blocks took ~1.3 ms on the 6M bench
model against 0.16 ms into blocks written before. ``touch`` writes zeros into free blocks
ahead of use (``PrefixCache.warm``, when the engine is idle), so that a save in the middle of
serving finds its pages resident; on a device (CUDA) the pool is committed when allocated and
``lazy`` is False.
"""
from __future__ import annotations

import ctypes
import logging

import numpy as np

from .base import CAPACITY_CHUNK
from .host_memory import host_memory
from .providers import bound_run

log = logging.getLogger(__name__)

MAX_BLOCK_TOKENS = CAPACITY_CHUNK  # a block must divide the KV capacity chunk


def block_bytes(cfg, block_tokens: int, itemsize: int) -> int:
    """Bytes of one block: K and V rows of every layer."""
    return 2 * cfg.n_layers * cfg.n_kv_heads * block_tokens * cfg.head_dim * itemsize


class _PoolBase:
    def __init__(self, cfg, n_blocks: int, block_tokens: int, itemsize: int):
        if block_tokens < 1 or CAPACITY_CHUNK % block_tokens:
            raise ValueError(f"block_tokens must divide {CAPACITY_CHUNK}, got {block_tokens}")
        if n_blocks < 1:
            raise ValueError("a prefix pool needs at least one block")
        self.cfg, self.n_blocks, self.block_tokens = cfg, n_blocks, block_tokens
        self.block_bytes = block_bytes(cfg, block_tokens, itemsize)

    lazy = True  # host memory: a page is resident once written (``touch``)

    @property
    def nbytes(self) -> int:
        """The pool's memory (allocated once: the gauge ``kvserve_prefix_cache_bytes``)."""
        return self.n_blocks * self.block_bytes

    def touch(self, blocks: list[int]) -> None:
        """Write zeros into ``blocks`` (free ones: their rows are lost), so that their pages are
        resident before a save needs them."""
        ids = sorted(set(blocks))
        if ids and not 0 <= ids[0] <= ids[-1] < self.n_blocks:
            raise ValueError(f"blocks out of range: {ids[0]} .. {ids[-1]} of {self.n_blocks}")
        lo = 0
        for i in range(1, len(ids) + 1):  # runs of consecutive ids: one write per tensor each
            if i == len(ids) or ids[i] != ids[i - 1] + 1:
                self._zero(ids[lo], ids[i - 1] + 1)
                lo = i

    def _zero(self, first: int, end: int) -> None:
        raise NotImplementedError

    def _check_save(self, kv, blocks, pool_blocks) -> None:
        if len(blocks) != len(pool_blocks):
            raise ValueError("one pool block per slot block")
        for slot, j in blocks:
            if not 0 <= slot < len(kv.used) or j < 0:
                raise ValueError(f"no block {j} of slot {slot}")
            if j * self.block_tokens >= kv.used[slot]:  # (a block partly filled is saved
                # whole: the cache's index says how many of its rows count)
                raise ValueError(f"slot {slot} has {kv.used[slot]} rows: block {j} holds none")

    def _check_load(self, kv, slot: int) -> None:
        if kv.used[slot] != 0:
            raise ValueError(f"load into slot {slot}, which holds {kv.used[slot]} rows "
                             "(cached prefixes go into an empty slot)")


class FusedPrefixPool(_PoolBase):
    """Blocks on the fused runner's device (``lm``: a ``FusedLM``)."""

    def __init__(self, lm, n_blocks: int, block_tokens: int):
        super().__init__(lm.cfg, n_blocks, block_tokens, lm.ops.dtype.itemsize)
        import onnxruntime as ort  # (the server's install has it; imported where used)

        self.device, self.dtype = lm.device, lm.ops.dtype
        self.lazy = self.device == "cpu"  # (device memory is committed when allocated)
        cfg = lm.cfg
        shape = (n_blocks, cfg.n_kv_heads, block_tokens, cfg.head_dim)
        self.k = [lm.ops.allocate(shape) for _ in range(cfg.n_layers)]
        self.v = [lm.ops.allocate(shape) for _ in range(cfg.n_layers)]
        self._tensor_block = cfg.n_kv_heads * block_tokens * cfg.head_dim * self.dtype.itemsize
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.intra_op_num_threads = 1
        self._save = ort.InferenceSession(
            _save_graph(2 * cfg.n_layers, self.dtype, cfg.n_kv_heads, block_tokens,
                        cfg.head_dim), so, providers=lm.providers)
        self._load = ort.InferenceSession(_load_graph(2 * cfg.n_layers, self.dtype), so,
                                          providers=lm.providers)
        # each copy's binding of the KV buffers' and the pool's tensors, kept per (graph,
        # buffer generation, slot (loads)): a copy then binds its block indices only (binding
        # every tensor took ~105 us of a ~150 us copy of a few blocks on the 6M bench model);
        # those of an older generation are dropped (they point into freed buffers)
        self._bindings: dict[tuple[str, int, int | None], object] = {}

    def _binding(self, graph: str, kv, slot: int | None = None):
        """The kept binding of ``graph`` ("save": of all of ``kv``'s buffers; "load": of
        ``slot``'s) for ``kv``'s buffers now (its block indices are bound by the caller)."""
        key = (graph, kv.generation, slot)
        b = self._bindings.get(key)
        if b is not None:
            return b
        self._bindings = {k: v for k, v in self._bindings.items() if k[1] == kv.generation}
        cfg, dt, dev, bt = self.cfg, self.dtype, self.device, self.block_tokens
        slot_shape = [cfg.n_kv_heads, kv.capacity, cfg.head_dim]
        blocked = [kv.max_batch * cfg.n_kv_heads * kv.capacity // bt, bt, cfg.head_dim]
        pool_shape = [self.n_blocks, cfg.n_kv_heads, bt, cfg.head_dim]
        b = (self._save if graph == "save" else self._load).io_binding()
        for i, (buf, pool) in enumerate(self._pairs(kv)):
            if graph == "save":
                b.bind_input(f"x{i}", dev, 0, dt, blocked, buf.data_ptr())
                b.bind_input(f"p{i}", dev, 0, dt, pool_shape, pool.data_ptr())
                b.bind_output(f"y{i}", dev, 0, dt, pool_shape, pool.data_ptr())
            else:
                b.bind_input(f"p{i}", dev, 0, dt, pool_shape, pool.data_ptr())
                b.bind_output(f"y{i}", dev, 0, dt, slot_shape, kv.slot_ptr(buf, slot))
        self._bindings[key] = b
        return b

    def _pairs(self, kv):
        return [*zip(kv.k, self.k), *zip(kv.v, self.v)]

    def _zero(self, first: int, end: int) -> None:
        if not self.lazy:
            return
        step = self._tensor_block  # bytes of one block in one (n_blocks, ...) tensor
        for t in (*self.k, *self.v):
            ctypes.memset(t.data_ptr() + first * step, 0, (end - first) * step)

    def save(self, kv, blocks: list[tuple[int, int]], pool_blocks: list[int]) -> None:
        """Copy the row blocks ``blocks`` ((slot, j): rows [j*bt, (j+1)*bt) of that slot, any
        slots; the slot's ``used`` may end inside the block) into the pool's blocks
        ``pool_blocks``: one onnxruntime run."""
        self._check_save(kv, blocks, pool_blocks)
        if not blocks:
            return
        b = self._binding("save", kv)
        heads, per_slot = self.cfg.n_kv_heads, kv.capacity // self.block_tokens
        src = np.asarray(blocks, np.int64)  # (m, 2): slot, j
        rows = (src[:, :1] * heads + np.arange(heads)) * per_slot + src[:, 1:]  # (m, Hkv)
        b.bind_cpu_input("rows", rows.reshape(-1))
        b.bind_cpu_input("ids", np.asarray(pool_blocks, np.int64)[:, None])
        bound_run(self._save, b)()

    def load(self, kv, slot: int, pool_blocks: list[int]) -> None:
        """The empty ``slot``'s first len(pool_blocks) * bt rows from the pool's blocks, in
        order; ``kv.used[slot]`` becomes that: one onnxruntime run."""
        self._check_load(kv, slot)
        if not pool_blocks:
            return
        cfg = self.cfg
        rows = len(pool_blocks) * self.block_tokens
        kv.ensure_capacity(rows + 1)  # (before the binding: it may reallocate)
        b = self._binding("load", kv, slot)
        b.bind_cpu_input("ids", np.asarray(pool_blocks, np.int64))
        b.bind_cpu_input("shape", np.array([cfg.n_kv_heads, rows, cfg.head_dim], np.int64))
        b.bind_cpu_input("pads", np.array([0, 0, 0, 0, kv.capacity - rows, 0], np.int64))
        bound_run(self._load, b)()
        kv.used[slot] = rows

    def block_rows(self, layer: int, block: int) -> tuple[np.ndarray, np.ndarray]:
        """One block's (Hkv, bt, D) keys and values, copied to the host (tests, tools)."""
        return self.k[layer].numpy()[block], self.v[layer].numpy()[block]


def _model(nodes, inputs, outputs, inits=()) -> bytes:
    from onnx import helper

    g = helper.make_graph(nodes, "prefix_pool", inputs, outputs, list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    return m.SerializeToString()


def _save_graph(n: int, dtype, heads: int, bt: int, d: int) -> bytes:
    from onnx import TensorProto, helper

    t = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    shape = helper.make_tensor("blocks", TensorProto.INT64, [4], [-1, heads, bt, d])
    inputs = [helper.make_tensor_value_info("rows", TensorProto.INT64, ["mh"]),
              helper.make_tensor_value_info("ids", TensorProto.INT64, ["m", 1])]
    outputs, nodes = [], []
    for i in range(n):  # x: the whole buffer as rows of blocks (max_batch * h * c / bt, bt, d)
        inputs += [helper.make_tensor_value_info(f"x{i}", t, ["r", bt, d]),
                   helper.make_tensor_value_info(f"p{i}", t, ["nb", heads, bt, d])]
        outputs.append(helper.make_tensor_value_info(f"y{i}", t, ["nb", heads, bt, d]))
        nodes += [helper.make_node("Gather", [f"x{i}", "rows"], [f"g{i}"], axis=0),
                  helper.make_node("Reshape", [f"g{i}", "blocks"], [f"u{i}"]),  # (m, h, bt, d)
                  helper.make_node("ScatterND", [f"p{i}", "ids", f"u{i}"], [f"y{i}"])]
    return _model(nodes, inputs, outputs, [shape])


def _load_graph(n: int, dtype) -> bytes:
    from onnx import TensorProto, helper

    t = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    inputs = [helper.make_tensor_value_info("ids", TensorProto.INT64, ["m"]),
              helper.make_tensor_value_info("shape", TensorProto.INT64, [3]),
              helper.make_tensor_value_info("pads", TensorProto.INT64, [6])]
    outputs, nodes = [], []
    for i in range(n):
        inputs.append(helper.make_tensor_value_info(f"p{i}", t, ["nb", "h", "bt", "d"]))
        outputs.append(helper.make_tensor_value_info(f"y{i}", t, ["h", "c", "d"]))
        nodes += [helper.make_node("Gather", [f"p{i}", "ids"], [f"g{i}"], axis=0),
                  helper.make_node("Transpose", [f"g{i}"], [f"t{i}"], perm=[1, 0, 2, 3]),
                  helper.make_node("Reshape", [f"t{i}", "shape"], [f"r{i}"]),
                  helper.make_node("Pad", [f"r{i}", "pads"], [f"y{i}"])]
    return _model(nodes, inputs, outputs)


class NumpyPrefixPool(_PoolBase):
    """Blocks in host memory for the portable runner's ``KVBuffers`` (numpy copies); ``cfg``
    the model's ``ModelConfig``."""

    def __init__(self, cfg, n_blocks: int, block_tokens: int):
        super().__init__(cfg, n_blocks, block_tokens, np.dtype(np.float32).itemsize)
        shape = (n_blocks, cfg.n_kv_heads, block_tokens, cfg.head_dim)
        self.k = [np.zeros(shape, np.float32) for _ in range(cfg.n_layers)]
        self.v = [np.zeros(shape, np.float32) for _ in range(cfg.n_layers)]

    def _zero(self, first: int, end: int) -> None:
        for pool in (*self.k, *self.v):
            pool[first:end] = 0

    def save(self, kv, blocks: list[tuple[int, int]], pool_blocks: list[int]) -> None:
        self._check_save(kv, blocks, pool_blocks)
        if not blocks:
            return
        bt, cfg = self.block_tokens, self.cfg
        src = np.asarray(blocks, np.int64)
        for buf, pool in (*zip(kv.k, self.k), *zip(kv.v, self.v)):
            blocked = buf[:, :, :kv.capacity].reshape(len(buf), cfg.n_kv_heads, -1, bt,
                                                      cfg.head_dim)
            pool[pool_blocks] = blocked[src[:, 0], :, src[:, 1]]  # (m, Hkv, bt, D)

    def load(self, kv, slot: int, pool_blocks: list[int]) -> None:
        self._check_load(kv, slot)
        if not pool_blocks:
            return
        rows, cfg = len(pool_blocks) * self.block_tokens, self.cfg
        kv.ensure_capacity(rows + 1)
        for buf, pool in (*zip(kv.k, self.k), *zip(kv.v, self.v)):
            buf[slot, :, :rows] = pool[pool_blocks].transpose(1, 0, 2, 3).reshape(
                cfg.n_kv_heads, rows, cfg.head_dim)
        kv.mask[slot, :kv.capacity] = 0
        kv.mask[slot, :rows] = 1
        kv.used[slot] = rows

    def block_rows(self, layer: int, block: int) -> tuple[np.ndarray, np.ndarray]:
        return self.k[layer][block].copy(), self.v[layer][block].copy()


def make_prefix_pool(lm, cap_bytes: int, block_tokens: int):
    """The pool for ``lm``'s kind with as many blocks as ``cap_bytes`` holds (None: not even
    one block fits, i.e. the cache is off). A pool in host memory (the CPU provider, the
    portable runner) of the memory this process may use or more (the machine's, or its control
    group's: a container's limit) raises ``MemoryError`` now: its pages are committed as it
    fills, and the process would be killed then; one larger than the memory free now is
    logged as a warning."""
    itemsize = lm.ops.dtype.itemsize if lm.kind == "fused" else 4
    n = int(cap_bytes) // block_bytes(lm.cfg, block_tokens, itemsize)
    if n < 1:
        return None
    if lm.kind != "fused" or lm.device == "cpu":
        _check_host_memory(int(cap_bytes))
    if lm.kind == "fused":
        return FusedPrefixPool(lm, n, block_tokens)
    return NumpyPrefixPool(lm.cfg, n, block_tokens)


def _check_host_memory(cap_bytes: int) -> None:
    mem = host_memory()
    if mem.limit is not None and cap_bytes >= mem.limit:
        raise MemoryError(f"{mem.source} allows {mem.limit >> 20} MiB")
    if mem.available is not None and cap_bytes > mem.available:
        log.warning("the prefix cache may grow to %d MiB, more than the %d MiB free now (%s "
                    "allows %s): it takes memory as it fills, so a busy server can run out; "
                    "a lower --prefix-cache-mb avoids that", cap_bytes >> 20,
                    mem.available >> 20, mem.source,
                    f"{mem.limit >> 20} MiB" if mem.limit is not None else "an unknown amount")
