"""What an artifact's JSON files and graphs must look like before anything is sized from them.
Torch-free; used by ``verify`` (and so by the server before it loads anything).

- ``load_json``: a size cap before reading, nesting depth bounded, no RecursionError.
- ``check_manifest``: types, sizes and nesting of manifest.json.
- ``check_model_config``: config.json's numbers within sane bounds (a tampered
  ``n_layers = 1e9`` is refused here, not by a MemoryError minutes later).
- ``graph_dims`` / ``check_config_against_graphs``: the config agrees with the shapes the ONNX
  graphs declare (layers, KV heads, head size, vocabulary, query heads where an attention
  graph states them), and ``max_seq_len`` fits the graphs' position tables (``position_rows``).
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from .manifest import FORMAT_VERSION
from .spec import FUSED_SMALL_INPUTS, POSITION_TABLES, ROPE_COS, ROPE_SIN

MAX_MANIFEST_BYTES = 4 << 20
MAX_CONFIG_BYTES = 256 << 10
MAX_DEPTH = 12  # the manifest nests 5 deep (graphs.<name>.io.<tensor>.shape)
MAX_FILES = 10_000
MAX_GRAPHS = 32
MAX_FILE_BYTES = 1 << 44  # 16 TiB
SHA256 = re.compile(r"[0-9a-f]{64}")
REQUIRED_GRAPHS = ("prefill", "decode")  # a portable artifact's (the fused one: runtime.main)

# config.json bounds: far above any real model, far below what would allocate terabytes
CONFIG_BOUNDS = {
    "vocab_size": 1 << 22,   # 4M tokens (largest vocabularies in use: ~256k)
    "d_model": 1 << 16,
    "n_layers": 1024,
    "n_heads": 1024,
    "n_kv_heads": 1024,
    "d_ff": 1 << 20,
    "max_seq_len": 1 << 24,  # 16M positions
}


class SchemaError(ValueError):
    """The file is not what an artifact holds; the message says what and where."""


def _depth(obj: Any, limit: int) -> int:
    """Nesting depth of parsed JSON, iteratively (deep input cannot recurse here)."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if d > limit:
            return d
        deepest = max(deepest, d)
        if isinstance(o, dict):
            stack.extend((v, d + 1) for v in o.values())
        elif isinstance(o, list):
            stack.extend((v, d + 1) for v in o)
    return deepest


def load_json(path: Path, what: str, max_bytes: int, data: bytes | None = None) -> Any:
    """Parse a JSON file (or its ``data`` already read) within ``max_bytes`` and MAX_DEPTH."""
    if data is None:
        size = path.stat().st_size
        if size > max_bytes:
            raise SchemaError(f"{what} has {size} bytes; the limit is {max_bytes}")
        data = path.read_bytes()
    if len(data) > max_bytes:
        raise SchemaError(f"{what} has {len(data)} bytes; the limit is {max_bytes}")
    try:
        obj = json.loads(data.decode("utf-8"))
    except RecursionError:
        raise SchemaError(f"{what} is nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise SchemaError(f"{what} is not valid JSON ({type(e).__name__})") from None
    if _depth(obj, MAX_DEPTH) > MAX_DEPTH:
        raise SchemaError(f"{what} is nested more than {MAX_DEPTH} levels deep")
    return obj


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise SchemaError(msg)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _str_list(v: Any, what: str, max_len: int = 4096) -> None:
    _need(isinstance(v, list) and len(v) <= max_len and all(isinstance(x, str) and len(x) <= 256
                                                           for x in v),
          f"manifest.json: {what} must be a list of names")


def _check_runtime(rt: Any, graphs: dict) -> None:
    """manifest.runtime (``kvserve.artifact.spec.runtime_section``): what the runners read."""
    _need(isinstance(rt, dict) and rt.get("kind") in ("fused", "portable"),
          "manifest.json: runtime must be an object whose kind is fused or portable")
    roles = rt.get("graphs")
    _need(isinstance(roles, dict) and 0 < len(roles) <= MAX_GRAPHS
          and all(isinstance(v, str) and len(v) <= 1024 for v in roles.values()),
          "manifest.json: runtime.graphs must map roles to file names")
    files = {g.get("file") for g in graphs.values() if isinstance(g, dict)}
    _need(set(roles.values()) <= files, "manifest.json: runtime.graphs names a file that is "
                                        "not one of the graphs")
    if rt["kind"] == "fused":
        _need("main" in roles, "manifest.json: a fused artifact's runtime.graphs has no main")
    names = rt.get("names")
    _need(isinstance(names, dict) and all(
        isinstance(names.get(k), str) and names[k].count("%d") == 1 and len(names[k]) <= 128
        for k in ("past_key", "past_value", "present_key", "present_value", "attn_weights")),
        "manifest.json: runtime.names must hold the five %d name templates")
    kv = rt.get("kv")
    _need(isinstance(kv, dict) and kv.get("dtype") in ("float32", "float16")
          and all(_is_int(kv.get(k)) and 0 < kv[k] <= 65_536
                  for k in ("num_layers", "num_kv_heads", "head_size")),
          "manifest.json: runtime.kv must give dtype, num_layers, num_kv_heads, head_size")
    host = rt.get("host_inputs", [])
    _need(isinstance(host, list) and len(host) <= 16 and all(isinstance(x, str) for x in host),
          "manifest.json: runtime.host_inputs must be a list of input names")
    _need(isinstance(rt.get("paired_attention", False), bool),
          "manifest.json: runtime.paired_attention must be true or false")
    rows = rt.get("logits_rows")  # absent in fused artifacts exported before it existed
    if rows is not None:
        main = next((g for g in graphs.values() if isinstance(g, dict)
                     and g.get("file") == roles.get("main")), None)
        inputs = main.get("inputs") if isinstance(main, dict) else None
        _need(isinstance(rows, str) and rows not in FUSED_SMALL_INPUTS
              and isinstance(inputs, list) and rows in inputs,
              "manifest.json: runtime.logits_rows must be an input name of the main graph")


def check_manifest(m: Any) -> dict:
    """manifest.json's structure: the fields verify and the runtime read, with their types."""
    _need(isinstance(m, dict), "manifest.json must be a JSON object")
    files, graphs = m.get("files"), m.get("graphs")
    _need(isinstance(files, dict), "manifest.json: files must be an object (path -> entry)")
    _need(len(files) <= MAX_FILES, f"manifest.json lists {len(files)} files; the limit is "
                                   f"{MAX_FILES}")
    for rel, entry in files.items():
        _need(isinstance(entry, dict) and len(rel) <= 1024,
              f"manifest.json: files[{rel[:80]!r}] must be an object")
        _need(isinstance(entry.get("sha256"), str) and SHA256.fullmatch(entry["sha256"])
              is not None, f"manifest.json: files[{rel!r}].sha256 must be 64 hex digits")
        _need(_is_int(entry.get("bytes")) and 0 <= entry["bytes"] <= MAX_FILE_BYTES,
              f"manifest.json: files[{rel!r}].bytes must be an integer in [0, 2^44]")
    _need(isinstance(graphs, dict) and 0 < len(graphs) <= MAX_GRAPHS,
          f"manifest.json: graphs must be an object of 1 to {MAX_GRAPHS} graphs")
    runtime = m.get("runtime")
    if not isinstance(runtime, dict) or runtime.get("kind") == "portable":
        for name in REQUIRED_GRAPHS:
            _need(name in graphs, f"manifest.json: graphs has no {name!r} graph")
    if runtime is not None:
        _check_runtime(runtime, graphs)
    for name, g in graphs.items():
        _need(isinstance(g, dict) and isinstance(g.get("file"), str)
              and 0 < len(g["file"]) <= 1024,
              f"manifest.json: graphs[{name[:80]!r}] must be an object with a file name")
        for key in ("inputs", "outputs"):
            if key in g:
                _str_list(g[key], f"graphs[{name!r}].{key}")
        _need("io" not in g or isinstance(g["io"], dict),
              f"manifest.json: graphs[{name!r}].io must be an object")
    for key in ("format_version", "opset"):
        _need(key not in m or _is_int(m[key]), f"manifest.json: {key} must be an integer")
    version = m.get("format_version", 1)
    _need(1 <= version <= FORMAT_VERSION,
          f"manifest.json: format_version {_show(version)} is not one this kvserve reads "
          f"(1 to {FORMAT_VERSION}): it was made by a newer kvserve; upgrade, or export it with "
          f"this one")
    for key in ("precision", "present_layout", "kv_dtype"):
        _need(key not in m or isinstance(m[key], str), f"manifest.json: {key} must be a string")
    for key in ("model", "optimized_for", "parity", "perplexity", "producer", "quantization",
                "source"):
        _need(key not in m or isinstance(m[key], dict), f"manifest.json: {key} must be an "
                                                        f"object")
    opt = m.get("optimized_for")
    if opt:
        _need(all(isinstance(opt.get(k), str) for k in ("provider", "onnxruntime"))
              and isinstance(opt.get("cpu_flags", []), list),
              "manifest.json: optimized_for must name provider, onnxruntime and cpu_flags")
    return m


def check_model_config(d: Any):
    """config.json -> ModelConfig, every number bounded first (a ModelConfig is never built
    from an unbounded one)."""
    from kvserve.model.config import ModelConfig

    _need(isinstance(d, dict), "config.json must be a JSON object")
    for key, bound in CONFIG_BOUNDS.items():
        v = d.get(key)
        if v is None and key in ("n_kv_heads", "d_ff"):
            continue  # derived defaults
        _need(_is_int(v) and 1 <= v <= bound,
              f"config.json: {key} must be an integer in [1, {bound}], got {_show(v)}")
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = d.get(key)
        _need(v is None or (_is_int(v) and 0 <= v < d["vocab_size"]),
              f"config.json: {key} must be null or a token id in [0, vocab_size)")
    for key in ("rope_base", "norm_eps", "dropout", "init_std"):
        v = d.get(key, 1.0)
        _need(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
              f"config.json: {key} must be a finite number")
    _need(isinstance(d.get("extra", {}), dict), "config.json: extra must be an object")
    try:
        return ModelConfig.from_dict(d)
    except (TypeError, ValueError) as e:
        raise SchemaError(f"config.json: {str(e)[:200]}") from None


def _show(v: Any) -> str:
    return repr(v)[:40]


# --- the config against the graphs -------------------------------------------------------------
def graph_dims(model) -> dict[str, int]:
    """What an ONNX graph's declared I/O shapes say about the model (loaded without external
    data): n_layers (past/present tensors), n_kv_heads and head_dim (their dims 1 and 3),
    vocab_size (logits' last dim), n_heads (attention weights' dim 1, when exported)."""
    dims: dict[str, set[int]] = {}

    def shape(v) -> list:
        return [d.dim_value if d.HasField("dim_value") else None
                for d in v.type.tensor_type.shape.dim]

    layers = set()
    for v in list(model.graph.input) + list(model.graph.output):
        m = re.fullmatch(r"(?:past_key_values|present)\.(\d+)\.(?:key|value)", v.name)
        s = shape(v)
        if m:
            layers.add(int(m.group(1)))
            if len(s) == 4:
                dims.setdefault("n_kv_heads", set()).add(s[1])
                dims.setdefault("head_dim", set()).add(s[3])
        elif v.name == "logits" and len(s) == 3:
            dims.setdefault("vocab_size", set()).add(s[2])
        elif re.fullmatch(r"attn_weights\.\d+", v.name) and len(s) == 4:
            dims.setdefault("n_heads", set()).add(s[1])
    out = {}
    if layers:
        out["n_layers"] = max(layers) + 1
    for key, values in dims.items():
        values.discard(None)
        if len(values) > 1:
            raise SchemaError(f"the graph declares different {key} values {sorted(values)}")
        if values:
            out[key] = values.pop()
    return out


def position_rows(model, paired: bool = False) -> int | None:
    """The positions a graph can serve: the fewest rows of its per-position tables (RoPE's
    cos / sin, a learned or sinusoidal position table), None when it has none (its rows are
    computed from the positions). ``paired`` (``FusedSpec.paired``): the attention's extra
    row takes RoPE's row one past the call's last position, so those tables serve one less."""
    rows = [int(t.dims[0]) - (paired and t.name in (ROPE_COS, ROPE_SIN))
            for t in model.graph.initializer if t.name in POSITION_TABLES and t.dims]
    return min(rows) if rows else None


def check_config_against_graphs(cfg, graphs: dict[str, Any], paired: bool = False) -> None:
    """``graphs``: name -> onnx ModelProto (without external data). Every dimension a graph
    declares must be the config's, and its position tables must cover ``max_seq_len`` (a
    longer one, edited into config.json, failed inside onnxruntime at the first position
    past the table)."""
    want = {"n_layers": cfg.n_layers, "n_kv_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
            "vocab_size": cfg.vocab_size, "n_heads": cfg.n_heads}
    for name, model in graphs.items():
        got = graph_dims(model)
        for key, value in got.items():
            _need(value == want[key], f"config.json does not match graph {name}: {key} "
                                      f"{want[key]} in config.json, {value} in the graph")
        rows = position_rows(model, paired)
        _need(rows is None or cfg.max_seq_len <= rows,
              f"config.json does not match graph {name}: max_seq_len {cfg.max_seq_len} in "
              f"config.json, position tables of {rows} rows in the graph")
        if name in REQUIRED_GRAPHS:
            _need("vocab_size" in got and "n_layers" in got,
                  f"graph {name} declares no logits or KV tensors")
