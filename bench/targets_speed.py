"""The targets of the prefix cache, speculative decoding and the llama.cpp peer (issue 27's
"Done when"), from one size's results JSON. Same shape as ``bench/targets.py``'s (which
calls ``speed_targets``); the reasons a target can miss are the notes below, each with the
measured figure that says why where there is one.

  prefix   second-request TTFT ≤ 0.1× the uncached (1,000 shared + 16 tokens, batch 1)
  chat     chat replay (8 turns) total TTFT ≥ 5× lower than the engine without the cache and
           than onnxruntime-genai re-prefilling
  spec     trained model on held-out code, batch 1: ≥ 1.5× speculation off, ≥ 1.3×
           onnxruntime-genai (and llama.cpp where it ran); batch 8: never below off (≥ 1.0×),
           every size
  llama.cpp  kvserve ≥ 1.0× llama.cpp at each precision (fp32/f32, int8/q8_0, int4/q4_0),
           batch 1 and batch 8
"""
from __future__ import annotations

import json

from .common import RESULTS
from .figures import (blocks, fmt, get, paired, paired_speed, per_round_speed, run_date, speed,
                      speed_date, tok_s)
from .targets import make_target

PREFIX_REST = ("the second request still prefills its own tail after the 1,000 cached rows "
               "(on 6M ~1.4 ms, attention over those rows: 0.6 ms from an empty slot), and it "
               "is sent as soon as the first one's token arrives, while the engine copies the "
               "first prompt's new blocks into the pool; a new shared prefix each repetition "
               "lands in pool pages never written before, and their page faults make that "
               "copy ~1.3 ms for 63 blocks against 0.16 ms into pages written before (6M, "
               "2026-12-02): a fixed cost next to a prefill this small")
CHAT_FIRST = ("the sum includes the first turn, which nothing cached can shorten, and each "
              "later turn still prefills its new user turn")
LLAMA_SMALL = ("a decode step of this model is little arithmetic: the engine's per-token "
               "Python work (scheduling, sampling, events, detokenizer: "
               "bench/results/profile.md) is a large share of it, where llama.cpp's decode "
               "loop, driven here through its C API, is C")
LLAMA_READS = ("a batch-1 step of this model reads every weight once (fp32: ~400 MB a token); "
               "beside its matrix products kvserve's step makes some 70 small onnxruntime "
               "kernel calls (per layer two norms, attention, and SwiGLU's Split, activation "
               "and Mul), of which attention is the largest: at position 128 onnxruntime's "
               "CPU GroupQueryAttention took 7% of an fp32 step, 13% at int8 and 18% at int4, "
               "kvserve's own attention kernel (on by default where it is built: "
               "docs/speed.md) 2%, 7% and 8% (2026-12-04, "
               "bench/results/attention-cost.md; the norms and SwiGLU's ops: "
               "bench/results/decode-cost-100m-int4.md; onnxruntime 1.32 has no CPU kernel "
               "of a fused SwiGLU, neither its own nor ONNX's, and its CPU MoE / QMoE as a "
               "one-op SwiGLU MLP were slower); kvserve's default int8 graph adds the per-row "
               "quantization of every matmul's input in standard ops (677 nodes against "
               "int4's 138), which the bench's int8, 8-bit MatMulNBits blocks of 64, does "
               "inside the kernel (bench/results/int8-blocks.md). kvserve's lead "
               "at batch 1 is its server's (speculation, the prefix cache: the cells "
               "above). Until "
               "2026-12-02 the bench forced llama.cpp's OpenMP threads to sleep at every "
               "barrier (OMP_WAIT_POLICY=PASSIVE); then kvserve led 1.20× (fp32) and 2.19× "
               "(int4)")
SPEC_RANDOM = "random-init weights: their greedy output rarely repeats the prompt"
SPEC_B8 = ("at batch 8 a verification call over 8 × (1 + K) rows does real arithmetic: the "
           "engine's backoff pauses speculation when a verification step yields fewer tokens/s "
           "than a plain one, and its probing steps cost what they lose")
LLAMACPP = [("engine", "llamacpp", "fp32", "f32"), ("engine_int8", "llamacpp_q8", "int8", "q8_0"),
            ("engine_int4", "llamacpp_q4", "int4", "q4_0")]


def _acceptance(size: dict, runner: str, batch: int) -> str:
    a = speed(size, runner, "spec", str(batch), "acceptance")
    d = speed(size, runner, "spec", str(batch), "drafted")
    return "–" if a is None else f"{a:.0%} of {d:,} drafted tokens accepted"


def _replay_note() -> list[str]:
    """What the speculator makes of the trained model's own continuations at this machine's
    measured costs, and the bound of any policy on the same drafts (``bench/spec_replay.py``,
    its committed results), where they are there."""
    path = RESULTS / "spec-replay.json"
    if not path.is_file():
        return []
    r = json.loads(path.read_text())
    ort, eng = r.get("onnxruntime") or {}, r.get("engine") or {}
    if "by_length" not in ort or "by_length" not in eng:
        return []
    c = ort["relative_costs"]
    return [f"replayed on the model's own greedy continuations at costs measured on "
            f"{r['date'][:16].replace('T', ' ')} (bench/results/spec-replay.json): at "
            f"onnxruntime's call costs (2, 5 and 9 positions: {c['2']:.2f}, {c['5']:.2f} and "
            f"{c['9']:.2f} plain calls; a model this small is not bound by reading its "
            f"weights, so each position is arithmetic) the speculator makes "
            f"{ort['speedup']:.2f}×, at the engine's whole steps {eng['speedup']:.2f}×; "
            f"knowing every draft's fate in advance, no policy could make more than "
            f"{ort['bound']:.2f}× / {eng['bound']:.2f}× of the same drafts; one draft length "
            f"per matched n-gram length, each the best for the whole run, makes "
            f"{get(ort, 'by_length', 'speedup', default=0):.2f}× / "
            f"{get(eng, 'by_length', 'speedup', default=0):.2f}× (what a policy reading the "
            f"match length, and nothing else, can at best make)"]


def _spec_notes(size: dict, batch: int, key: str) -> list[str]:
    notes = [] if key == "trained" else [SPEC_RANDOM]
    acc = speed(size, "engine_on", "spec", str(batch), "acceptance")
    if acc is not None:
        notes.append(f"{acc:.0%} of the drafted tokens were accepted at batch {batch}; each "
                     f"verification call over 1 + K tokens costs more than a plain step on "
                     f"these 2 shared cores")
    if key == "trained" and batch == 1:
        notes += _replay_note()
    if batch > 1:
        notes.append(SPEC_B8)
        share = speed(size, "engine_on", "spec", str(batch), "short_batch_share")
        off = speed(size, "engine", "spec", str(batch), "short_batch_share")
        if share is not None:
            notes.append(
                f"the batch's rows finish at different steps with speculation (a row whose "
                f"drafts are accepted runs ahead): {share:.0%} of the model calls' time ran at "
                f"fewer than {batch} rows ({off or 0:.0%} without); the bench waits for every "
                f"row of a batch, a server with queued requests fills those slots")
    return notes


def _prefix(key: str, size: dict) -> list[dict]:
    out = []
    for name in sorted(get(size, "runners", "engine_on", "prefix") or {}):
        on = speed(size, "engine_on", "prefix", name, "second_ms")
        off = speed(size, "engine", "prefix", name, "second_ms")
        genai = speed(size, "genai", "prefix", name, "second_ms")
        shared, tail = name.split("+")
        out.append(make_target(
            key, f"prefix cache: second request's TTFT ≤ 0.1× uncached ({int(shared):,} shared "
                 f"+ {tail} tokens, batch 1)",
            paired_speed(size, "engine_on", "engine", "prefix", name, "second_ms"), 0.1,
            [PREFIX_REST], f"{fmt(on, 1)} vs {fmt(off, 1)} ms; "
            f"{speed(size, 'engine_on', 'prefix', name, 'cached_tokens')} prompt tokens "
            f"cached; onnxruntime-genai {fmt(genai, 1)} ms", kind="<="))
    return out


def _chat(key: str, size: dict) -> list[dict]:
    out = []
    for name in sorted(get(size, "runners", "engine_on", "chat") or {}):
        on = speed(size, "engine_on", "chat", name, "ttft_ms_sum")
        tot = speed(size, "engine_on", "chat", name, "total_ms_sum")
        first = (speed(size, "engine_on", "chat", name, "ttft_ms") or [None])[0]
        notes = [CHAT_FIRST + (f": its first turn took {fmt(first)} of the {fmt(on)} ms"
                               if first and on else "")]
        for peer, label in (("engine", "without the cache"), ("genai", "onnxruntime-genai")):
            r = paired_speed(size, peer, "engine_on", "chat", name, "ttft_ms_sum")
            peer_tot = speed(size, peer, "chat", name, "total_ms_sum")
            out.append(make_target(
                key, f"chat replay ({name} turns, whole history each turn): total TTFT ≥ 5× "
                     f"lower than {label}", r, 5.0, notes,
                f"{fmt(on)} vs {fmt(speed(size, peer, 'chat', name, 'ttft_ms_sum'))} ms; total "
                f"time {fmt(tot)} vs {fmt(peer_tot)} ms"))
    return out


def _spec(key: str, size: dict) -> list[dict]:
    out = []
    for name in sorted(get(size, "runners", "engine_on", "spec") or {}, key=int):
        B = int(name)
        on = speed(size, "engine_on", "spec", name, "decode_tok_s")
        peers = [("engine", "speculation off", 1.5 if B == 1 else 1.0)]
        if B == 1 and key == "trained":
            peers += [("genai", "onnxruntime-genai", 1.3), ("llamacpp", "llama.cpp (f32)", 1.3)]
        for peer, label, goal in peers:
            if peer != "engine" and get(size, "runners", peer, "spec") is None:
                continue
            if peer == "engine" and B == 1 and key != "trained":
                continue  # random-init sizes: batch 1 is a figure, not a target
            word = "never below" if goal == 1.0 else f"≥ {goal}×"
            notes = _spec_notes(size, B, key)
            base = paired_speed(size, "engine", peer, "spec", name, "decode_tok_s")
            if peer != "engine" and base is not None:
                notes.append(f"without speculation the engine ran at {base:.2f}× {label} "
                             f"here: the gain multiplies that")
            if (when := speed_date(size, peer)) is not None:
                notes.append(f"{label}'s figure is from an earlier run ({when}): the ratio is "
                             f"of best figures, not of paired rounds")
            if "step" in (size.get("label") or "") and "finished" not in size["label"]:
                notes.append("the model is a checkpoint of an unfinished default run (its label "
                             "says which step): its drafts' acceptance is its own")
            out.append(make_target(
                key, f"speculation {word} {label}, batch {B} (held-out code, decode tok/s)",
                paired_speed(size, "engine_on", peer, "spec", name, "decode_tok_s"), goal,
                notes,
                f"{fmt(on)} vs {fmt(speed(size, peer, 'spec', name, 'decode_tok_s'))} tok/s; "
                f"{_acceptance(size, 'engine_on', B)}"
                f"{per_round_speed(size, 'engine_on', peer, 'spec', name, 'decode_tok_s')}"))
    return out


def _loaded(size: dict) -> list[str]:
    """Why a llama.cpp comparison may not hold: how busy the machine was."""
    load = get(size, "meta", "load_before")
    if load is None or load < 2.0:
        return []
    return [f"measured at a 1-minute load average of {load:.1f} on 2 cores (other jobs beside "
            f"the runners' turns): every runner ran far below its speed on a quiet machine, "
            f"and this comparison has not been repeated on one"]


def _floor(size: dict, ours: str, theirs: str, p: str, cell: str) -> tuple[str, str]:
    """(a note, a detail) from the floor of kvserve's kernels at ``cell`` (``matmuls``,
    ``matmuls_int8``, ...: the matrix products alone of the artifact engine runner ``ours``
    runs, ``bench/runner_floor.py``), where it ran."""
    floor = "matmuls" + ours.removeprefix("engine")
    floor_tok_s = tok_s(size, floor, cell)
    r = paired(size, floor, theirs, cell)
    if floor_tok_s is None or r is None:
        return "", ""
    head = (f"kvserve's matrix products alone (the {p} artifact's, nothing between them: "
            f"bench/runner_floor.py) made {fmt(floor_tok_s)} tok/s in the same rounds, "
            f"{r:.2f}× llama.cpp's whole model")
    whole = paired(size, ours, floor, cell)
    share = "" if whole is None else f" (kvserve's whole step reached {whole:.2f} of them)"
    note = (head + share + ": onnxruntime's kernels alone are slower on this CPU than "
            "llama.cpp's whole step, so no change to kvserve's graph or engine can meet this "
            "target" if r < 1.0 else
            head + share + ": the rest of kvserve's step (attention, norms, activations, the "
            "engine) is what llama.cpp does faster")
    return note, f"; kvserve's matrix products alone {fmt(floor_tok_s)} tok/s ({r:.2f}×)"


def _llamacpp(key: str, size: dict) -> list[dict]:
    out = []
    for ours, theirs, p, q in LLAMACPP:
        if not get(size, "runners", theirs, "decode"):  # (the trained size: spec cells only)
            continue
        for B in (1, 8):
            cell = f"{B}x128"
            note, floor = _floor(size, ours, theirs, p, cell)
            out.append(make_target(
                key, f"kvserve {p}{blocks(get(size, 'runners', ours))} ≥ 1.0× llama.cpp {q}, "
                     f"batch {B} (128 new tokens)",
                paired(size, ours, theirs, cell), 1.0,
                ([note] if note else [])
                + ([LLAMA_SMALL] if key.startswith("bench-6m") else
                   [LLAMA_READS] if B == 1 and key.startswith("bench-100m") else [])
                + _loaded(size),
                f"{fmt(tok_s(size, ours, cell))} vs {fmt(tok_s(size, theirs, cell))} tok/s"
                + floor
                + ("" if run_date(size, ours) == run_date(size, theirs) else
                   f"; llama.cpp's figure from the run of {run_date(size, theirs)}, kvserve's "
                   f"from that of {run_date(size, ours)}: best over best, not paired rounds")))
    return out


def speed_targets(key: str, size: dict) -> list[dict]:
    return _prefix(key, size) + _chat(key, size) + _spec(key, size) + _llamacpp(key, size)
