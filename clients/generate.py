"""``kvserve generate "PROMPT" --server HOST:PORT``: stream a completion to the terminal.

Text goes to stdout as it arrives (flushed per delta); the summary line (finish reason, token
counts, timings) goes to stderr. ``--logprobs N`` prints a table of the chosen tokens' logprobs
and the top-N alternatives after the text; ``--json`` prints one JSON object per event instead;
``--attention out.png`` asks for attention diagnostics and draws layer x head heatmaps.
Failures print one line ``kvserve generate: CODE: message`` and exit 1.

Sampling by default (as llama.cpp's CLI): temperature 0.8, top-k 40, top-p 0.95, with a random
seed printed on stderr so that a run can be repeated (``--seed N``); a small model's greedy
continuation is mostly a loop. ``--greedy`` takes the most likely token at every step. Any
explicit ``--temperature`` / ``--top-k`` / ``--top-p`` / ``--min-p`` means what it always meant:
the ones not given are off (``--temperature 0`` is greedy).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from .common import add_connection_arguments, client_from_args, fail, uint32, uint64

if TYPE_CHECKING:  # grpc and the client load when the command runs, not for --help
    from .client import Completion, TokenEvent

log = logging.getLogger(__name__)


def _int_list(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="prompt text ('-' reads it from stdin)")
    add_connection_arguments(parser, timeout=120.0, resume=True)
    s = parser.add_argument_group(
        "sampling (default: temperature 0.8, top-k 40, top-p 0.95 and a printed random seed; "
        "given any of --temperature/--top-k/--top-p/--min-p, the others are off; no penalties)")
    s.add_argument("--greedy", action="store_true",
                   help="the most likely token at every step (temperature 0)")
    s.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    s.add_argument("--top-k", type=uint32, default=None, help="0 = off")
    s.add_argument("--top-p", type=float, default=None, help="(0, 1]; unset = off")
    s.add_argument("--min-p", type=float, default=None, help="[0, 1]; 0 = off")
    s.add_argument("--repetition-penalty", type=float, default=None, help="unset = off (1)")
    s.add_argument("--presence-penalty", type=float, default=0.0)
    s.add_argument("--frequency-penalty", type=float, default=0.0)
    s.add_argument("--seed", type=uint64, default=None,
                   help="same seed + params + prompt = same tokens")
    st = parser.add_argument_group("stopping")
    st.add_argument("--max-new-tokens", type=uint32, default=0, help="0 = the server's default")
    st.add_argument("--min-new-tokens", type=uint32, default=0,
                    help="EOS / stop tokens / stop strings are ignored before this many tokens")
    st.add_argument("--stop", action="append", default=[], metavar="STRING",
                    help="stop string (repeatable); matched across tokens, trimmed from the text")
    st.add_argument("--stop-token-id", action="append", type=uint32, default=[], metavar="ID",
                    help="stop token id (repeatable)")
    st.add_argument("--ignore-eos", action="store_true", help="keep going past EOS")
    c = parser.add_argument_group("constrained output (at most one; the server enforces it)")
    c.add_argument("--json-schema", default=None, metavar="FILE",
                   help="the output is JSON valid against this schema (a .json file)")
    c.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    c.add_argument("--regex", default=None, metavar="R", help="the output matches R")
    c.add_argument("--choice", action="append", default=None, metavar="TEXT",
                   help="the output is one of these (repeat the flag)")
    c.add_argument("--grammar", default=None, metavar="FILE",
                   help="the output follows this Lark grammar (llguidance's dialect)")
    o = parser.add_argument_group("output")
    o.add_argument("--logprobs", type=uint32, default=None, metavar="N",
                   help="show each chosen token's logprob and the N most likely alternatives "
                        "(0 = the chosen token only)")
    o.add_argument("--json", action="store_true",
                   help="print events as JSON lines (token events, then one complete event)")
    o.add_argument("--attention", default=None, metavar="OUT.png",
                   help="request attention diagnostics and draw heatmaps (layers x heads)")
    o.add_argument("--attention-layers", type=_int_list, default=None, metavar="0,1,..",
                   help="layers for --attention (default: all)")
    o.add_argument("--attention-heads", type=_int_list, default=None, metavar="0,1,..",
                   help="query heads for --attention (default: all)")
    o.add_argument("--request-id", default="", help="echoed by the server, used in its logs")
    o.add_argument("--quiet", action="store_true", help="no summary line on stderr")


# what `kvserve generate` samples with when no sampling flag is given (llama.cpp's defaults)
DEFAULT_SAMPLING = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.0}
_OFF = {"temperature": 0.0, "top_k": 0, "top_p": None, "min_p": 0.0}
MAX_PRINTED_SEED = 1 << 32


def sampling(args: argparse.Namespace) -> tuple[dict, str]:
    """The sampling fields of the request (with the seed), and the line to print about them
    ("" when there is nothing to say: greedy, or a seed the user gave). Raises ValueError when
    --greedy is combined with a sampling flag."""
    explicit = {k: getattr(args, k) for k in _OFF if getattr(args, k) is not None}
    if args.greedy:
        if explicit:
            flags = ", ".join("--" + k.replace("_", "-") for k in explicit)
            raise ValueError(f"--greedy cannot be combined with {flags}")
        return {**_OFF, "seed": args.seed}, ""
    chosen = {**_OFF, **explicit} if explicit else dict(DEFAULT_SAMPLING)
    seed, line = args.seed, ""
    if chosen["temperature"] > 0 and seed is None:
        import secrets

        seed = secrets.randbelow(MAX_PRINTED_SEED)
        shown = ", ".join(f"{k.replace('_', '-')} {v}" for k, v in chosen.items()
                          if v not in (None, 0, 0.0))
        line = (f"[sampling: {shown}, seed {seed} (--seed {seed} repeats this run; "
                f"--greedy for the most likely tokens)]")
    return {**chosen, "seed": seed}, line


def constraint_options(args: argparse.Namespace) -> dict:
    """The constraint flags as request options (files read here; ValueError: more than one,
    or a file that cannot be read)."""
    given = [f for f, v in (("--json-schema", args.json_schema), ("--json-object",
                            args.json_object or None), ("--regex", args.regex),
                            ("--choice", args.choice), ("--grammar", args.grammar))
             if v is not None]
    if len(given) > 1:
        raise ValueError(f"one constraint at most: {', '.join(given)}")

    def read(path: str) -> str:
        try:
            return Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read {path}: {e.strerror if isinstance(e, OSError) else e}")
    if args.json_schema is not None:
        return {"json_schema": read(args.json_schema)}
    if args.grammar is not None:
        return {"grammar": read(args.grammar)}
    return {k: v for k, v in (("json_object", args.json_object), ("regex", args.regex),
                              ("choice", args.choice)) if v}


def _request_options(args: argparse.Namespace) -> dict:
    return dict(
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        max_new_tokens=args.max_new_tokens, min_new_tokens=args.min_new_tokens, stop=args.stop,
        stop_token_ids=args.stop_token_id, ignore_eos=args.ignore_eos,
        logprobs=args.logprobs is not None, top_logprobs=args.logprobs or 0,
        request_id=args.request_id)


def event_json(ev: TokenEvent | Completion) -> dict:
    """The JSON form of an event (attention weights and logits are left out: see --attention)."""
    from .client import TokenEvent

    d = asdict(ev)
    d.pop("attention", None)
    d.pop("logits", None)
    d.pop("tokens", None)
    if isinstance(ev, TokenEvent) and ev.logprob is None:
        d.pop("logprob")
        d.pop("top_logprobs")
    return {"type": ev.type, **d}


def summary_line(c: Completion) -> str:
    reason = c.finish_reason
    if c.finish_reason == "stop_sequence":
        reason += f" {c.stop_sequence!r}"
    elif c.finish_reason == "stop_token":
        reason += f" {c.stop_token_id}"
    t = c.timings
    rate = ""
    if c.generated_tokens > 1 and t.total_seconds > t.time_to_first_token_seconds:
        rate = f", {(c.generated_tokens - 1) / (t.total_seconds - t.time_to_first_token_seconds):.1f} tok/s"
    cached = f" ({c.cached_prompt_tokens} cached)" if c.cached_prompt_tokens else ""
    drafted = c.accepted_prediction_tokens + c.rejected_prediction_tokens
    predicted = (f" ({c.accepted_prediction_tokens} of {drafted} drafted from the prediction "
                 f"accepted)" if drafted else "")
    return (f"[finish: {reason}; prompt {c.prompt_tokens} tokens{cached}, generated "
            f"{c.generated_tokens}{predicted}; queue {t.queue_seconds * 1e3:.1f} ms, first token "
            f"{t.time_to_first_token_seconds * 1e3:.1f} ms, total {t.total_seconds * 1e3:.1f} ms"
            f"{rate}]" + (f" error: {c.error}" if c.error else ""))


def _show(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def logprob_table(tokens: list[TokenEvent], n_top: int) -> str:
    """A fixed-width table: index, token, id, logprob, probability, then the alternatives."""
    rows = [("#", "text", "id", "logprob", "prob", f"top {n_top}" if n_top else "")]
    for ev in tokens:
        tok = _show(ev.text if not ev.special else f"<special {ev.id}>")
        lp = ev.logprob if ev.logprob is not None else float("nan")
        alts = "  ".join(f"{_show(a.text)} {a.logprob:.3f}" for a in ev.top_logprobs)
        rows.append((str(ev.index), tok, str(ev.id), f"{lp:.4f}", f"{math.exp(lp):.3f}", alts))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    out = []
    for r in rows:
        cells = [r[0].rjust(widths[0]), r[1].ljust(widths[1]), r[2].rjust(widths[2]),
                 r[3].rjust(widths[3]), r[4].rjust(widths[4]), r[5]]
        out.append("  ".join(cells).rstrip())
    return "\n".join(out)


def main(args: argparse.Namespace) -> int:
    from .client import KvserveError, TokenEvent

    if not args.attention and (args.attention_layers is not None or args.attention_heads):
        return fail("generate", ValueError("--attention-layers and --attention-heads choose "
                                           "what --attention OUT.png draws: give --attention"))
    if args.attention:
        from .attention import require_matplotlib
        try:
            require_matplotlib()  # before the generation runs, not after
        except ImportError as e:
            return fail("generate", e, args.server)
    try:
        picked, sampling_line = sampling(args)
        picked.update(constraint_options(args))
    except ValueError as e:
        return fail("generate", e)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    out: TextIO = sys.stdout
    try:
        with client_from_args(args) as client:
            opts = {**_request_options(args), **picked}
            prompt_ids: list[int] = []
            if args.attention:
                info = client.model_info()
                if not info.attention_available:
                    return fail("generate", RuntimeError(
                        "the server has no attention diagnostics (its artifact was exported "
                        "without attention graphs)"))
                opts["attention_layers"] = args.attention_layers if args.attention_layers \
                    is not None else list(range(info.n_layers))
                opts["attention_heads"] = args.attention_heads or []
                prompt_ids = client.tokenize([prompt])[0]
            tokens: list[TokenEvent] = []
            done: Completion | None = None
            for ev in client.generate_stream(prompt, **opts):
                if sampling_line and not args.quiet:  # once the server has taken the request
                    print(sampling_line, file=sys.stderr, flush=True)
                    sampling_line = ""
                if args.json:
                    out.write(json.dumps(event_json(ev), ensure_ascii=False) + "\n")
                    out.flush()
                if isinstance(ev, TokenEvent):
                    tokens.append(ev)
                    if not args.json and ev.text:
                        out.write(ev.text)
                        out.flush()
                else:
                    done = ev
            if done is None:
                return fail("generate", RuntimeError("the stream ended without a Complete "
                                                     "event"))
            if not args.json:
                if done.text and not done.text.endswith("\n"):
                    out.write("\n")
                if args.logprobs is not None:
                    out.write("\n" + logprob_table(tokens, args.logprobs) + "\n")
                out.flush()
            if args.attention:
                from .attention import render_attention
                labels = client.detokenize([[i] for i in prompt_ids + [t.id for t in tokens]])
                path = render_attention(args.attention, tokens, labels, len(prompt_ids))
                if not args.quiet:
                    print(f"[attention heatmaps written to {path}]", file=sys.stderr)
    except KvserveError as e:
        return fail("generate", e, args.server)
    except (OSError, ValueError, ImportError) as e:
        return fail("generate", e, args.server)
    if not args.quiet:
        print(summary_line(done), file=sys.stderr, flush=True)
    return 1 if done.finish_reason == "error" else 0
