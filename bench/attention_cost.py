"""What attention costs in a decode step (a script): onnxruntime's GroupQueryAttention and
kvserve's native kernel (``artifact.native_attention``) against the rest of kvserve's step, at
batch 1, by position and precision.

    python bench/attention_cost.py [--size bench-100m] [--precisions fp32 int8 int4]
                                   [--positions 16 128 512 1000] [--rounds 7] [--threads 2]
                                   [--prefill-rounds 3]
                                   [--update-committed | --out FILE.json] [--render-only]

Each artifact's graph runs three times in one process: as exported (onnxruntime's op), with its
attention on kvserve's native kernel (the runner's rewrite; where the library is built), and
with every GroupQueryAttention replaced by a slice of its query (the layer's output shape; no
attention, no cache write, no rotary). All take the same one-token step at batch 1 through IO
bindings, with the runner's session options (``artifact.providers.session_options``), in turn
round by round; a cell is the median over rounds of each round's median step, an attention's
cost the median of the rounds' differences. Beside it, the cache rows attention reads (K and V of
every layer up to the position) and the time those would take at the rate the step without
attention read the weights (the weights' bytes over its step): attention's floor, were it
bound by memory as the matrix products are. Then (``--prefill-rounds``) prefill calls of one
prompt on the runner with either kernel: from an empty cache, and a chunk after a past.

Results: ``attention-cost.json`` and ``.md`` (``--update-committed``: ``bench/results/``;
docs/speed.md quotes them).
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import numpy as np

from kvserve.bench.common import parse_results_args, run_header, write_results

PRECISIONS = ("fp32", "int8", "int4")
STEPS = 100  # timed steps a cell a round (after 10 untimed)


def without_attention(model, head_dim: int):
    """``model`` (an onnx ModelProto of the fused graph) with each GroupQueryAttention
    replaced by a slice of its query (the first heads x ``head_dim`` columns of its packed
    input): the layer's output shape, no attention. The
    present outputs (and any attention-weights output) leave the graph."""
    from onnx import helper, numpy_helper

    m = copy.deepcopy(model)
    g = m.graph
    nodes, dropped = [], set()
    for n in g.node:
        if n.op_type != "GroupQueryAttention":
            nodes.append(n)
            continue
        width = head_dim * next(a.i for a in n.attribute if a.name == "num_heads")
        src = n.input[0]  # (a paired graph's padded query: its rows as the op's output)
        consts = []
        for suffix, value in (("start", 0), ("end", width), ("axis", 2)):
            name = f"{n.name}/noattn.{suffix}"
            nodes.append(helper.make_node("Constant", [], [name], value=numpy_helper.from_array(
                np.array([value], np.int64))))
            consts.append(name)
        nodes.append(helper.make_node("Slice", [src, *consts], [n.output[0]],
                                      name=f"{n.name}/noattn"))
        dropped.update(n.output[1:])
    del g.node[:]
    g.node.extend(nodes)
    keep = [o for o in g.output if o.name not in dropped]
    del g.output[:]
    g.output.extend(keep)
    return m


class Step:
    """One graph's one-token step at batch 1 on its own IO binding (caches of ``capacity``
    rows; the present outputs, where the graph has them, bound to the same buffers).
    ``spare``: a paired graph's one more row, which the runtime counts in
    ``total_sequence_length`` (``FusedSpec.paired``)."""

    def __init__(self, session, cfg, capacity: int, spare: int = 0, kv_dtype=np.float32):
        import onnxruntime as ort

        from kvserve.artifact.providers import bound_run
        from kvserve.artifact.spec import FusedSpec

        spec, self.sess, self.spare = FusedSpec(), session, spare
        self.binding = session.io_binding()
        g = np.random.default_rng(0)
        shape = (1, cfg.n_kv_heads, capacity, cfg.head_dim)
        inputs = {i.name for i in session.get_inputs()}
        outputs = {o.name for o in session.get_outputs()}
        self._kv = []
        for layer in range(cfg.n_layers):
            for kv in ("key", "value"):
                v = ort.OrtValue.ortvalue_from_numpy(
                    g.standard_normal(shape).astype(kv_dtype))
                self._kv.append(v)
                if spec.past(layer, kv) in inputs:
                    self.binding.bind_ortvalue_input(spec.past(layer, kv), v)
                if spec.present(layer, kv) in outputs:
                    self.binding.bind_ortvalue_output(spec.present(layer, kv), v)
        self.binding.bind_output("logits")
        self.run = bound_run(session, self.binding)

    def at(self, position: int) -> None:
        """The step that writes the cache row of ``position`` (``position`` rows before it)."""
        from kvserve.artifact.spec import (INPUT_IDS, LOGITS_ROWS, QUERY_SEQLENS, SEQLENS_K,
                                           TOTAL_SEQUENCE_LENGTH)

        feeds = {INPUT_IDS: np.array([[5]], np.int64),
                 SEQLENS_K: np.array([position], np.int32),
                 QUERY_SEQLENS: np.array([1], np.int32),
                 TOTAL_SEQUENCE_LENGTH: np.array(position + 1 + self.spare, np.int32),
                 LOGITS_ROWS: np.array([[0]], np.int64)}
        names = {i.name for i in self.sess.get_inputs()}
        for name, value in feeds.items():
            if name in names:
                self.binding.bind_cpu_input(name, value)

    def median_ms(self, steps: int = STEPS) -> float:
        for _ in range(10):
            self.run()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            self.run()
            times.append(time.perf_counter() - t0)
        return 1e3 * float(np.median(times))


def measure(artifact: Path, positions: list[int], rounds: int, threads: int) -> dict:
    """Both graphs of ``artifact`` at each position, alternating, ``rounds`` rounds."""
    import onnx
    import onnxruntime as ort

    from kvserve.artifact import native_attention
    from kvserve.artifact.providers import session_options
    from kvserve.artifact.spec import fused_spec_from

    from kvserve.model.config import ModelConfig

    cfg = ModelConfig.load(artifact / "config.json")
    model = onnx.load(str(artifact / "model.onnx"))
    weights = sum(f.stat().st_size for f in artifact.glob("model.onnx*"))

    def session(m, options=None):
        return ort.InferenceSession(m.SerializeToString(), options or session_options(threads),
                                    providers=["CPUExecutionProvider"])

    sessions = {"step": session(model),
                "without_attention": session(without_attention(model, cfg.head_dim))}
    runner = copy.deepcopy(model)  # what the runner runs: attention and SwiGLU on the library
    options = session_options(threads)
    kernel, changed = native_attention.prepare(runner, options, ["CPUExecutionProvider"])
    if changed:
        native = copy.deepcopy(model)  # attention alone on the library
        native_attention.rewrite(native)
        sessions["native"] = session(native, options)
        if "SwiGLU" in kernel:
            sessions["native_swiglu"] = session(runner, options)
    else:
        print(f"no native kernel: {kernel}", flush=True)
    del model, runner
    capacity = max(positions) + 8
    manifest = json.loads((artifact / "manifest.json").read_text())
    spare = int(fused_spec_from(manifest["runtime"], False).paired)
    steps = {k: Step(s, cfg, capacity, spare) for k, s in sessions.items()}
    times = {p: {k: [] for k in steps} for p in positions}
    for r in range(rounds):
        for p in positions:
            order = list(steps) if r % 2 == 0 else list(steps)[::-1]
            for k in order:
                steps[k].at(p)
                times[p][k].append(steps[k].median_ms())
    per_layer_kv = 2 * cfg.n_kv_heads * cfg.head_dim * 4  # K and V, float32, a row
    out = {"layers": cfg.n_layers, "weights_mb": weights / 2**20, "kernel": kernel,
           "positions": {}}
    for p in positions:
        t = {k: np.array(v) for k, v in times[p].items()}
        full, bare = t["step"], t["without_attention"]
        rate = weights / (float(np.median(bare)) / 1e3)  # bytes/s the step without attention
        # read the weights at
        kv = per_layer_kv * cfg.n_layers * (p + 1)
        attention = float(np.median(full - bare))  # paired: each round's difference
        cell = {
            "step_ms": float(np.median(full)), "without_attention_ms": float(np.median(bare)),
            "attention_ms": attention, "share": float(np.median((full - bare) / full)),
            "per_layer_us": 1e3 * attention / cfg.n_layers,
            "cache_mb": kv / 2**20, "floor_ms": 1e3 * kv / rate,
            "rounds": {k: times[p][k] for k in steps}}
        if "native" in t:
            nat = t["native"]
            cell.update({"native_step_ms": float(np.median(nat)),
                         "native_attention_ms": float(np.median(nat - bare)),
                         "native_share": float(np.median((nat - bare) / nat)),
                         "step_speedup": float(np.median(full / nat))})
        if "native_swiglu" in t:
            cell.update({"swiglu_step_ms": float(np.median(t["native_swiglu"])),
                         "swiglu_speedup": float(np.median(nat / t["native_swiglu"]))})
        out["positions"][str(p)] = cell
    return out


PREFILLS = ((0, 512), (0, 1000), (0, 2000), (1000, 64), (1500, 256))  # (rows before, new)


def measure_prefill(artifact: Path, rounds: int, threads: int, calls=PREFILLS) -> dict | None:
    """One prompt's prefill call at batch 1 (after a past of its own first tokens where the
    first number is not 0), on the runner with each kernel, in turn round by round: each
    kernel's median ms and the median of the rounds' ratios. None without the native kernel."""
    from kvserve.artifact.fused import FusedLM

    lms = {k: FusedLM(artifact, provider="cpu", threads=threads, attention=False,
                      attention_kernel=k) for k in ("onnxruntime", "auto")}
    if not lms["auto"].row_invariant_attention:
        return None
    cfg = lms["auto"].cfg
    kvs = {k: lm.new_cache(1, cfg.max_seq_len) for k, lm in lms.items()}
    g = np.random.default_rng(0)
    cells = {}
    for past, n in calls:
        if past + n > cfg.max_seq_len:
            continue
        ids = g.integers(0, cfg.vocab_size, past + n).tolist()
        t: dict[str, list[float]] = {k: [] for k in lms}
        for r in range(rounds):
            for k in (list(lms) if r % 2 == 0 else list(lms)[::-1]):
                lm, kv = lms[k], kvs[k]
                kv.used[:] = 0
                if past:
                    lm.prefill(kv, 0, [ids[:past]], last=True)
                t0 = time.perf_counter()
                lm.prefill(kv, 0, [ids[past:]], last=True)
                t[k].append(1e3 * (time.perf_counter() - t0))
        a, b = np.array(t["onnxruntime"]), np.array(t["auto"])
        cells[f"{past}+{n}"] = {"past": past, "new": n, "onnxruntime_ms": float(np.median(a)),
                                "native_ms": float(np.median(b)),
                                "ratio": float(np.median(b / a)), "rounds": t}
    return cells


def render(data: dict) -> str:
    native = any("native_attention_ms" in c for a in data["precisions"].values()
                 for c in a["positions"].values())
    swiglu = any("swiglu_speedup" in c for a in data["precisions"].values()
                 for c in a["positions"].values())
    out = ["## What attention costs a decode step", "",
           f"`bench/attention_cost.py` on {data['size']} ({data['cpu']}, onnxruntime "
           f"{data['onnxruntime']}, {data['threads']} threads, {data['date']}): batch 1, one "
           f"token a step, the exported graph (onnxruntime's GroupQueryAttention)"
           + (", the same graph on kvserve's native attention kernel" if native else "")
           + (" and with kvserve's SwiGLU too (what the runner runs)" if swiglu else "")
           + f" and the graph with every attention replaced by a slice of its query; medians "
           f"over {data['rounds']} rounds (the graphs in turn) of each round's median of "
           f"{STEPS} steps (attention: of the rounds' differences).", ""]
    head = ("| precision | position | step ms | without attention ms | onnxruntime's attention "
            "ms (share) | a layer µs |")
    rule = "|---|---:|---:|---:|---:|---:|"
    if native:
        head += " kvserve's attention ms (share) | a layer µs | step, onnxruntime ÷ kvserve |"
        rule += "---:|---:|---:|"
    if swiglu:
        head += " step with kvserve's SwiGLU too | its gain |"
        rule += "---:|---:|"
    out += [head + " cache read MB | at the weights' rate ms |", rule + "---:|---:|"]
    for prec, a in data["precisions"].items():
        layers = a["layers"]
        for p, c in a["positions"].items():
            row = (f"| {prec} | {p} | {c['step_ms']:.2f} | {c['without_attention_ms']:.2f} "
                   f"| {c['attention_ms']:.2f} ({100 * c['share']:.0f}%) | "
                   f"{c['per_layer_us']:.0f} |")
            if native:
                row += (f" {c['native_attention_ms']:.2f} ({100 * c['native_share']:.0f}%) | "
                        f"{1e3 * c['native_attention_ms'] / layers:.0f} | "
                        f"{c['step_speedup']:.2f}× |" if "native_attention_ms" in c
                        else " – | – | – |")
            if swiglu:
                row += (f" {c['swiglu_step_ms']:.2f} | {c['swiglu_speedup']:.2f}× |"
                        if "swiglu_speedup" in c else " – | – |")
            out.append(row + f" {c['cache_mb']:.1f} | {c['floor_ms']:.3f} |")
    prefill = {p: a["prefill"] for p, a in data["precisions"].items() if a.get("prefill")}
    if prefill:
        out += ["", f"Prefill calls, batch 1 (one prompt; \"64 after 1000\": a chunk after "
                    f"a past, as the prefix cache and chunked prefill make them), the runner "
                    f"with each kernel, medians over {data.get('prefill_rounds', '?')} rounds "
                    f"in turn:", "",
                "| precision | call | onnxruntime's ms | kvserve's ms | kvserve ÷ onnxruntime |",
                "|---|---|---:|---:|---:|"]
        for prec, cells in prefill.items():
            for c in cells.values():
                call = f"{c['new']} after {c['past']}" if c["past"] else f"{c['new']} tokens"
                out.append(f"| {prec} | {call} | {c['onnxruntime_ms']:,.0f} | "
                           f"{c['native_ms']:,.0f} | {c['ratio']:.2f}× |")
    out += ["", "The last column is the cache rows' bytes at the rate the step without attention "
                "read the weights (the same round): what attention would take were it bound by "
                "memory as the matrix products are. onnxruntime's CPU kernel: per head, small "
                "GEMMs with their own packing, the softmax, the rotary embedding; two parallel "
                "sections a layer. kvserve's (artifact/native/attention.cc): one parallel "
                "section a layer (none for a short decode step); each task's key and value "
                "rows in tiles of 32, read once for every query head of its group; eight "
                "keys' scores at a time; a query's arithmetic the same in a call of any "
                "shape (onnxruntime's multi-token path is a packed GEMM, faster on long "
                "prompts)."]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    from kvserve.bench.build import build

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="bench-100m")
    ap.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    ap.add_argument("--positions", nargs="+", type=int, default=[16, 128, 512, 1000])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill-rounds", type=int, default=3,
                    help="rounds of the prefill calls (0: none)")
    parsed = parse_results_args(ap, argv, "attention-cost.json", render)
    if parsed is None:
        return 0
    args, out = parsed
    built = build(args.size, Path(args.cache), genai=False, int8="int8" in args.precisions,
                  int4="int4" in args.precisions)
    data = {**run_header(size=args.size, rounds=args.rounds, threads=args.threads),
            "prefill_rounds": args.prefill_rounds, "precisions": {}}
    for prec in args.precisions:
        art = getattr(built, prec)
        data["precisions"][prec] = {
            "quantization": json.loads((art / "manifest.json").read_text()).get("quantization"),
            **measure(art, args.positions, args.rounds, args.threads)}
        if args.prefill_rounds:
            data["precisions"][prec]["prefill"] = measure_prefill(art, args.prefill_rounds,
                                                                  args.threads)
        print(f"{prec}: done", flush=True)
    write_results(out, data, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
