"""docs/serving.md's "Limits and errors" section is exactly what scripts/limits_table.py renders
from ServerConfig (so it cannot drift), and every limit field says what happens when it is
exceeded."""
from __future__ import annotations

import dataclasses
import re
import runpy
from pathlib import Path

import grpc

from kvserve.server.config import ServerConfig

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = runpy.run_path(str(ROOT / "scripts" / "limits_table.py"))


def test_doc_section_is_the_rendered_table():
    assert SCRIPT["DOC"] == ROOT / "docs" / "serving.md"
    text = SCRIPT["DOC"].read_text()
    assert text.count(SCRIPT["START"]) == 1 and text.count(SCRIPT["END"]) == 1
    assert SCRIPT["section"](text) == SCRIPT["render"](), \
        "docs/serving.md is stale: run python scripts/limits_table.py --write"
    assert SCRIPT["main"](["--check"]) == 0


def test_every_limit_field_has_a_row():
    fields = {f.name: f for f in dataclasses.fields(ServerConfig)}
    limits = [n for n, f in fields.items() if "limit" in f.metadata]
    # every max_* setting, plus the others that bound a request
    assert {n for n in fields if n.startswith("max_")} <= set(limits)
    assert {"request_time_limit", "drain_grace", "score_chunk_floats"} <= set(limits)
    rendered = SCRIPT["render"]()
    for name in limits:
        assert f"`--{name.replace('_', '-')}`" in rendered
        assert f"`KVSERVE_{name.upper()}`" in rendered
        what = fields[name].metadata["limit"]
        assert what.startswith("not an error") or re.search(r"\b[A-Z]+(_[A-Z]+)+\b|UNAVAILABLE",
                                                           what), (name, what)


def test_status_table_names_real_codes():
    codes = [c for c, _ in SCRIPT["STATUS_CODES"]]
    for c in codes:
        assert hasattr(grpc.StatusCode, c)
    from kvserve.server.servicer import _STATUS

    assert {s.name for s in _STATUS.values()} <= set(codes)


def test_write_appends_markers_when_missing(tmp_path):
    doc = tmp_path / "serving.md"
    doc.write_text("# x\n\nintro\n")
    assert SCRIPT["write"](doc)
    text = doc.read_text()
    assert text.startswith("# x\n\nintro\n")
    assert SCRIPT["section"](text) == SCRIPT["render"]()
    assert not SCRIPT["write"](doc)  # idempotent
