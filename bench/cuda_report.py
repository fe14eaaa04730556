"""The CUDA check's results (``cuda.json``, written by ``bench/cuda_check.py``) as Markdown:

    python -m kvserve.bench.cuda_report bench/results/cuda.json   # writes cuda.md beside it

docs/benchmarks.md quotes the figures of the committed ``bench/results/cuda.md``.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def _f(x, spec: str = ".3g") -> str:
    return "–" if x is None else format(x, spec)


def _precision_row(name: str, p: dict) -> str:
    if "error" in p:
        return f"| {name} | does not run: {p['error'].split(': ', 1)[-1]} | | | | | |"
    tf, g, e = p["teacher_forced"], p["greedy"], p["engine_exactness"]
    on = e["features_on"]
    enabled = e.get("enabled", {"any": any(on.values())})  # (results before "enabled")
    features = (f"cached {on['cached_prompt_tokens']} prompt tokens, accepted "
                f"{on['accepted']}/{on['drafted']} drafts") if any(enabled.values()) \
        else "prefix cache and speculation off (the default for this artifact)"
    exact = "yes" if e["tokens_equal"] and not e["errors"] else \
        f"no: {len(e['differing'])} of {e['requests']} requests differ"
    steps = sorted((int(k), v) for k, v in p["step_ms_bs16"].items())
    (near, a), (far, b) = steps[0], steps[-1]
    return (f"| {name} | {_f(tf['max_abs_logit'], '.2g')} | {g['agreement']:.1%} | "
            f"{exact} ({features}) | {p['bs1_tok_s']:,.0f} | "
            f"{a:.2f} at {near} / {b:.2f} at {far} | {b / a:.2f} |")


def _size(s: dict) -> list[str]:
    out = [f"### {s['size']}", ""]
    if "error" in s:
        return out + [f"Failed: {s['error']}", ""]
    out += ["| precision | max \\|Δlogit\\| vs CPU (teacher-forced, 16 × 128) | greedy "
            "agreement with CPU | engine: features on = off (14 requests) | batch-1 tok/s | "
            "batch-16 step ms at positions 16 / 1000 | ratio |", "|---|---|---|---|---|---|---|"]
    out += [_precision_row(name, s[name]) for name in ("fp32", "fp16", "int8", "int4",
                                                       "portable") if name in s]
    out.append("")
    ppl, srv, vt, sp = (s.get(k, {}) for k in ("fp16_perplexity", "server", "vs_transformers",
                                              "engine_speed"))
    if "relative_change" in ppl:
        out.append(f"- fp16 on the device against fp32 on the CPU, perplexity of a random "
                   f"text: {ppl['relative_change']:+.2e} (target ≤ 1%)")
    if "tokens_equal" in srv:
        out.append(f"- `kvserve serve --provider cuda`, one greedy request over gRPC: "
                   f"{'the' if srv['tokens_equal'] else 'NOT the'} in-process engine's "
                   f"{srv['tokens']} tokens")
    if "ratio" in vt:
        out.append(f"- batch 1, 128 tokens: kvserve {vt['artifact']} "
                   f"{vt['kvserve_bs1_tok_s']:,.0f} tok/s, transformers eager fp32 on the same "
                   f"GPU {vt['transformers_eager_fp32_bs1_tok_s']:,.0f}: {vt['ratio']:.1f}× "
                   f"(target ≥ 3×)")
    if "speculation_bs1" in sp:
        spec, pre = sp["speculation_bs1"], sp["prefix_ttft_ms"]
        idle = "" if spec["drafted"] else " (off by default on this precision: the same " \
            "engine both ways)"
        out.append(f"- the engine with the server's defaults against it with the speed "
                   f"features off ({vt.get('artifact', '?')}){idle}: a repeating prompt at "
                   f"batch 1 {spec['ratio']:.2f}× ({spec['accepted']} of {spec['drafted']} "
                   f"drafts accepted); a second request's first token through a "
                   f"{pre['shared_tokens']}-token shared prefix {pre['on']:.1f} ms against "
                   f"{pre['off']:.1f} ms; the engine against the raw runner loop "
                   f"{sp['plain_bs1']['ratio']:.2f}× at batch 1, "
                   f"{sp['plain_bs8']['ratio']:.2f}× at batch 8")
    rep = s.get("engine_repeatability", {})
    if rep and "error" not in rep:
        pairs = {k: v for k, v in rep.items() if isinstance(v, dict) and "tokens_equal" in v}
        parted = [k for k, v in pairs.items() if not v["tokens_equal"]]
        out.append(f"- the same workload run to run ({len(pairs)} pairs of engine runs): "
                   + ("all equal" if not parted else f"parted: {', '.join(parted)}"))
        if "runner_replays" in rep:
            out.append("- its model calls replayed without the engine (bench/call_replay.py), "
                       "calls whose logits differ: " + "; ".join(
                           f"{k.replace('~', ' against ')} {v['differing']} of {v['calls']}"
                           + (f" (up to {v['max_abs_logit']:.2g})" if v["differing"] else "")
                           for k, v in rep["runner_replays"].items()))
    return out + [""]


def render(res: dict) -> str:
    v = res.get("versions", {})
    head = [f"## The CUDA check ({res.get('provider', '?')})", "",
            f"{v.get('gpu', 'no GPU named')}; {v.get('machine', '')}; onnxruntime "
            f"{v.get('onnxruntime', '?')}, torch {v.get('torch', '?')}, transformers "
            f"{v.get('transformers', '?')}, python {v.get('python', '?')}"
            + (f"; {res['date']}" if res.get("date") else "") + ". Written by "
            "`kvserve bench --provider cuda` (bench/cuda_check.py); rendered by "
            "bench/cuda_report.py.", ""]
    return "\n".join(head + [line for s in res["sizes"] for line in _size(s)]).rstrip() + "\n"


def main(argv: list[str]) -> int:
    src = Path(argv[0])
    (src.with_suffix(".md")).write_text(render(json.loads(src.read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
