"""Merging the passes of one runner (``kvserve bench --passes N``): this machine's speed drifts
by tens of percent within minutes, and runners measured one after another in separate
processes take that drift into their ratios. With several passes, in alternating runner order,
each cell keeps its best figure across the passes (the fastest time, the highest tok/s), so
that every runner is compared at the machine's best rather than at wherever the drift was
when its turn came. Peak memory keeps the worst (highest) figure."""
from __future__ import annotations

from typing import Any

# for a number under one of these keys, the better of two passes is ...
_LOWER = {"seconds", "p50", "p99", "mean", "load_seconds", "single_seconds",
          "concurrent_seconds"}  # ... the lower one
_HIGHER = {"tok_s", "single_tok_s", "concurrent_tok_s"}  # ... the higher one
_WORST = {"rss_peak_mb", "server_rss_peak_mb", "client_rss_peak_mb"}  # memory: the higher one


def merge_passes(passes: list[dict]) -> dict:
    """One runner's result dicts (one per pass) -> one, cell by cell (see the module doc).
    A pass that failed (``error``) is left out while another succeeded."""
    ok = [p for p in passes if "error" not in p] or passes
    out = ok[0]
    for p in ok[1:]:
        out = _merge(out, p, "")
    out["passes"] = len(passes)
    return out


def _merge(a: Any, b: Any, key: str) -> Any:
    if isinstance(a, dict) and isinstance(b, dict):
        if "tok_s" in a and "tok_s" in b:  # a timed cell: the better pass, whole
            return a if a["tok_s"] >= b["tok_s"] else b
        if "p50" in a and "p50" in b:  # inter-token latency: the pass with the lower median
            return a if a["p50"] <= b["p50"] else b
        return {k: (_merge(a[k], b[k], k) if k in b else a[k]) for k in a} | \
            {k: v for k, v in b.items() if k not in a}
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) \
            and not isinstance(a, bool) and not isinstance(b, bool):
        if key in _WORST or key in _HIGHER:
            return max(a, b)
        if key in _LOWER or _is_position(key):
            return min(a, b)
    return a


def _is_position(key: str) -> bool:
    """step_ms / ttft_ms cells are keyed by a position or prompt length: times in ms."""
    return key.isdigit()
