"""A fused artifact's KV cache on the provider's device: ``DeviceKV`` holds, per layer, a
(max_batch, Hkv, capacity, D) key and value buffer allocated by onnxruntime (CPU memory on CPU,
GPU memory on CUDA); slot ``b``'s rows [0, used[b]) are its tokens in order (row index ==
position). Growth, shrinking and slot compaction copy on the device through two tiny graphs
(``KVOps``), so a buffer never travels through the host."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from kvserve.model.config import ModelConfig

from .base import CAPACITY_CHUNK, GENERATIONS, chunks
from .providers import bound_run


class KVOps:
    """Device-side copies between KV buffers: ``resize`` (the slots in use keep their first
    rows, in a buffer of another capacity) and ``copy_slot``. Two tiny graphs on the same
    provider, so a buffer never travels through the host."""

    def __init__(self, providers: list, device: str, dtype):
        self.device, self.dtype = device, np.dtype(dtype)
        t = helper.np_dtype_to_tensor_dtype(self.dtype)
        x = helper.make_tensor_value_info("x", t, ["b", "h", "c", "d"])
        y = helper.make_tensor_value_info("y", t, None)
        ints = [helper.make_tensor_value_info(n, TensorProto.INT64, [k])
                for n, k in (("keep", 1), ("pads", 8))]
        starts = helper.make_tensor("starts", TensorProto.INT64, [1], [0])
        axes = helper.make_tensor("axes", TensorProto.INT64, [1], [2])
        resize = helper.make_graph(
            [helper.make_node("Slice", ["x", "starts", "keep", "axes"], ["kept"]),
             helper.make_node("Pad", ["kept", "pads"], ["y"])],
            "kv_resize", [x, *ints], [y], [starts, axes])
        copy = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "kv_copy", [x],
                                 [y])
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.intra_op_num_threads = 1

        def session(g):
            m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
            m.ir_version = 10
            return ort.InferenceSession(m.SerializeToString(), so, providers=providers)

        self._resize, self._copy = session(resize), session(copy)

    def allocate(self, shape) -> ort.OrtValue:
        return ort.OrtValue.ortvalue_from_shape_and_type(list(shape), self.dtype, self.device,
                                                         0)

    def resize(self, buf: ort.OrtValue, capacity: int, slots: int) -> ort.OrtValue:
        """A new buffer of ``capacity`` rows per slot whose first ``slots`` slots hold the old
        one's rows (as many as fit); the other slots' rows are left unwritten."""
        shape = list(buf.shape())
        old, shape[2] = shape[2], capacity
        out = self.allocate(shape)
        if not slots:
            return out
        keep = min(old, capacity)
        b = self._resize.io_binding()
        b.bind_input("x", self.device, 0, self.dtype, [slots, *shape[1:2], old, *shape[3:]],
                     buf.data_ptr())
        b.bind_cpu_input("keep", np.array([keep], np.int64))
        b.bind_cpu_input("pads", np.array([0, 0, 0, 0, 0, 0, capacity - keep, 0], np.int64))
        b.bind_output("y", self.device, 0, self.dtype, [slots, *shape[1:]], out.data_ptr())
        bound_run(self._resize, b)()
        return out

    def copy_slot(self, buf: ort.OrtValue, src: int, dst: int) -> None:
        shape = [1, *buf.shape()[1:]]
        stride = int(np.prod(shape)) * self.dtype.itemsize
        b = self._copy.io_binding()
        b.bind_input("x", self.device, 0, self.dtype, shape, buf.data_ptr() + src * stride)
        b.bind_output("y", self.device, 0, self.dtype, shape, buf.data_ptr() + dst * stride)
        bound_run(self._copy, b)()


class DeviceKV:
    """Per-layer key/value homes for up to ``max_batch`` sequences, on the provider's device.

    Active sequences occupy the first slots; ``used[b]`` rows of slot b are filled. A free
    slot may keep the rows of the sequence that left it (``retained[b]`` rows: ``retain``),
    which a next sequence with the same prefix takes over (``reuse``). The capacity grows in
    chunks and shrinks when long sequences leave; either copies only the slots up to the last
    one in use or retained (nothing when the cache is empty, as when an idle engine admits a
    request). ``generation`` changes (process-unique) whenever the buffers are reallocated,
    so a cached IO binding is never used with freed buffers.
    """

    def __init__(self, cfg: ModelConfig, ops: KVOps, max_batch: int,
                 capacity: int = CAPACITY_CHUNK):
        self.cfg, self.ops, self.max_batch = cfg, ops, max_batch
        self.capacity = 0
        self.k: list[ort.OrtValue] = []  # per layer (max_batch, Hkv, C, D)
        self.v: list[ort.OrtValue] = []
        self.used = np.zeros(max_batch, dtype=np.int64)
        self.retained = np.zeros(max_batch, dtype=np.int64)  # rows free slots keep (``retain``)
        self.generation = 0
        self._reallocate(chunks(capacity))

    def ensure_capacity(self, needed: int) -> None:
        if needed > self.capacity:
            self._reallocate(chunks(needed))

    def reserve(self, rows: int) -> None:
        """Room for ``rows`` rows per slot now (an admitted request's prompt and new tokens),
        so that decoding never stops to grow the buffers: a step's cost follows ``used``, not
        the capacity, so the room costs memory only."""
        self.ensure_capacity(rows)

    def shrink_to_fit(self, n: int, keep_rows: int = 0) -> None:
        """After sequences left: when the rows still in use by slots [0, n) (and the
        ``keep_rows`` reserved for them) fit in a quarter of the capacity, move them to
        buffers of twice that. Only memory is at stake, so the hysteresis keeps a steady
        workload from growing and shrinking (a device copy and new bindings) with every
        request."""
        target = chunks(max(int(self.used[:n].max()) + 1 if n else 1, keep_rows))
        self.used[n:] = 0
        if target <= self.capacity // 4:
            self._reallocate(2 * target)

    def _reallocate(self, capacity: int) -> None:
        if self.k:  # only the slots up to the last one in use (or retained) are copied
            filled = np.flatnonzero(self.used | self.retained)
            live = int(filled.max()) + 1 if filled.size else 0
            self.k = [self.ops.resize(a, capacity, live) for a in self.k]
            self.v = [self.ops.resize(a, capacity, live) for a in self.v]
            np.minimum(self.retained, capacity, out=self.retained)
        else:
            shape = (self.max_batch, self.cfg.n_kv_heads, capacity, self.cfg.head_dim)
            self.k = [self.ops.allocate(shape) for _ in range(self.cfg.n_layers)]
            self.v = [self.ops.allocate(shape) for _ in range(self.cfg.n_layers)]
        self.capacity = capacity
        self.generation = next(GENERATIONS)

    def clear(self, slot: int) -> None:
        """Empty ``slot`` (its rows are refilled from row 0)."""
        self.used[slot] = 0
        self.retained[slot] = 0

    def retain(self, slot: int, rows: int) -> None:
        """``slot`` is being freed: its first ``rows`` rows stay (copied along when the buffers
        are reallocated) until a sequence takes the slot (``reuse``) or a move overwrites it."""
        self.retained[slot] = min(rows, int(self.used[slot]))

    def reuse(self, slot: int, rows: int) -> None:
        """The free ``slot``'s sequence takes over its first ``rows`` retained rows as its own
        (0: none, the slot is empty); whatever else it kept is dropped."""
        if not 0 <= rows <= self.retained[slot]:
            raise ValueError(f"reuse {rows} rows of slot {slot}: it retains "
                             f"{self.retained[slot]}")
        self.used[slot] = rows
        self.retained[slot] = 0

    def truncate(self, slot: int, rows: int) -> None:
        """Keep the first ``rows`` rows of ``slot`` (rejected draft rows of a verification).
        Nothing is erased: GroupQueryAttention reads a slot's rows [0, seqlens_k] only, and the
        next call writes its new rows from ``used``, over the dropped ones."""
        if not 0 <= rows <= self.used[slot]:
            raise ValueError(f"truncate slot {slot} to {rows} rows: it has {self.used[slot]}")
        self.used[slot] = rows

    def move(self, src: int, dst: int) -> None:
        """Slot ``src`` takes the place of ``dst`` (compaction when a sequence leaves)."""
        if src == dst:
            return
        for buf in (*self.k, *self.v):
            self.ops.copy_slot(buf, src, dst)
        self.used[dst] = self.used[src]
        self.retained[src] = self.retained[dst] = 0

    def slot_rows(self, layer: int, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """The filled rows of one slot, copied to the host (Hkv, used, D) each (tests, tools)."""
        n = int(self.used[slot])
        return (self.k[layer].numpy()[slot, :, :n], self.v[layer].numpy()[slot, :, :n])

    def slice_shape(self, n: int) -> list[int]:
        return [n, self.cfg.n_kv_heads, self.capacity, self.cfg.head_dim]

    def slot_ptr(self, buf: ort.OrtValue, slot: int) -> int:
        stride = self.cfg.n_kv_heads * self.capacity * self.cfg.head_dim
        return buf.data_ptr() + slot * stride * self.ops.dtype.itemsize

    def nbytes(self) -> int:
        per = self.max_batch * self.cfg.n_kv_heads * self.capacity * self.cfg.head_dim
        return 2 * self.cfg.n_layers * per * self.ops.dtype.itemsize
