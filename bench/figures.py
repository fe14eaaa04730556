"""Reading one size's results JSON: figures by runner and cell, paired ratios over rounds, the
rooflines, and number formatting. Shared by ``bench/report.py`` (tables) and
``bench/targets.py`` (targets); imports neither."""
from __future__ import annotations

import math

from .roofline import score_flops_per_token

DECODE_COLS = ["1x128", "1x512", "8x128", "8x512", "16x128", "16x512"]


def get(d: dict, *path, default=None):
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return default
        d = d[p]
    return d


def blocks(res: dict | None) -> str:
    """' (blocks of 64: 4.5 bits a weight)' for a runner whose results record its int4
    artifact's ``quantization`` (the worker reads the manifest); '' otherwise."""
    q = (res or {}).get("quantization") or {}
    return f" (blocks of {q['block_size']}: {q.get('bits_per_weight', 0):g} bits a weight)" \
        if q.get("block_size") else ""


def ratio(a, b):
    return a / b if a and b else None


def fmt(x, digits: int = 0, unit: str = "") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if digits == 0:
        return f"{x:,.0f}{unit}"
    return f"{x:,.{digits}f}{unit}"


def tok_s(size: dict, runner: str, cell: str) -> float | None:
    return get(size, "runners", runner, "decode", cell, "tok_s")


def paired(size: dict, a: str, b: str, cell: str, cell_b: str | None = None
           ) -> float | None:
    """Runner ``a`` against runner ``b`` at a decode cell: the median over rounds of the ratio
    of their turns in the same round (measured seconds apart, so the machine's drift cancels),
    or the ratio of their best figures where the results have no turns or the two runners'
    figures come from different runs (``run_date``)."""
    pairs = sorted(_pairs(size, a, b, cell, cell_b))
    if not pairs:
        return ratio(tok_s(size, a, cell), tok_s(size, b, cell_b or cell))
    mid = len(pairs) // 2
    return pairs[mid] if len(pairs) % 2 else (pairs[mid - 1] + pairs[mid]) / 2


def run_date(size: dict, runner: str) -> str | None:
    """When the run that measured ``runner``'s decode cells started: its own
    (``runners_meta``, a ``--runners`` run merged in) or the size's."""
    meta = (size.get("runners_meta") or {}).get(runner) or size.get("meta") or {}
    return meta.get("date")


def _pairs(size: dict, a: str, b: str, cell: str, cell_b: str | None = None) -> list[float]:
    if run_date(size, a) != run_date(size, b):  # two runs: their rounds are not pairs
        return []
    ta = get(size, "runners", a, "decode", cell, "turns_tok_s") or []
    tb = get(size, "runners", b, "decode", cell_b or cell, "turns_tok_s") or []
    return [x / y for x, y in zip(ta, tb) if x and y]


def per_round(size: dict, a: str, b: str, cell: str) -> str:
    """'; per round 0.98/1.07/1.12' (the paired ratios a target's median comes from)."""
    pairs = _pairs(size, a, b, cell)
    return f"; per round {'/'.join(f'{x:.2f}' for x in pairs)}" if len(pairs) > 1 else ""


def decode_columns(size: dict) -> list[str]:
    """The standard cells, plus any other batch x tokens cell some runner measured."""
    seen = {c for v in size.get("runners", {}).values() for c in (v.get("decode") or {})}
    extra = sorted(seen - set(DECODE_COLS), key=lambda c: tuple(map(int, c.split("x"))))
    return [c for c in DECODE_COLS if c in seen] + extra


def score_roofline(size: dict) -> dict | None:
    """Score's compute roofline: tokens/s at the best fp32 MatMul throughput measured on this
    machine, from the Score call's arithmetic per token (an upper bound: no graph does less)."""
    rf = size.get("roofline") or {}
    gflops, params = get(rf, "compute", "gflops"), get(rf, "fp32", "matmul_params")
    model = rf.get("model") or {}
    sc = get(size, "runners", "engine", "score")
    if not (gflops and params and model and sc):
        return None
    flops = score_flops_per_token(params, model["n_layers"], model["d_model"], sc["tokens"])
    return {"tok_s": gflops * 1e9 / flops, "mflop": flops / 1e6, "gflops": gflops}


def step_floor(size: dict, batch: int, step16_ms: float | None) -> dict | None:
    """The least step(1000) / step(16) can be on this machine: step(16) plus the time to read
    the extra 984 cache rows per sequence (fp32 K and V of every layer) at the measured read
    bandwidth, with the rest of the step unchanged and the attention arithmetic free."""
    rf = size.get("roofline") or {}
    row, gbps = get(rf, "model", "kv_bytes_per_token"), get(rf, "bandwidth", "gbps")
    if not (row and gbps and step16_ms):
        return None
    extra = batch * (1000 - 16) * row
    ms = extra / (gbps * 1e9) * 1e3
    return {"extra_mb": extra / 1e6, "gbps": gbps, "extra_ms": ms,
            "ratio": (step16_ms + ms) / step16_ms}


# --- the prefix cache's and speculation's cells (bench/speed_cells.py) -------------------------
def speed(size: dict, runner: str, group: str, name: str, field: str):
    """A runner's best figure at a speed cell, e.g. (engine_on, prefix, 1000+16, second_ms)."""
    return get(size, "runners", runner, group, name, field)


def speed_date(size: dict, runner: str) -> str | None:
    """The earlier run a runner's speed cells come from (``merge.merge_speed``); None: the
    size's latest speed run (``speed_meta``)."""
    return get(size, "runners", runner, "speed_date")


def _speed_pairs(size: dict, a: str, b: str, group: str, name: str, field: str
                 ) -> list[float]:
    """a's turns over b's at a speed cell, round by round ([] where the two were measured in
    different runs: their rounds are not pairs)."""
    if speed_date(size, a) != speed_date(size, b):
        return []
    ta = speed(size, a, group, name, f"turns_{field}") or []
    tb = speed(size, b, group, name, f"turns_{field}") or []
    return [x / y for x, y in zip(ta, tb) if x and y]


def per_round_speed(size: dict, a: str, b: str, group: str, name: str, field: str) -> str:
    """'; per round 0.98/1.07/1.12' at a speed cell (the paired ratios a target's median
    comes from), in the rounds' order."""
    pairs = _speed_pairs(size, a, b, group, name, field)
    return f"; per round {'/'.join(f'{x:.2f}' for x in pairs)}" if len(pairs) > 1 else ""


def paired_speed(size: dict, a: str, b: str, group: str, name: str, field: str
                 ) -> float | None:
    """a's figure over b's at a speed cell: the median over rounds of their turns' ratio
    (``turns_<field>``), or the ratio of their best figures where there are no turns or the
    two were measured in different runs (``speed_date``)."""
    pairs = sorted(_speed_pairs(size, a, b, group, name, field))
    if not pairs:
        return ratio(speed(size, a, group, name, field), speed(size, b, group, name, field))
    mid = len(pairs) // 2
    return pairs[mid] if len(pairs) % 2 else (pairs[mid - 1] + pairs[mid]) / 2
