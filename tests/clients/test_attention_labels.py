"""``clients.attention``: the heatmap figure's labels in any script. Chinese token labels are
drawn with an installed CJK font after DejaVu Sans (no glyph missing); without one the figure
is still written (empty boxes for those glyphs)."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from kvserve.clients.attention import CJK_FONTS, font_family, render_attention  # noqa: E402
from kvserve.clients.messages import AttentionRow, TokenEvent  # noqa: E402

PROMPT = ["注意", "力", "机制", "是", "什么"]
GENERATED = ["？", "它", "是"]


def _events() -> list[TokenEvent]:
    P, n = len(PROMPT), len(GENERATED)
    out = []
    for k in range(n):
        w = np.random.default_rng(k).random(P + k)
        out.append(TokenEvent(index=k, id=k, text=GENERATED[k],
                              attention=[AttentionRow(layer=0, head=h, weights=list(w / w.sum()))
                                         for h in (0, 1)]))
    return out


def _missing_glyph_warnings(tmp_path) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = render_attention(tmp_path / "zh.png", _events(), PROMPT + GENERATED, len(PROMPT))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return [str(w.message) for w in caught if "missing from" in str(w.message)
            or "Glyph" in str(w.message)]


def test_font_family_is_dejavu_then_installed_cjk_fonts():
    family = font_family()
    assert family[0] == "DejaVu Sans" and set(family[1:]) <= set(CJK_FONTS)


def test_chinese_labels_draw_with_an_installed_cjk_font(tmp_path):
    if len(font_family()) == 1:
        pytest.skip("no CJK font installed (e.g. Debian's fonts-wqy-zenhei)")
    assert _missing_glyph_warnings(tmp_path) == []


def test_without_a_cjk_font_the_figure_is_still_written(tmp_path, monkeypatch):
    import kvserve.clients.attention as A
    monkeypatch.setattr(A, "CJK_FONTS", ())  # as on a machine with none installed
    got = _missing_glyph_warnings(tmp_path)  # one warning, naming the characters (not
    # matplotlib's, one per glyph and drawing pass)
    chars = set("".join(PROMPT + GENERATED))  # (none of them in DejaVu Sans)
    assert len(got) == 1 and got[0].startswith(f"{len(chars)} characters of the labels are "
                                               "missing from the installed fonts"), got
    assert all(c in got[0] for c in chars), got


@pytest.mark.parametrize("message", [
    "Glyph 27880 (\\N{CJK UNIFIED IDEOGRAPH-6CE8}) missing from font(s) DejaVu Sans.",  # 3.9+
    "Glyph 27880 (\\N{CJK UNIFIED IDEOGRAPH-6CE8}) missing from current font.",  # 3.8
])
def test_both_forms_of_matplotlibs_warning_are_gathered(message):
    from kvserve.clients.attention import _MISSING_GLYPH

    assert chr(int(_MISSING_GLYPH.match(message).group(1))) == "注"
