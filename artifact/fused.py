"""Running a fused artifact: one graph for prefill, chunked prefill and decode; the KV cache one
device-resident buffer per layer that GroupQueryAttention writes in place.

``DeviceKV`` holds, per layer, a (max_batch, Hkv, capacity, D) key and value buffer allocated by
onnxruntime on the provider's device (CPU memory on CPU, GPU memory on CUDA). Slot ``b``'s rows
[0, used[b]) are its tokens in order (row index == position). A call feeds, per slot, only its
new token ids and three counters (``seqlens_k``, ``query_seqlens``, ``total_sequence_length``);
the op reads the past rows and writes the new ones in place, so no cache is copied on any
provider. Buffers are bound to an IO binding once per (batch slice, buffer generation); growth
and slot compaction copy on the device through two tiny graphs (``KVOps``; both in
``device_kv``).

The same code runs on CPU and CUDA; only where an OrtValue lives differs (``device``).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort


from .base import CAPACITY_CHUNK, ArtifactRunner
from . import gqa_compat, native_attention
from .device_kv import DeviceKV, KVOps
from .gqa_compat import gqa_takes_query_seqlens
from .providers import bound_run, device_of, input_homes
from .spec import INPUT_IDS, QUERY_SEQLENS, SEQLENS_K, TOTAL_SEQUENCE_LENGTH, fused_spec_from

log = logging.getLogger(__name__)

_DTYPES = {"float32": np.float32, "float16": np.float16}
_INT = struct.Struct("i")  # total_sequence_length, a 0-d int32 array
_KEPT_PREFILLS = 64  # last-row prefill bindings kept (per slot range; all dropped past this)


# decode and verify write their ids and counters with struct (one C call each, into the
# arrays' buffers): numpy's ufunc machinery, run right after onnxruntime has evicted the
# caches, cost ~10-30 us a call on the 2-core bench machine, a good part of a small model's step
@functools.lru_cache(maxsize=256)
def _longs(n: int) -> struct.Struct:
    """n int64s (token ids, ``kv.used``)."""
    return struct.Struct(f"{n}q")


@functools.lru_cache(maxsize=64)
def _ints(n: int) -> struct.Struct:
    """n int32s (the graph's per-row counters)."""
    return struct.Struct(f"{n}i")


@dataclass
class Prefilled:
    logits: list[np.ndarray]  # per sequence (T_b, V): row t predicts token t + 1
    attention: list[np.ndarray] | None  # per sequence (L, H, T_b, T_b), when asked


@contextlib.contextmanager
def _all_or_none(kv: DeviceKV, lo: int, n: int):
    """Calls made a row at a time for slots [lo, lo + n): if one fails, the slots' row counts
    go back to where they were (as one call's failure leaves them; the rows written past them
    are never read)."""
    before = kv.used[lo:lo + n].copy()
    try:
        yield
    except BaseException:
        kv.used[lo:lo + n] = before
        raise


class _Bound:
    """One IO binding of the graph over slots [lo, lo + n) with S new tokens per slot: the KV
    slices bound in place, logits into a preallocated host array, and the small inputs as
    host arrays behind OrtValues, each where the session reads it (``FusedLM.homes``: a CUDA
    kernel may read an input in host memory, as GroupQueryAttention does its counters). An
    OrtValue in host memory shares its array (a write to the array is the update); one on the
    device is refreshed from it (``update_inplace``, a few bytes) before each run. (A value
    bound where the session does not read it is copied there when it is bound, not at each
    run; where this onnxruntime cannot say where it reads them, the inputs are bound again
    before each run.)

    ``last``: logits for each slot's last new token only (``rows`` is set per call), where the
    graph takes ``logits_rows``; otherwise for all S positions (``rows`` = 0..S-1, fixed)."""

    def __init__(self, lm: "FusedLM", sess: ort.InferenceSession, kv: DeviceKV, lo: int,
                 n: int, S: int, attention: bool, last: bool):
        lm.bindings_built += 1
        spec, cfg = lm.spec_for(attention), lm.cfg
        self.binding = b = sess.io_binding()
        self.ids = np.zeros((n, S), np.int64)
        self.seqlens = np.zeros(n, np.int32)
        self.qlens = np.zeros(n, np.int32)
        self.total = np.zeros((), np.int32)
        arrays = {INPUT_IDS: self.ids, SEQLENS_K: self.seqlens, QUERY_SEQLENS: self.qlens,
                  TOTAL_SEQUENCE_LENGTH: self.total}
        R = S
        self.rows: np.ndarray | None = None
        if spec.logits_rows:
            R = 1 if last else S
            self.rows = np.zeros((n, R), np.int64)
            self.rows[:] = np.arange(R)  # all positions; a last-row call sets its own
            arrays[spec.logits_rows] = self.rows
        self._refresh: list[tuple[ort.OrtValue, np.ndarray]] = []
        self._values: dict[str, ort.OrtValue] = {}  # keeps the bound inputs alive with it
        homes = lm.homes(attention)
        self._rebind = homes is None and lm.device != "cpu"
        self._where = {name: "cpu" if homes is None else homes.get(name, lm.device)
                       for name in arrays}
        for name in arrays:
            value = ort.OrtValue.ortvalue_from_numpy(arrays[name], self._where[name], 0)
            if self._where[name] != "cpu" and (name != spec.logits_rows or last):
                self._refresh.append((value, arrays[name]))  # (all rows: fixed)
            self._values[name] = value
            b.bind_ortvalue_input(name, value)
        kv_dt, shape = kv.ops.dtype, kv.slice_shape(n)
        for i in range(cfg.n_layers):
            for k, bufs in (("key", kv.k), ("value", kv.v)):
                ptr = kv.slot_ptr(bufs[i], lo)
                b.bind_input(spec.past(i, k), lm.device, 0, kv_dt, shape, ptr)
                b.bind_output(spec.present(i, k), lm.device, 0, kv_dt, shape, ptr)
        self.logits = np.empty((n, R, cfg.vocab_size), np.float32)
        b.bind_output("logits", "cpu", 0, np.float32, list(self.logits.shape),
                      self.logits.ctypes.data)
        self.attn_names = [spec.attn(i) for i in range(cfg.n_layers)] if attention else []
        # (CPU, plain: nothing to do)
        self.needs_sync = bool(self._refresh or self.attn_names or self._rebind)
        self.run = bound_run(sess, b)

    def reshape(self, S: int) -> None:
        """S new tokens per slot from now on (a kept last-row binding, whose other inputs and
        outputs do not depend on S): new ids, bound in place of the old ones."""
        if S == self.ids.shape[1]:
            return
        old = self.ids
        self.ids = np.zeros((old.shape[0], S), np.int64)
        value = ort.OrtValue.ortvalue_from_numpy(self.ids, self._where[INPUT_IDS], 0)
        self._refresh = [(v, a) for v, a in self._refresh if a is not old]
        if self._where[INPUT_IDS] != "cpu":
            self._refresh.append((value, self.ids))
        self.binding.bind_ortvalue_input(INPUT_IDS, value)
        self._values[INPUT_IDS] = value  # (the old ids are bound no more: let them go)

    def sync(self) -> None:
        """After the host arrays were written: device copies, fresh attention outputs."""
        for value, arr in self._refresh:
            value.update_inplace(arr)
        if self._rebind:  # (copied where the session reads them: now)
            for name, value in self._values.items():
                self.binding.bind_ortvalue_input(name, value)
        for name in self.attn_names:  # (n, H, S, total): its shape changes every call
            self.binding.bind_output(name, "cpu")

    def attentions(self) -> list[np.ndarray]:
        """L x (n, H, S, total) from the last run."""
        outs = self.binding.get_outputs()
        first = len(outs) - len(self.attn_names)
        return [outs[first + i].numpy() for i in range(len(self.attn_names))]


class FusedLM(ArtifactRunner):
    """A fused artifact run by onnxruntime: ``prefill`` / ``extend`` / ``decode`` on slots of a
    ``DeviceKV``. Attention diagnostics come from the graph's ``qk_output`` variant, whose
    session is created the first time a call asks for them."""
    kind = "fused"

    def __init__(self, artifact_dir: str | Path, provider: str = "auto",
                 threads: int | None = None, attention: bool = True, spin: bool = True,
                 tf32: bool = False, options: ort.SessionOptions | None = None,
                 attention_copy: bool = False, padding_counted: bool | None = None,
                 attention_kernel: str = "auto"):
        super().__init__(artifact_dir, provider, threads, spin, tf32, options, attention_copy)
        # the CPU attention kernel: kvserve's own where it is built and takes the graph's
        # attention ("auto"), or onnxruntime's GroupQueryAttention (``native_attention``);
        # what the main graph runs, in words: ``attention_kernel``
        if attention_kernel not in native_attention.MODES:
            raise ValueError(f"attention_kernel {attention_kernel!r}: one of "
                             f"{', '.join(native_attention.MODES)}")
        self._kernel_mode = attention_kernel
        self.attention_kernel = ""
        # every attention node of the main graph on the native kernel, whose arithmetic for a
        # query is the same in calls of any shape (``server.rounding`` then checks the rest)
        self.row_invariant_attention = False
        runtime = self.runtime = self.manifest["runtime"]
        # an onnxruntime whose GroupQueryAttention lacks ``query_seqlens`` (before 1.32): the
        # graphs are loaded without it and a call's padding counted as tokens (``gqa_compat``;
        # ``padding_counted`` forces either way: tests). The graph then loads from memory,
        # and ``options`` (the caller's, when given) gets the artifact's directory as its
        # external-initializers folder entry
        self.padding_counted = not gqa_takes_query_seqlens() if padding_counted is None \
            else padding_counted
        self.device = device_of(self.providers)
        self._specs = {False: fused_spec_from(runtime, False), True: fused_spec_from(runtime,
                                                                                     True)}
        # a paired graph's K/V row past each slot's new rows (``FusedSpec.paired``)
        self.spare_rows = int(self._specs[False].paired)
        if self.spare_rows and self.padding_counted:
            raise RuntimeError(
                f"a paired-attention artifact needs GroupQueryAttention's query_seqlens input "
                f"(onnxruntime >= 1.32; this is {ort.__version__}): its decode steps are "
                f"two-row calls with a past, which the op without it takes only at batch 1. "
                f"Export without --paired-attention, or run a newer onnxruntime.")
        self._homes: dict[bool, dict[str, str] | None] = {}
        self._sessions: dict[bool, ort.InferenceSession] = {False: self._load("main")}
        self.provider = self._sessions[False].get_providers()[0]
        self._attention_graph = attention and "attention" in runtime["graphs"]
        kv_dtype = _DTYPES[runtime["kv"]["dtype"]]
        self.ops = KVOps(self.providers, self.device, kv_dtype)
        self._bound: dict[tuple, _Bound] = {}  # decode steps': (attention, n, generation)
        self._verify_bound: dict[tuple, _Bound] = {}  # verifications': (lo, n, S, generation)
        self._prefill_bound: dict[tuple, _Bound] = {}  # last-row prefills': (lo, n, generation)

    supports_verify = True  # ``verify``: one call of the graph, whatever the draft lengths
    prefills_after_rows = True  # ``prefill``: each slot's rows so far are its past

    def _load(self, role: str) -> ort.InferenceSession:
        path = self.dir / self.runtime["graphs"][role]
        options = self.options if role == "main" else self.diagnostics_options
        if self._kernel_mode == "native" and self.device != "cpu":
            raise RuntimeError(f"attention kernel 'native' asked for, but it runs on the CPU "
                               f"provider only (this is {self.device})")
        if self.device != "cpu" or self._kernel_mode == "onnxruntime":
            mode = "onnxruntime"
        else:  # (the attention-diagnostics graph returns the weights: its op stays anyway)
            mode = self._kernel_mode if role == "main" else "auto"
        try:
            sess = self._open(path, options, role, mode)
        except Exception as e:  # (onnxruntime refused the rewritten graph: its own op, then)
            if mode != "auto" or role != "main" or \
                    not self.attention_kernel.startswith("kvserve"):
                raise
            why = str(e).splitlines()[0][:300]
            log.warning("the graph on kvserve's native ops did not load (%s); using "
                        "onnxruntime's", why)
            sess = self._open(path, options, role, "onnxruntime")
            self.attention_kernel = f"{native_attention.ONNXRUNTIME} (the graph on kvserve's " \
                                    f"ops did not load: {why})"
        self._homes[role != "main"] = homes = input_homes(sess, self.device)
        spec = self._specs[role != "main"]
        strays = sorted({home for i in range(self.cfg.n_layers) for k in ("key", "value")
                         if (home := (homes or {}).get(spec.past(i, k), self.device))
                         != self.device})
        if strays:
            raise RuntimeError(
                f"onnxruntime {ort.__version__} runs this artifact's attention on "
                f"{', '.join(strays)}, not on {self.device}: it has no {self.device} "
                f"GroupQueryAttention kernel for its {self.runtime['kv']['dtype']} cache, "
                f"which the fused runtime keeps on the device and the op writes in place. "
                f"Export for this provider (on CUDA: --precision fp16, or --portable for "
                f"fp32), or serve it on the CPU.")
        return sess

    def _open(self, path: Path, options: ort.SessionOptions, role: str, mode: str
              ) -> ort.InferenceSession:
        """The session of the graph at ``path``: on kvserve's native ops where ``mode`` lets
        them (``native_attention.prepare``), without ``query_seqlens`` on an onnxruntime
        before 1.32 (``gqa_compat``); rewritten in memory, its weights read from the
        artifact's directory, or the file itself where nothing changed."""
        model, changed = None, 0
        if mode != "onnxruntime":
            model = onnx.load(str(path), load_external_data=False)
            kernel, changed = native_attention.prepare(model, options, self.providers, mode)
            if role == "main":
                self.attention_kernel = kernel
                self.row_invariant_attention = changed > 0 and not any(
                    n.op_type == native_attention.GQA for n in model.graph.node)
        elif role == "main":
            self.attention_kernel = native_attention.ONNXRUNTIME
            self.row_invariant_attention = False
        if self.padding_counted:
            model = model or onnx.load(str(path), load_external_data=False)
            changed += gqa_compat.without_query_seqlens(model)
        if not changed:
            return ort.InferenceSession(str(path), options, providers=self.providers)
        options.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                         str(path.parent))
        return ort.InferenceSession(model.SerializeToString(), options, providers=self.providers)

    def homes(self, attention: bool) -> dict[str, str] | None:
        """Where the graph's session reads each input (``cpu`` or the device); None where
        this onnxruntime cannot say."""
        return self._homes.get(attention)

    @property
    def has_attention(self) -> bool:
        return self._attention_graph

    @property
    def last_rows(self) -> bool:
        """Whether ``prefill(last=True)`` computes the last rows' logits alone (an artifact
        with ``logits_rows``), so that a prefill chunk holds no chunk x vocab logits."""
        return self._specs[False].logits_rows is not None

    @property
    def attention_ready(self) -> bool:
        """Whether the diagnostics session is loaded (it loads on the first call that asks)."""
        return True in self._sessions

    def spec_for(self, attention: bool):
        return self._specs[attention]

    def session(self, attention: bool) -> ort.InferenceSession:
        if attention not in self._sessions:
            if not self._attention_graph:
                raise RuntimeError("this artifact was exported without attention diagnostics")
            log.info("loading the attention-diagnostics graph (first request that asks)")
            self._sessions[attention] = self._load("attention")
        return self._sessions[attention]

    def new_cache(self, max_batch: int, capacity: int = CAPACITY_CHUNK) -> DeviceKV:
        return DeviceKV(self.cfg, self.ops, max_batch, capacity)

    # --- the one call ---------------------------------------------------------------------------
    def _call(self, bound: _Bound) -> None:
        """Run ``bound`` once (its ids and counters written; device copies refreshed)."""
        if bound.needs_sync:
            bound.sync()
        t0 = time.perf_counter()
        bound.run()
        self.ort_seconds += time.perf_counter() - t0

    def _run(self, kv: DeviceKV, lo: int, ids: np.ndarray, qlens: np.ndarray,
             attention: bool, last: bool = False) -> _Bound:
        """Feed ids (n, S) (row b: qlens[b] valid tokens, right-padded) to slots [lo, lo+n)
        through a binding of its own. ``last``: logits of each row's last valid token only
        (where the graph can). ``kv.used`` counts the tokens once the run succeeded."""
        n, S = ids.shape
        last = last and S > 1  # a step's one row is its last
        used = kv.used[lo:lo + n]
        top = int(used.max()) + S  # enough rows for every slot, whatever its qlen
        self._within_context(top, "prefill")
        kv.ensure_capacity(top + self.spare_rows)
        if last and not attention and self.last_rows:
            bound = self._prefill_binding(kv, lo, n, S)
        else:
            bound = _Bound(self, self.session(attention), kv, lo, n, S, attention, last)
        bound.ids[...] = ids
        fed = S if self.padding_counted else qlens  # (the padding counted: ``gqa_compat``)
        bound.qlens[...] = fed
        np.subtract(used + fed, 1, out=bound.seqlens, casting="unsafe")
        bound.total[...] = int((used + fed).max()) + self.spare_rows
        after = used + qlens  # (n,) each slot's rows after the call
        if last and bound.rows is not None:
            np.subtract(qlens, 1, out=bound.rows[:, 0], casting="unsafe")
        self._call(bound)
        used[...] = after
        return bound

    def prefill(self, kv: DeviceKV, lo: int, prompts: list, attention: bool = False,
                last: bool = False) -> Prefilled:
        """Each prompt (its first chunk, or all of it) into slots lo, lo+1, ...: the slots'
        rows so far are their past (0 for a new sequence). ``last``: each prompt's logits are
        its last token's row only (1, V) (generation; the graph skips the head elsewhere),
        not all (T_b, V) (Score)."""
        lens = np.array([len(p) for p in prompts], np.int64)
        if not len(lens) or not lens.all():
            raise ValueError("prefill needs a non-empty prompt per slot")
        ids = np.zeros((len(prompts), int(lens.max())), np.int64)
        for b, p in enumerate(prompts):
            ids[b, :len(p)] = p
        if self._one_by_one(kv, lo, lens):
            self._within_context(int(kv.used[lo:lo + len(lens)].max()) + int(lens.max()),
                                 "prefill")
            with _all_or_none(kv, lo, len(lens)):
                parts = [self.prefill(kv, lo + b, [p], attention, last)
                         for b, p in enumerate(prompts)]
            return Prefilled([x.logits[0].copy() for x in parts],
                             [x.attention[0] for x in parts] if attention else None)
        start = kv.used[lo:lo + len(prompts)].copy()
        bound = self._run(kv, lo, ids, lens, attention, last=last)
        if not last:
            logits = [bound.logits[b, :n] for b, n in enumerate(lens)]
        elif bound.logits.shape[1] == 1:  # the graph computed the last rows alone
            logits = [bound.logits[b] for b in range(len(lens))]
        else:  # an artifact from before logits_rows: every row was computed
            logits = [bound.logits[b, n - 1:n] for b, n in enumerate(lens)]
        attn = None
        if attention:
            a = bound.attentions()  # L x (n, H, S, total)
            attn = [np.stack([x[b, :, :n, :start[b] + n] for x in a])
                    for b, n in enumerate(lens)]
        return Prefilled(logits, attn)

    def extend(self, kv: DeviceKV, slot: int, tokens, rope_length: int | None = None,
               last: bool = False) -> np.ndarray:
        """A chunk of one slot's tokens (chunked prefill of a long prompt or Score input) after
        its rows so far. Returns the chunk's logits (T, V), or (1, V) with ``last``.
        ``rope_length`` (LongRoPE's factors of a longer sequence) only means something to the
        portable graphs: a LongRoPE model is exported portable."""
        if rope_length is not None and self.cfg.longrope_limit is not None:
            raise NotImplementedError("the fused graph does not carry LongRoPE")
        return self.prefill(kv, slot, [tokens], last=last).logits[0]

    def decode(self, kv: DeviceKV, n: int, tokens, attention: bool = False
               ) -> tuple[np.ndarray, list[np.ndarray] | None]:
        """One step for slots [0, n): tokens (n,) ints. Returns logits (n, V) (a view into a reused
        buffer: copy what you keep) and, when asked, per slot its attention (L, H, T_b) over
        its T_b tokens (the new one last).

        A step's binding is cached per (batch, buffer generation): one new token per slot, so
        ``query_seqlens`` is all ones from the start and only the ids and counters change
        (``tokens``: a list costs least)."""
        if isinstance(tokens, np.ndarray):
            tokens = tokens.tolist()
        bound = self._bound.get((attention, n, kv.generation))
        longs = _longs(n)
        used = longs.unpack_from(kv.used)  # each slot's rows before the step
        top = max(used) + 1 + self.spare_rows  # the longest slot's rows after it (and the
        if top > kv.capacity:  # paired graph's spare one)
            kv.ensure_capacity(top)  # (a new buffer generation: a new binding)
            bound = None
        if bound is None:
            bound = self._step_binding(kv, n, attention)
        longs.pack_into(bound.ids, 0, *tokens)
        _ints(n).pack_into(bound.seqlens, 0, *used)  # the rows after the step, minus one
        _INT.pack_into(bound.total, 0, top)
        self._call(bound)
        longs.pack_into(kv.used, 0, *[u + 1 for u in used])
        attn = None
        if attention:
            a = bound.attentions()  # L x (n, H, 1, total)
            attn = [np.stack([x[b, :, 0, :kv.used[b]] for x in a]) for b in range(n)]
        return bound.logits[:, 0], attn

    def verify(self, kv: DeviceKV, n: int, rows: list) -> np.ndarray:
        """Speculative verification for slots [0, n) in ONE run of the graph: row b feeds its
        tokens ``rows[b]`` (its last sampled token, then its draft: 1 + K_b tokens, K_b may be
        0 and differ per row) after the slot's rows so far. Returns logits (n, S, V),
        S = the longest row: [b, j] predicts the token after rows[b][j]; [b, j >= len(rows[b])]
        is padding (garbage). A view into a reused buffer: copy what you keep.

        ``kv.used[b]`` advances by ``len(rows[b])``; keep the accepted rows with
        ``kv.truncate(b, rows_before + accepted + 1)``. The padded positions' K/V rows land
        beyond each slot's ``used`` (never read; overwritten by the next call); they must be
        inside the model's context too (a slot's rows + S, for every slot)."""
        lens = [len(r) for r in rows]
        if len(rows) != n or not all(lens):
            raise ValueError("verify needs one non-empty row per slot")
        if self._one_by_one(kv, 0, lens):  # (the same bound as one call's)
            self._within_context(int(kv.used[:n].max()) + max(lens))
            out = np.zeros((n, max(lens), self.cfg.vocab_size), np.float32)
            with _all_or_none(kv, 0, n):
                for b, r in enumerate(rows):
                    out[b, :len(r)] = self._verify(kv, b, [r])[0]
            return out
        return self._verify(kv, 0, rows)

    def _within_context(self, top: int, what: str = "verification") -> None:
        """A call's rows padded to the longest end by ``top``: within the context? (Padding
        included: its positions are looked up in the graph's position tables.) Calls made a
        row at a time (``_one_by_one``) keep the bound of one call."""
        if top > self.cfg.max_seq_len:
            raise ValueError(f"a {what} row, padded to the longest, would pass the model's "
                             f"context of {self.cfg.max_seq_len} tokens ("
                             + ("cap the drafts)" if what == "verification" else
                                "feed it alone)"))

    def _one_by_one(self, kv: DeviceKV, lo: int, lens) -> bool:
        """Whether a call must go a row at a time: several rows of more than one token, one
        with a past, where GroupQueryAttention has no ``query_seqlens`` (the op then takes
        several multi-token rows only as first prompts: ``gqa_compat``)."""
        return self.padding_counted and len(lens) > 1 and max(lens) > 1 and \
            bool(kv.used[lo:lo + len(lens)].any())

    def _verify(self, kv: DeviceKV, lo: int, rows: list) -> np.ndarray:
        """``verify`` of slots [lo, lo + len(rows)) in one call."""
        n, lens = len(rows), [len(r) for r in rows]
        S = max(lens)
        longs = _longs(n)
        used = longs.unpack_from(kv.used, 8 * lo)  # each slot's rows before the call
        after = [u + m for u, m in zip(used, lens)]
        self._within_context(max(used) + S)
        kv.ensure_capacity(max(used) + S + self.spare_rows)
        key = (lo, n, S, kv.generation)
        bound = self._verify_bound.get(key)
        if bound is None:
            self._verify_bound = {k: v for k, v in self._verify_bound.items()
                                  if k[3] == kv.generation}
            bound = self._verify_bound[key] = _Bound(self, self.session(False), kv, lo, n, S,
                                                     False, False)
        flat: list[int] = []
        for r, m in zip(rows, lens):
            flat += r
            if m < S:
                flat += [0] * (S - m)
        _longs(n * S).pack_into(bound.ids, 0, *flat)
        ints = _ints(n)
        fed = [S] * n if self.padding_counted else lens  # (``gqa_compat``)
        ints.pack_into(bound.qlens, 0, *fed)
        ints.pack_into(bound.seqlens, 0, *[u + m - 1 for u, m in zip(used, fed)])
        _INT.pack_into(bound.total, 0, max(u + m for u, m in zip(used, fed)) + self.spare_rows)
        self._call(bound)
        longs.pack_into(kv.used, 8 * lo, *after)
        return bound.logits

    def _prefill_binding(self, kv: DeviceKV, lo: int, n: int, S: int) -> _Bound:
        """A last-row prefill's binding over slots [lo, lo + n), kept per (lo, n, buffer
        generation): the KV slices stay bound, and another prompt length binds new ids only
        (a new binding took ~0.2-0.6 ms of a 6-9 ms chat turn on the 6M bench model). Its
        logits rows are a view into a reused buffer, as a decode step's."""
        key = (lo, n, kv.generation)
        bound = self._prefill_bound.get(key)
        if bound is None:
            kept = {k: v for k, v in self._prefill_bound.items() if k[2] == kv.generation}
            self._prefill_bound = kept if len(kept) < _KEPT_PREFILLS else {}
            bound = self._prefill_bound[key] = _Bound(self, self.session(False), kv, lo, n, S,
                                                      False, True)
        else:
            bound.reshape(S)
        return bound

    def _step_binding(self, kv: DeviceKV, n: int, attention: bool) -> _Bound:
        """A decode step's binding over slots [0, n), kept for the next steps; those of older
        buffer generations are dropped (they hold the old buffers alive)."""
        bound = _Bound(self, self.session(attention), kv, 0, n, 1, attention, False)
        bound.qlens[:] = 1
        self._bound = {k: v for k, v in self._bound.items() if k[2] == kv.generation}
        self._bound[(attention, n, kv.generation)] = bound
        return bound
