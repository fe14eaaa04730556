"""Attention heatmaps from a Generate stream's diagnostics (``--attention out.png``).

The server sends, with generated token k, the attention rows of the query that produced it: the
query at position ``P + k - 1`` (P = prompt tokens), over the ``P + k`` positions before and at
it. Stacking the rows of the n generated tokens gives an n x (P + n - 1) lower-staircase matrix
per (layer, head); the figure is a grid of layers (rows) x heads (columns).
"""
from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    from .client import TokenEvent

log = logging.getLogger(__name__)

MAX_TICK_LABELS = 48
# matplotlib's warning: "... missing from font(s) X." (3.9 on), "... missing from current
# font." (3.8)
_MISSING_GLYPH = re.compile(r"Glyph (\d+) .*missing from (?:current )?font")
# fonts with CJK glyphs, used after DejaVu Sans for the glyphs it lacks, where installed (the
# reference articles, and many prompts, are Chinese); none installed: empty boxes, and one
# warning naming the characters (matplotlib's own "Glyph ... missing" come per glyph and pass)
CJK_FONTS = ("Noto Sans CJK SC", "Noto Sans CJK JP", "Noto Sans CJK TC", "Source Han Sans SC",
             "WenQuanYi Zen Hei", "WenQuanYi Micro Hei", "Droid Sans Fallback",
             "Microsoft YaHei", "SimHei", "PingFang SC", "Hiragino Sans GB", "Arial Unicode MS")


def attention_matrices(tokens: Sequence[TokenEvent], prompt_len: int
                       ) -> dict[tuple[int, int], np.ndarray]:
    """(layer, head) -> (n, P + n - 1) matrix; cells a query cannot see are NaN."""
    n = len(tokens)
    width = prompt_len + max(n - 1, 0)
    mats: dict[tuple[int, int], np.ndarray] = {}
    for k, ev in enumerate(tokens):
        for row in ev.attention:
            m = mats.setdefault((row.layer, row.head), np.full((n, width), np.nan, np.float32))
            w = np.asarray(row.weights, np.float32)[:width]
            m[k, :len(w)] = w
    return mats


def _label(s: str, limit: int = 12) -> str:
    s = s.encode("unicode_escape").decode("ascii") if not s.isprintable() else s
    return s if len(s) <= limit else s[:limit - 1] + "…"


def require_matplotlib() -> None:
    """Raise ImportError with the install hint when matplotlib is missing (checked before a
    generation is started, so a missing package never costs the run)."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise ImportError("--attention needs matplotlib: pip install 'kvserve[viz]'")


def font_family() -> list[str]:
    """DejaVu Sans (matplotlib's own), then the installed fonts of ``CJK_FONTS``: matplotlib
    takes each glyph from the first font of the family that has it."""
    from matplotlib import font_manager

    installed = {f.name for f in font_manager.fontManager.ttflist}
    return ["DejaVu Sans", *[f for f in CJK_FONTS if f in installed]]


def render_attention(path: str | Path, tokens: Sequence[TokenEvent], labels: Sequence[str],
                     prompt_len: int) -> Path:
    """Draw the heatmaps to ``path`` (PNG). ``labels``: the text of every token, prompt then
    generated."""
    require_matplotlib()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    glyphs: set[str] = set()
    # matplotlib warns per missing glyph and per drawing pass (three with this layout): those
    # are gathered into one warning; any other warning is shown as it would be
    with warnings.catch_warnings():  # (restores the filters and showwarning; one thread)
        warnings.filterwarnings("always", message=_MISSING_GLYPH.pattern)
        show = warnings.showwarning

        def gather(message, category, filename, lineno, file=None, line=None):
            m = _MISSING_GLYPH.match(str(message))
            if m:
                glyphs.add(chr(int(m.group(1))))
            else:
                show(message, category, filename, lineno, file, line)

        warnings.showwarning = gather
        with plt.rc_context({"font.family": font_family()}):
            out = _render(plt, path, tokens, labels, prompt_len)
    if glyphs:
        warnings.warn(f"{len(glyphs)} characters of the labels are missing from the installed "
                      f"fonts, drawn as empty boxes ({''.join(sorted(glyphs))[:40]}): install a "
                      f"font that has them (for CJK text e.g. Debian's fonts-wqy-zenhei)",
                      UserWarning, stacklevel=2)
    return out


def _render(plt, path: str | Path, tokens: Sequence[TokenEvent], labels: Sequence[str],
            prompt_len: int) -> Path:
    mats = attention_matrices(tokens, prompt_len)
    if not mats:
        raise ValueError("the server returned no attention rows")
    layers = sorted({k[0] for k in mats})
    heads = sorted({k[1] for k in mats})
    n = len(tokens)
    width = prompt_len + max(n - 1, 0)
    cell = min(0.25, 8.0 / max(width, 1))
    w_in = max(2.5, width * cell + 1.0)
    h_in = max(2.0, n * cell + 1.6)
    fig, axes = plt.subplots(len(layers), len(heads), squeeze=False, layout="constrained",
                             figsize=(min(60, w_in * len(heads)), min(60, h_in * len(layers))))
    xl = [_label(s) for s in labels[:width]]
    yl = [_label(s) for s in labels[prompt_len:prompt_len + n]]
    step_x = max(1, -(-len(xl) // MAX_TICK_LABELS))
    step_y = max(1, -(-len(yl) // MAX_TICK_LABELS))
    fs = 6 if max(width, n) > 24 else 8
    im = None
    for i, layer in enumerate(layers):
        for j, head in enumerate(heads):
            ax = axes[i][j]
            m = mats.get((layer, head))
            if m is None:
                ax.axis("off")
                continue
            im = ax.imshow(np.ma.masked_invalid(m), aspect="auto", cmap="viridis", vmin=0,
                           vmax=1, interpolation="nearest")
            ax.set_title(f"layer {layer}, head {head}", fontsize=fs + 1)
            ax.set_xticks(range(0, len(xl), step_x))
            ax.set_xticklabels(xl[::step_x], rotation=90, fontsize=fs)
            ax.set_yticks(range(0, len(yl), step_y))
            ax.set_yticklabels(yl[::step_y], fontsize=fs)
            if prompt_len < width:
                ax.axvline(prompt_len - 0.5, color="white", lw=0.6, ls="--")
    fig.supxlabel("attended position (prompt | generated)", fontsize=fs + 2)
    fig.supylabel("generated token (its producing query)", fontsize=fs + 2)
    if im is not None:
        fig.colorbar(im, ax=axes, shrink=0.6, label="attention weight")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, format="png")
    plt.close(fig)
    log.debug("wrote %s: %d layers x %d heads, %d x %d", path, len(layers), len(heads), n, width)
    return path
