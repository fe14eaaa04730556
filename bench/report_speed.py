"""Markdown tables of the prefix cache's and speculation's cells (``bench/speed_cells.py``) of
one size's results; ``bench/report.py`` puts them under the size's other tables."""
from __future__ import annotations

from .figures import fmt, get, speed, speed_date

SPEED_RUNNERS = ["engine", "engine_on", "genai", "llamacpp"]
LABELS = {"engine": "kvserve engine, prefix cache and speculation off",
          "engine_on": "kvserve engine, server defaults (prefix cache {mb} MB, speculation K "
                       "≤ {k})",
          "genai": "onnxruntime-genai 0.18 (every request prefilled whole)",
          "llamacpp": "llama.cpp (llama-cpp-python, f32)"}


def _label(size: dict, r: str) -> str:
    v = get(size, "runners", r) or {}
    if r == "engine_on" and "prefix_cache_mb" not in v:  # (results merged before it was kept)
        return "kvserve engine, server defaults (prefix cache and speculation on)"
    label = LABELS.get(r, r).format(mb=v.get("prefix_cache_mb"), k=v.get("speculative_tokens"))
    when = speed_date(size, r)
    return label if when is None else f"{label}, from an earlier run ({when})"


def _with(size: dict, group: str) -> list[str]:
    return [r for r in SPEED_RUNNERS if get(size, "runners", r, group)]


def prefix_chat_tables(size: dict) -> list[str]:
    lines: list[str] = []
    pre, chat = _with(size, "prefix"), _with(size, "chat")
    if pre:
        name = next(iter(get(size, "runners", pre[0], "prefix")))
        shared, tail = name.split("+")
        lines += ["", f"Shared prefix ({int(shared):,} shared tokens + {tail} of each "
                  f"request's own, batch 1): time to first token of a first request (nothing "
                  f"cached) and of a second one sharing the prefix, ms (each the best of its "
                  f"turns); a new shared prefix each repetition:", "",
                  "| runner | first request | second request | prompt tokens cached |",
                  "|---|---|---|---|"]
        for r in pre:
            e = get(size, "runners", r, "prefix", name)
            lines.append(f"| {_label(size, r)} | {fmt(e.get('first_ms'), 1)} | "
                         f"{fmt(e.get('second_ms'), 1)} | {fmt(e.get('cached_tokens'))} |")
    if chat:
        name = next(iter(get(size, "runners", chat[0], "chat")))
        e0 = get(size, "runners", chat[0], "chat", name)
        lens = e0.get("prompt_tokens") or []
        lines += ["", f"Chat replay ({name} turns, each request sending the whole history: "
                  f"prompts of {'/'.join(map(str, lens))} tokens: {_reply(lens)}), batch 1, "
                  f"ms summed over the turns (best conversation); a new "
                  f"conversation each repetition:", "",
                  "| runner | sum of TTFT | sum of total time | TTFT of the last turn | "
                  "prompt tokens cached |", "|---|---|---|---|---|"]
        for r in chat:
            e = get(size, "runners", r, "chat", name)
            cached = [c for c in e.get("cached_tokens") or [] if c is not None]
            last = (e.get("ttft_ms") or [None])[-1]
            lines.append(f"| {_label(size, r)} | {fmt(e.get('ttft_ms_sum'))} | "
                         f"{fmt(e.get('total_ms_sum'))} | {fmt(last, 1)}"
                         f" | {fmt(sum(cached)) if cached else '–'} |")
    return lines


def _reply(lens: list[int]) -> str:
    return "one turn" if len(lens) < 2 else "each adds the runner's own reply to the previous " \
        f"one and a new user turn, {lens[1] - lens[0]} tokens together"


def spec_table(size: dict) -> list[str]:
    runners = _with(size, "spec")
    if not runners:
        return []
    names = sorted(get(size, "runners", runners[0], "spec"), key=int)
    e0 = get(size, "runners", runners[0], "spec", names[0])
    meta = size.get("speed_meta") or size.get("meta") or {}
    files = meta.get("code_files") or []
    prompt = meta.get("code_prompt_tokens", "their first")
    n_files = len(files) or "?"
    per = e0["tokens"] // n_files if isinstance(n_files, int) else "?"
    lines = ["", f"Speculation: greedy continuation of {n_files} held-out standard-library "
             f"files ({per} new tokens each after {prompt} tokens of each file as the "
             f"prompt), batch 1 and 8; tok/s of the decode (after every row's first token) "
             f"and of the whole calls; acceptance = accepted / drafted tokens; 'same tokens' "
             f"compares each runner's greedy output with the engine's without speculation:",
             "",
             "| runner | " + " | ".join(f"batch {b} decode tok/s | batch {b} whole" for b in names)
             + " | acceptance | same tokens |", "|---|" + "---|---|" * len(names) + "---|---|"]
    ref = {b: speed(size, "engine", "spec", b, "tokens_sha") for b in names}
    for r in runners:
        cells, acc, same = [], [], []
        for b in names:
            e = get(size, "runners", r, "spec", b) or {}
            cells += [fmt(e.get("decode_tok_s")), fmt(e.get("tok_s"))]
            if e.get("acceptance") is not None:
                acc.append(f"{e['acceptance']:.0%} (b{b})")
            if ref[b] and e.get("tokens_sha"):
                same.append("yes" if e["tokens_sha"] == ref[b] else "no")
        lines.append(f"| {_label(size, r)} | " + " | ".join(cells)
                     + f" | {', '.join(acc) or '–'} | {'/'.join(same) or '–'} |")
    if files:
        lines += ["", "Held-out files (the default corpus's validation split, "
                  "`bench/trained.py`): " + ", ".join(f"`{f}`" for f in files) + "."]
    return lines
