"""What attention costs in a decode step (a script): onnxruntime's GroupQueryAttention against the
rest of kvserve's step, at batch 1, by position and precision.

    python bench/attention_cost.py [--size bench-100m] [--precisions fp32 int8 int4]
                                   [--positions 16 128 512 1000] [--rounds 7] [--threads 2]
                                   [--update-committed | --out FILE.json] [--render-only]

Each artifact's graph runs twice in one process: as exported, and with every
GroupQueryAttention replaced by a slice of its query (the layer's output shape; no attention, no
cache write, no rotary). Both take the same one-token step at batch 1 through IO bindings, with
the runner's session options (``artifact.providers.session_options``), the two alternating
round by round; a cell is the median over rounds of each round's median step, attention's cost
the median of the rounds' differences. Beside it, the cache rows attention reads (K and V of
every layer up to the position) and the time those would take at the rate the step without
attention read the weights (the weights' bytes over its step): attention's floor, were it
bound by memory as the matrix products are.

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

    from kvserve.artifact.providers import session_options
    from kvserve.artifact.spec import fused_spec_from

    from kvserve.model.config import ModelConfig

    cfg = ModelConfig.load(artifact / "config.json")
    model = onnx.load(str(artifact / "model.onnx"))
    weights = sum(f.stat().st_size for f in artifact.glob("model.onnx*"))
    sessions = {
        "step": ort.InferenceSession(model.SerializeToString(), session_options(threads),
                                     providers=["CPUExecutionProvider"]),
        "without_attention": ort.InferenceSession(
            without_attention(model, cfg.head_dim).SerializeToString(), session_options(threads),
            providers=["CPUExecutionProvider"])}
    del model
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
    out = {"layers": cfg.n_layers, "weights_mb": weights / 2**20, "positions": {}}
    for p in positions:
        full, bare = (np.array(times[p][k]) for k in steps)
        rate = weights / (float(np.median(bare)) / 1e3)  # bytes/s the step without attention
        # read the weights at
        kv = per_layer_kv * cfg.n_layers * (p + 1)
        attention = float(np.median(full - bare))  # paired: each round's difference
        out["positions"][str(p)] = {
            "step_ms": float(np.median(full)), "without_attention_ms": float(np.median(bare)),
            "attention_ms": attention, "share": float(np.median((full - bare) / full)),
            "per_layer_us": 1e3 * attention / cfg.n_layers,
            "cache_mb": kv / 2**20, "floor_ms": 1e3 * kv / rate,
            "rounds": {k: times[p][k] for k in steps}}
    return out


def render(data: dict) -> str:
    out = ["## What attention costs a decode step", "",
           f"`bench/attention_cost.py` on {data['size']} ({data['cpu']}, onnxruntime "
           f"{data['onnxruntime']}, {data['threads']} threads, {data['date']}): batch 1, one "
           f"token a step, the exported graph against the same graph with every "
           f"GroupQueryAttention replaced by a slice of its query; medians over "
           f"{data['rounds']} alternating rounds of each round's median of {STEPS} steps "
           f"(attention: of the rounds' differences).", "",
           "| precision | position | step ms | without attention ms | attention ms (share) | "
           "a layer µs | cache read MB | at the weights' rate ms |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for prec, a in data["precisions"].items():
        for p, c in a["positions"].items():
            out.append(f"| {prec} | {p} | {c['step_ms']:.2f} | {c['without_attention_ms']:.2f} "
                       f"| {c['attention_ms']:.2f} ({100 * c['share']:.0f}%) | "
                       f"{c['per_layer_us']:.0f} | {c['cache_mb']:.1f} | {c['floor_ms']:.3f} |")
    out += ["", "The last column is the cache rows' bytes at the rate the step without attention "
                "read the weights (the same round): what attention would take were it bound by "
                "memory as the matrix products are. The rest of attention's time is "
                "onnxruntime's CPU kernel itself (per head, small GEMMs with their own "
                "packing, the softmax, the rotary embedding; two parallel sections a layer)."]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    from kvserve.bench.build import build

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="bench-100m")
    ap.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    ap.add_argument("--positions", nargs="+", type=int, default=[16, 128, 512, 1000])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    parsed = parse_results_args(ap, argv, "attention-cost.json", render)
    if parsed is None:
        return 0
    args, out = parsed
    built = build(args.size, Path(args.cache), genai=False, int8="int8" in args.precisions,
                  int4="int4" in args.precisions)
    data = {**run_header(size=args.size, rounds=args.rounds, threads=args.threads),
            "precisions": {}}
    for prec in args.precisions:
        art = getattr(built, prec)
        data["precisions"][prec] = {
            "quantization": json.loads((art / "manifest.json").read_text()).get("quantization"),
            **measure(art, args.positions, args.rounds, args.threads)}
        print(f"{prec}: done", flush=True)
    write_results(out, data, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
