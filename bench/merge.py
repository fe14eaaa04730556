"""Merging a partial run into a size's earlier results: ``--speed-only`` (``merge_speed``: the
prefix cache's and speculation's cells) and ``--runners`` (``merge_runners``: some runners'
cells). What the merged figures may be compared with is dated, so that no target pairs the
rounds of two runs (``bench/figures.py``)."""
from __future__ import annotations

import json

SPEED_GROUPS = ("prefix", "chat", "spec")


def merge_speed(old: dict, new: dict) -> dict:
    """A ``--speed-only`` run's cells merged into a size's earlier results: each runner's
    prefix / chat / spec groups replaced, runners new to the file added, the run's own meta
    kept apart (``speed_meta``), the label the new run's; everything else (and its meta) as it
    was. A runner whose speed cells this run did not measure (llama.cpp where it is not
    installed) keeps them, marked ``speed_date``: the run they come from, whose rounds pair
    with no turn of this one."""
    out = json.loads(json.dumps(old))
    measured = new.get("runners", {})
    earlier = (old.get("speed_meta") or old.get("meta") or {}).get("date", "an earlier run")
    for r, cur in out.get("runners", {}).items():  # speed cells this run did not measure:
        if r not in measured and any(g in cur for g in SPEED_GROUPS):  # not paired with its
            cur.setdefault("speed_date", earlier)  # turns (figures.paired_speed)
    for r, v in measured.items():
        cur = out.setdefault("runners", {}).setdefault(r, {})
        cur.pop("speed_date", None)
        if r not in old.get("runners", {}):
            cur.update(v)
            continue
        for g in SPEED_GROUPS:
            if g in v:
                cur[g] = v[g]
            else:
                cur.pop(g, None)
        for k in ("prefix_cache_mb", "speculative_tokens"):  # what the runner ran with
            if k in v:
                cur[k] = v[k]
        if v.get("error"):
            cur["speed_error"] = v["error"]
    out["speed_meta"] = new["meta"]
    # the model the new cells ran on (the trained size: which checkpoint; the same text for
    # the random-init sizes)
    out["label"] = new.get("label", out.get("label"))
    return out


def merge_runners(old: dict, new: dict) -> dict:
    """A ``--runners`` run merged into a size's earlier results: the runners it measured
    replace theirs (their cells measured together in this run), except the speed cells the
    results already have (measured with ``engine_on`` in a ``--speed-only`` run: their turns
    pair with its); the other runners and the earlier meta stay; the run's own meta goes to
    ``runners_meta`` (by runner). The run's roofline replaces the earlier one where it
    measured the engine: the tables set the engine's figures against it, and this machine's
    speed differs from run to run."""
    out = json.loads(json.dumps(old))
    for r, v in new.get("runners", {}).items():
        keep = {g: out["runners"][r][g] for g in SPEED_GROUPS
                if g in out.get("runners", {}).get(r, {})}
        out.setdefault("runners", {})[r] = {**v, **keep}
        out.setdefault("runners_meta", {})[r] = new["meta"]
    if "engine" in new.get("runners", {}) and new.get("roofline"):
        out["roofline"] = {**out.get("roofline", {}), **new["roofline"]}
    return out
