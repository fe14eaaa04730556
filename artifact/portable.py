"""Running a portable artifact (``kvserve export --portable``: standard ONNX ops only): a
prefill graph, then decode steps. No torch.

The KV cache has one home per layer: ``KVBuffers`` holds a preallocated
(max_batch, Hkv, capacity, D) key and value buffer per layer. The decode graph reads the whole
buffer in place (bound through IO binding, no copy) with an attention mask that marks each
row's valid entries, and returns only the new token's K/V rows, which are written into the
buffer with one indexed assignment per tensor. Nothing is concatenated and nothing is copied
per step except those new rows; the capacity grows in chunks (one copy per chunk).

Active sequences occupy the first ``n`` slots, so a decode step runs on the contiguous
leading slice ``[:n]`` of every buffer; a sequence that leaves is replaced by the last one.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from kvserve.model.config import ModelConfig

from .fused import Prefilled
from .base import CAPACITY_CHUNK, GENERATIONS, ArtifactRunner, chunks
from .providers import bound_run

log = logging.getLogger(__name__)

class KVBuffers:
    """Per-layer key/value homes for up to ``max_batch`` sequences."""

    def __init__(self, cfg: ModelConfig, max_batch: int, capacity: int = CAPACITY_CHUNK,
                 dtype=np.float32):
        self.cfg, self.max_batch, self.dtype = cfg, max_batch, dtype
        self.capacity = 0
        self.k: list[np.ndarray] = []  # per layer (max_batch, Hkv, C, D)
        self.v: list[np.ndarray] = []
        self.mask = np.zeros((max_batch, 1), dtype=np.int64)  # (max_batch, C + 1)
        self.used = np.zeros(max_batch, dtype=np.int64)  # buffer rows filled per slot
        self.retained = np.zeros(max_batch, dtype=np.int64)  # rows free slots keep (``retain``)
        self.generation = 0  # changes (process-unique) whenever the buffers are reallocated
        self.ensure_capacity(capacity)

    def ensure_capacity(self, needed: int) -> None:
        if needed > self.capacity:
            self._reallocate(chunks(needed))

    def reserve(self, rows: int) -> None:
        """Nothing: every decode step of the portable graph attends over the whole capacity,
        so it grows only as rows are filled (the fused cache reserves a request's rows)."""

    def shrink_to_fit(self, n: int, keep_rows: int = 0) -> None:
        """After sequences left: when the rows still in use by slots [0, n) fit in half the
        capacity, move them to smaller buffers. Every decode step attends over the whole
        capacity, so one long request that finished must not slow the rest down (rows
        reserved for later, ``keep_rows``, are not kept: they would cost every step)."""
        target = chunks(int(self.used[:n].max()) + 1 if n else 1)
        if target <= self.capacity // 2:
            self.mask[n:] = 0  # free slots hold nothing
            self.used[n:] = 0
            self._reallocate(target)

    def _reallocate(self, new_cap: int) -> None:
        """New (max_batch, Hkv, new_cap, D) buffers keeping the first min(old, new) rows."""
        cfg, B = self.cfg, self.max_batch
        keep = min(self.capacity, new_cap)
        shape = (B, cfg.n_kv_heads, new_cap, cfg.head_dim)

        def resized(old: np.ndarray | None) -> np.ndarray:
            new = np.zeros(shape, self.dtype)
            if old is not None:
                new[:, :, :keep] = old[:, :, :keep]
            return new

        self.k = [resized(a) for a in (self.k or [None] * cfg.n_layers)]
        self.v = [resized(a) for a in (self.v or [None] * cfg.n_layers)]
        mask = np.zeros((B, new_cap + 1), dtype=np.int64)
        mask[:, :keep] = self.mask[:, :keep]
        mask[:, new_cap] = 1  # the column of the token being decoded
        self.mask, self.capacity = mask, new_cap
        np.minimum(self.retained, keep, out=self.retained)
        self.generation = next(GENERATIONS)

    def load_prompt(self, slot: int, present: list[np.ndarray], row: int, length: int) -> None:
        """Copy one prefilled sequence into ``slot``: ``present`` is the flat list of prefill
        outputs (2L arrays (B, Hkv, T, D)); its last ``length`` positions of batch ``row`` are
        the real (left-padded) tokens."""
        self.ensure_capacity(length + 1)
        T = present[0].shape[2]
        for i in range(self.cfg.n_layers):
            self.k[i][slot, :, :length] = present[2 * i][row, :, T - length:]
            self.v[i][slot, :, :length] = present[2 * i + 1][row, :, T - length:]
        self.mask[slot, :self.capacity] = 0
        self.mask[slot, :length] = 1
        self.used[slot] = length

    def append(self, n: int, new_rows: list[np.ndarray]) -> None:
        """Write the new token's K/V of slots [0, n) at each slot's next row."""
        rows = self.used[:n]
        b = np.arange(n)
        for i in range(self.cfg.n_layers):
            self.k[i][b, :, rows] = new_rows[2 * i][:n, :, 0]  # (n, Hkv, D)
            self.v[i][b, :, rows] = new_rows[2 * i + 1][:n, :, 0]
        self.mask[b, rows] = 1
        self.used[:n] += 1

    def clear(self, slot: int) -> None:
        """Empty ``slot`` (its rows are refilled from row 0: a LongRoPE row crossing)."""
        self.mask[slot, :self.capacity] = 0
        self.used[slot] = 0
        self.retained[slot] = 0

    def retain(self, slot: int, rows: int) -> None:
        """``slot`` is being freed: its first ``rows`` rows stay (as ``DeviceKV.retain``)."""
        self.retained[slot] = min(rows, int(self.used[slot]))

    def reuse(self, slot: int, rows: int) -> None:
        """The free ``slot``'s sequence takes over its first ``rows`` retained rows (0: none)."""
        if not 0 <= rows <= self.retained[slot]:
            raise ValueError(f"reuse {rows} rows of slot {slot}: it retains "
                             f"{self.retained[slot]}")
        self.mask[slot, :self.capacity] = 0
        self.mask[slot, :rows] = 1
        self.used[slot] = rows
        self.retained[slot] = 0

    def truncate(self, slot: int, rows: int) -> None:
        """Keep the first ``rows`` rows of ``slot`` (rejected draft rows): the mask drops the
        others, so no later call attends to them; the next rows are written over them."""
        if not 0 <= rows <= self.used[slot]:
            raise ValueError(f"truncate slot {slot} to {rows} rows: it has {self.used[slot]}")
        self.mask[slot, rows:self.capacity] = 0
        self.used[slot] = rows

    def move(self, src: int, dst: int) -> None:
        """Slot ``src`` takes the place of ``dst`` (compaction when a sequence leaves)."""
        if src == dst:
            return
        L = int(self.used[src])
        for i in range(self.cfg.n_layers):
            self.k[i][dst, :, :L] = self.k[i][src, :, :L]
            self.v[i][dst, :, :L] = self.v[i][src, :, :L]
        self.mask[dst] = self.mask[src]
        self.used[dst] = L
        self.retained[src] = self.retained[dst] = 0

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v)


@dataclass
class PrefillResult:
    logits: np.ndarray  # (B, T, V)
    present: list[np.ndarray]  # 2L x (B, Hkv, T, D)
    attentions: list[np.ndarray] | None  # L x (B, H, T, T)


class PortableLM(ArtifactRunner):
    """The portable graphs of one artifact directory, run by onnxruntime, with the same
    interface as ``FusedLM`` (``new_cache`` / ``prefill`` / ``extend`` / ``decode``)."""
    kind = "portable"

    def __init__(self, artifact_dir: str | Path, provider: str = "auto",
                 threads: int | None = None, attention: bool = True, spin: bool = True,
                 tf32: bool = False, options: ort.SessionOptions | None = None,
                 attention_copy: bool = False):
        super().__init__(artifact_dir, provider, threads, spin, tf32, options, attention_copy)
        self.sessions: dict[str, ort.InferenceSession] = {}
        graphs = self.manifest["graphs"]
        names = ["prefill", "decode"] + (["prefill_attn", "decode_attn"]
                                         if attention and "decode_attn" in graphs else [])
        for name in names:
            path = self.dir / graphs[name]["file"]
            so = self.diagnostics_options if name.endswith("_attn") else self.options
            self.sessions[name] = ort.InferenceSession(str(path), so, providers=self.providers)
        self.provider = self.sessions["decode"].get_providers()[0]
        # a binding made once sees in-place updates of host arrays only on the CPU provider;
        # elsewhere onnxruntime copies a host input when it is bound, so rebind every step
        self._rebind = self.provider != "CPUExecutionProvider"
        names = (self.manifest.get("runtime") or {}).get("names") or {
            "past_key": "past_key_values.%d.key", "past_value": "past_key_values.%d.value",
            "present_key": "present.%d.key", "present_value": "present.%d.value",
            "attn_weights": "attn_weights.%d"}
        L = self.cfg.n_layers
        self.present_names = [names[f"present_{kv}"] % i for i in range(L)
                              for kv in ("key", "value")]
        self.past_names = [names[f"past_{kv}"] % i for i in range(L) for kv in ("key", "value")]
        self.attn_names = [names["attn_weights"] % i for i in range(L)]
        self._bound: dict[tuple, tuple] = {}

    last_rows = False  # the graphs compute every row's logits (prefill(last=True) slices)

    @property
    def has_attention(self) -> bool:
        return "decode_attn" in self.sessions

    @property
    def attention_ready(self) -> bool:
        return self.has_attention

    def new_cache(self, max_batch: int, capacity: int = CAPACITY_CHUNK) -> KVBuffers:
        return KVBuffers(self.cfg, max_batch, capacity)

    # --- prefill -----------------------------------------------------------------------------
    def run_prefill(self, input_ids: np.ndarray, attention_mask: np.ndarray,
                    position_ids: np.ndarray | None = None, attention: bool = False
                    ) -> PrefillResult:
        """The prefill graph as exported: input_ids, attention_mask (B, T) int64,
        left-padded."""
        if position_ids is None:
            position_ids = np.clip(np.cumsum(attention_mask, axis=1) - 1, 0, None)
        sess = self.sessions["prefill_attn" if attention else "prefill"]
        outs = sess.run(None, {"input_ids": input_ids.astype(np.int64, copy=False),
                               "attention_mask": attention_mask.astype(np.int64, copy=False),
                               "position_ids": position_ids.astype(np.int64, copy=False)})
        L2 = 2 * self.cfg.n_layers
        return PrefillResult(outs[0], outs[1:1 + L2], outs[1 + L2:] if attention else None)

    def prefill(self, kv: KVBuffers, lo: int, prompts: list, attention: bool = False,
                last: bool = False) -> Prefilled:
        """New sequences into slots lo, lo+1, ... (left-padded through the prefill graph).
        ``last``: each prompt's logits are its last row (1, V) (the graph computes them all)."""
        lens = [len(p) for p in prompts]
        T = max(lens)
        ids = np.full((len(prompts), T), self.cfg.pad_token_id or 0, np.int64)
        mask = np.zeros((len(prompts), T), np.int64)
        for b, p in enumerate(prompts):
            ids[b, T - len(p):] = p
            mask[b, T - len(p):] = 1
        res = self.run_prefill(ids, mask, attention=attention)
        for b, n in enumerate(lens):
            kv.load_prompt(lo + b, res.present, b, n)
        logits = [res.logits[b, T - 1:] if last else res.logits[b, T - n:]
                  for b, n in enumerate(lens)]
        attn = None
        if attention:
            attn = [np.stack([a[b, :, T - n:, T - n:] for a in res.attentions])
                    for b, n in enumerate(lens)]
        return Prefilled(logits, attn)

    # --- decode ------------------------------------------------------------------------------
    def decode(self, kv: KVBuffers, n: int, tokens: np.ndarray, attention: bool = False
               ) -> tuple[np.ndarray, list[np.ndarray] | None]:
        """One step for slots [0, n): tokens (n,) (ints: a list or an int64 array) at
        positions ``kv.used``.

        Returns logits (n, V) (a view into a reused buffer: copy what you keep) and, when
        asked, per slot its attention (L, H, T_b) over its T_b tokens (the new one last).
        """
        used = kv.used[:n].copy()
        kv.ensure_capacity(int(used.max()) + 1)
        name = "decode_attn" if attention else "decode"
        binding, ids, pos, logits, rows = self._binding(name, kv, n)
        ids[:, 0] = tokens
        pos[:, 0] = used
        if self._rebind:
            self._bind_inputs(binding, kv, n, ids, pos)
        t0 = time.perf_counter()
        bound_run(self.sessions[name], binding)()
        self.ort_seconds += time.perf_counter() - t0
        kv.append(n, rows)
        attn = None
        if attention:
            outs = binding.get_outputs()
            first = 1 + len(rows)
            a = [outs[first + i].numpy() for i in range(self.cfg.n_layers)]
            cap = kv.capacity
            attn = [np.stack([np.concatenate([x[b, :, 0, :used[b]], x[b, :, 0, cap:cap + 1]],
                                             -1) for x in a]) for b in range(n)]
        return logits[:, 0], attn

    def extend(self, kv: KVBuffers, slot: int, tokens, rope_length: int | None = None,
               last: bool = False) -> np.ndarray:
        """Feed a chunk of T tokens to one slot through the decode graph (chunked prefill of a
        long prompt or a long Score input): the slot's rows so far are the past, the chunk's
        K/V rows are written after them. Returns the chunk's logits (T, V) (``last``: (1, V)).

        ``rope_length``: choose the RoPE factors as for a sequence of that many tokens (LongRoPE
        decides per row from the largest position id in the call, masked columns included): a
        masked probe column at position ``rope_length - 1`` follows the chunk, and its outputs
        are dropped (``kvserve.artifact.longrope``)."""
        T = len(tokens)
        start = int(kv.used[slot])
        kv.ensure_capacity(start + T + 1)
        C = kv.capacity
        positions = start + np.arange(T, dtype=np.int64)  # a slot's rows are all real tokens
        new_mask = np.ones((1, T), np.int64)
        ids = np.asarray(tokens, np.int64)
        if rope_length is not None and rope_length > start + T:
            positions = np.append(positions, rope_length - 1)
            new_mask = np.append(new_mask, [[0]], 1)
            ids = np.append(ids, self.cfg.pad_token_id or 0)
        mask = np.concatenate([kv.mask[slot:slot + 1, :C], new_mask], 1)
        feeds = {"input_ids": ids[None],
                 "attention_mask": mask,  # (1, C + T [+ 1])
                 "position_ids": positions[None]}
        for i in range(self.cfg.n_layers):
            feeds[self.past_names[2 * i]] = kv.k[i][slot:slot + 1]  # (1, Hkv, C, D), no copy
            feeds[self.past_names[2 * i + 1]] = kv.v[i][slot:slot + 1]
        outs = self.sessions["decode"].run(None, feeds)
        for i in range(self.cfg.n_layers):
            kv.k[i][slot, :, start:start + T] = outs[1 + 2 * i][0, :, :T]  # (Hkv, T, D)
            kv.v[i][slot, :, start:start + T] = outs[2 + 2 * i][0, :, :T]
        kv.mask[slot, start:start + T] = 1
        kv.used[slot] = start + T
        return outs[0][0, T - 1:T] if last else outs[0][0, :T]  # (T, V)

    @property
    def supports_verify(self) -> bool:
        """Speculative verification (``verify``): not for LongRoPE models (a verification's
        rows could cross the factors' switch, which the engine handles before plain steps)."""
        return self.cfg.longrope_limit is None

    def verify(self, kv: KVBuffers, n: int, rows: list) -> np.ndarray:
        """``FusedLM.verify``'s contract, one ``extend`` (one decode-graph run) per slot: the
        portable decode graph takes one query length per call. So a verification costs n runs
        over each slot's whole capacity, against one step's single run for the batch: it pays
        at batch 1 when drafts are accepted, rarely in a batch (the engine's adaptive K)."""
        if not self.supports_verify:
            raise NotImplementedError("speculative verification is off for LongRoPE models")
        lens = [len(r) for r in rows]
        if len(rows) != n or not all(lens):
            raise ValueError("verify needs one non-empty row per slot")
        out = np.zeros((n, max(lens), self.cfg.vocab_size), np.float32)
        for b, r in enumerate(rows):
            out[b, :lens[b]] = self.extend(kv, b, r)
        return out

    def _bind_inputs(self, b, kv: KVBuffers, n: int, ids, pos) -> None:
        b.bind_cpu_input("input_ids", ids)
        b.bind_cpu_input("position_ids", pos)
        b.bind_cpu_input("attention_mask", kv.mask[:n])
        for i in range(self.cfg.n_layers):
            b.bind_cpu_input(self.past_names[2 * i], kv.k[i][:n])
            b.bind_cpu_input(self.past_names[2 * i + 1], kv.v[i][:n])

    def _binding(self, name: str, kv: KVBuffers, n: int):
        """IO binding for (graph, batch n, buffer generation), built once and reused: the
        inputs are the KV buffers themselves; the outputs are preallocated arrays."""
        key = (name, n, kv.generation)  # generation is unique per buffer set (see above)
        hit = self._bound.get(key)
        if hit is not None:
            return hit
        # a binding holds its buffers alive: drop those of reallocated (older) buffer sets
        self._bound = {k: v for k, v in self._bound.items() if k[2] == kv.generation}
        self.bindings_built += 1
        sess, cfg = self.sessions[name], self.cfg
        b = sess.io_binding()
        ids = np.zeros((n, 1), np.int64)
        pos = np.zeros((n, 1), np.int64)
        self._bind_inputs(b, kv, n, ids, pos)
        logits = np.zeros((n, 1, cfg.vocab_size), np.float32)
        rows = [np.zeros((n, cfg.n_kv_heads, 1, cfg.head_dim), np.float32)
                for _ in range(2 * cfg.n_layers)]
        for arr, out_name in [(logits, "logits"), *zip(rows, self.present_names)]:
            b.bind_output(out_name, "cpu", 0, np.float32, list(arr.shape), arr.ctypes.data)
        if name == "decode_attn":
            for out_name in self.attn_names:
                b.bind_output(out_name, "cpu")
        self._bound[key] = (b, ids, pos, logits, rows)
        return self._bound[key]
