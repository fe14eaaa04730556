"""``kvserve score INPUT --out OUTPUT --server HOST:PORT``: score a file of texts, resumably.

INPUT is either text (one record per non-blank line; its id is the 1-based line number) or JSON
lines with ``id`` and ``text`` (``--format``; ``auto`` picks JSONL when the first non-blank line
is a JSON object with ``text``). OUTPUT gets one JSON line per id::

    {"id": ..., "token_count": T, "scored_tokens": T-1, "sum_logprob": ..., "mean_logprob": ...,
     "perplexity": ...}            (+ "tokens": [{"id", "logprob"}, ...] with --per-token)

Semantics are the server's Score: the first token of a text has no context and is not scored
(no BOS is prepended), so a text of T tokens has T-1 scored tokens, and ``sum_logprob``,
``mean_logprob`` = sum / (T-1) and ``perplexity`` = exp(-mean) are over those (a 1-token text:
sum 0, mean 0, perplexity 1; an empty text: token_count 0 and null statistics). The final
summary's corpus perplexity is exp(-sum of sum_logprob / sum of scored_tokens) over every record
in OUTPUT.

Resume: OUTPUT is opened for append; ids already in it are skipped, and a partially written last
line (an interrupted run) is truncated first. Records are written only once their batch has been
scored, whole lines at a time, so an interruption loses nothing that was written and a rerun
writes every missing id exactly once.

Failures: UNAVAILABLE / RESOURCE_EXHAUSTED (a server restarting, overloaded) are retried with
exponential backoff and jitter (``--retries``). INVALID_ARGUMENT on a batch (e.g. a text over the
context limit) splits the batch to find the culprit, which gets a record with ``"error"``; other
failures stop the run (exit 1) after writing what finished; rerun to resume.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from .common import add_connection_arguments, client_from_args, fail

if TYPE_CHECKING:  # grpc and the client load when the command runs, not for --help
    from .client import Client, ScoreResult

log = logging.getLogger(__name__)


class InputError(ValueError):
    pass


@dataclass(frozen=True)
class Item:
    id: Any  # a JSON value
    text: str

    @property
    def key(self) -> str:
        return id_key(self.id)


def id_key(i: Any) -> str:
    """Ids compare by their JSON form (1 and "1" are different ids)."""
    return json.dumps(i, sort_keys=True, ensure_ascii=False)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", help="text file (one text per line) or JSONL with id and text")
    parser.add_argument("--out", required=True, help="output JSONL (appended to; resumable)")
    parser.add_argument("--format", choices=("auto", "text", "jsonl"), default="auto",
                        help="input format (default %(default)s: JSONL when the first line is "
                             "an object with \"text\"; blank lines of a text file are skipped)")
    parser.add_argument("--batch-size", type=int, default=8,
                        help="texts per Score call (capped by the server's limit; default "
                             "%(default)s)")
    parser.add_argument("--concurrency", type=int, default=2,
                        help="Score calls in flight (default %(default)s)")
    parser.add_argument("--per-token", action="store_true",
                        help="include every scored token's id and logprob")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_connection_arguments(parser, timeout=300.0, retries=10)
    parser.add_argument("--max-backoff", type=float, default=5.0,
                        help="longest sleep between retries, seconds (default %(default)s)")


# --- input ----------------------------------------------------------------------------------------
def detect_format(path: Path) -> str:
    with path.open(encoding="utf-8-sig") as f:  # (a byte-order mark is not part of the data)
        for line in f:
            if line.strip():
                try:
                    obj = json.loads(line)
                except ValueError:
                    return "text"
                return "jsonl" if isinstance(obj, dict) and "text" in obj else "text"
    return "text"


def read_items(path: Path, fmt: str = "auto") -> list[Item]:
    try:
        return _read_items(path, fmt)
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text (byte {e.start} of a line cannot be "
                         f"decoded)") from None


def _read_items(path: Path, fmt: str) -> list[Item]:
    if fmt == "auto":
        fmt = detect_format(path)
    items: list[Item] = []
    seen: dict[str, int] = {}
    with path.open(encoding="utf-8-sig", newline="") as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\r\n") if fmt == "text" else line
            if not line.strip():
                continue
            if fmt == "text":
                item = Item(n, line)
            else:
                try:
                    obj = json.loads(line)
                except ValueError as e:
                    raise InputError(f"{path}:{n}: not JSON ({e})") from None
                if not isinstance(obj, dict) or "id" not in obj or \
                        not isinstance(obj.get("text"), str):
                    raise InputError(f"{path}:{n}: expected an object with \"id\" and a string "
                                     f"\"text\"")
                if isinstance(obj["id"], (dict, list)) or obj["id"] is None:
                    raise InputError(f"{path}:{n}: \"id\" must be a string or a number")
                try:
                    obj["text"].encode("utf-8")
                except UnicodeEncodeError as e:  # (JSON can carry a lone surrogate)
                    raise InputError(f"{path}:{n}: \"text\" is not valid Unicode (a lone "
                                     f"surrogate at character {e.start})") from None
                item = Item(obj["id"], obj["text"])
            if item.key in seen:
                raise InputError(f"{path}:{n}: duplicate id {item.key} (first on line "
                                 f"{seen[item.key]})")
            seen[item.key] = n
            items.append(item)
    return items


# --- output / resume ------------------------------------------------------------------------------
def repair_and_read_done(out: Path) -> dict[str, dict]:
    """Records already in ``out`` by id key. A last line without its newline (a run interrupted
    mid-write) is truncated away; any other unreadable line is an error."""
    if not out.exists():
        return {}
    data = out.read_bytes()
    if data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        log.warning("%s: dropping a partially written last line (%d bytes)", out,
                    len(data) - keep)
        with out.open("r+b") as f:
            f.truncate(keep)
        data = data[:keep]
    done: dict[str, dict] = {}
    for n, line in enumerate(data.decode("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            key = id_key(rec["id"])
        except (ValueError, KeyError, TypeError):
            raise InputError(f"{out}:{n}: not a score record; refusing to append to it") from None
        done[key] = rec
    return done


def record(item: Item, r: ScoreResult, per_token: bool) -> dict:
    rec = {"id": item.id, "token_count": r.token_count, "scored_tokens": r.scored_tokens,
           "sum_logprob": r.sum_logprob, "mean_logprob": r.mean_logprob,
           "perplexity": r.perplexity}
    if per_token:
        rec["tokens"] = [{"id": t.id, "logprob": t.logprob} for t in r.tokens]
    return rec


def empty_record(item: Item, per_token: bool) -> dict:
    rec = {"id": item.id, "token_count": 0, "scored_tokens": 0, "sum_logprob": 0.0,
           "mean_logprob": None, "perplexity": None}
    if per_token:
        rec["tokens"] = []
    return rec


def summarize(records: Sequence[dict]) -> dict:
    from .client import corpus_perplexity

    ok = [r for r in records if "error" not in r]
    total = sum(float(r.get("sum_logprob") or 0.0) for r in ok)
    tokens = sum(int(r.get("scored_tokens") or 0) for r in ok)
    return {"records": len(records), "errors": len(records) - len(ok), "scored_tokens": tokens,
            "sum_logprob": total, "corpus_perplexity": corpus_perplexity(total, tokens)}


# --- scoring --------------------------------------------------------------------------------------
def batches(items: Sequence[Item], size: int) -> Iterator[list[Item]]:
    for i in range(0, len(items), size):
        yield list(items[i:i + size])


def score_batch(client: Client, batch: list[Item], per_token: bool) -> list[dict]:
    """Records for ``batch``. INVALID_ARGUMENT splits the batch until the refused text is alone,
    which then gets an error record. Retries (transient errors) happen inside the client."""
    import grpc

    from .client import KvserveError

    todo = [it for it in batch if it.text]
    out = {it.key: empty_record(it, per_token) for it in batch if not it.text}
    if todo:
        try:
            results = client.score([it.text for it in todo])
        except KvserveError as e:
            if e.code is not grpc.StatusCode.INVALID_ARGUMENT:
                raise
            if len(todo) == 1:
                log.warning("id %s refused: %s", todo[0].key, e.one_line())
                out[todo[0].key] = {"id": todo[0].id, "error": e.one_line()}
            else:
                half = len(todo) // 2
                for part in (todo[:half], todo[half:]):
                    for rec in score_batch(client, part, per_token):
                        out[id_key(rec["id"])] = rec
        else:
            if len(results) != len(todo):
                raise KvserveError(grpc.StatusCode.INTERNAL,
                                   f"asked for {len(todo)} scores, got {len(results)}")
            for it, r in zip(todo, results):
                out[it.key] = record(it, r, per_token)
    return [out[it.key] for it in batch]


def run(client: Client, items: Sequence[Item], out: Path, *, batch_size: int, concurrency: int,
        per_token: bool, progress: bool | None) -> dict:
    """Score the items whose ids are not in ``out`` yet and append their records. Returns counts
    for this run; raises KvserveError (after writing every finished batch) on a fatal error."""
    from tqdm import tqdm

    from .client import KvserveError

    done = repair_and_read_done(out)
    todo = [it for it in items if it.key not in done]
    stats = {"input": len(items), "resumed": len(items) - len(todo), "written": 0, "errors": 0}
    if not todo:
        return stats
    concurrency = max(1, concurrency)
    # progress: True = always, False = never, None = when stderr is a terminal (tqdm's None)
    bar = tqdm(total=len(todo), unit="text", disable=None if progress is None else not progress,
               file=sys.stderr, dynamic_ncols=True)
    fatal: Any = None  # the first KvserveError
    with out.open("a", encoding="utf-8") as f, \
            cf.ThreadPoolExecutor(concurrency, thread_name_prefix="score") as pool:
        pending: set[cf.Future] = set()
        it = batches(todo, batch_size)

        def fill() -> None:
            while fatal is None and len(pending) < 2 * concurrency:
                b = next(it, None)
                if b is None:
                    return
                pending.add(pool.submit(score_batch, client, b, per_token))

        fill()
        while pending:
            finished, _ = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
            for fut in finished:
                pending.discard(fut)
                try:
                    recs = fut.result()
                except KvserveError as e:
                    fatal = fatal or e
                    continue
                # whole lines, flushed per batch: an interruption never splits a record except
                # at the very end, which the next run truncates
                f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs))
                f.flush()
                stats["written"] += len(recs)
                stats["errors"] += sum("error" in r for r in recs)
                bar.update(len(recs))
            fill()
        os.fsync(f.fileno())
    bar.close()
    if fatal is not None:
        fatal.stats = stats  # type: ignore[attr-defined]
        raise fatal
    return stats


def main(args: argparse.Namespace) -> int:
    from .client import KvserveError, RetryPolicy

    inp, out = Path(args.input), Path(args.out)
    if args.batch_size < 1 or args.concurrency < 1:
        return fail("score", ValueError("--batch-size and --concurrency must be >= 1"))
    try:
        items = read_items(inp, args.format)
    except (OSError, UnicodeDecodeError, InputError) as e:
        return fail("score", e, args.server)
    retry = RetryPolicy(max_attempts=max(0, args.retries) + 1, max_backoff=args.max_backoff)
    try:
        with client_from_args(args, retry=retry) as client:
            limit = int(client.model_info().limits.get("max_score_sequences") or 0)
            batch = min(args.batch_size, limit) if limit else args.batch_size
            if batch < args.batch_size:
                log.info("--batch-size %d capped at the server's limit of %d sequences per call",
                         args.batch_size, batch)
            stats = run(client, items, out, batch_size=batch, concurrency=args.concurrency,
                        per_token=args.per_token,
                        progress=False if args.no_progress else None)
    except KvserveError as e:
        s = getattr(e, "stats", None)
        if s:
            print(f"kvserve score: wrote {s['written']} records before the failure; rerun the "
                  f"same command to resume", file=sys.stderr)
        return fail("score", e, args.server)
    except (OSError, InputError) as e:
        return fail("score", e, args.server)
    total = summarize(list(repair_and_read_done(out).values()))
    print(f"scored {stats['written']} texts ({stats['resumed']} already in {out}, "
          f"{stats['errors']} refused); {out}: {total['records']} records, "
          f"{total['scored_tokens']} scored tokens, sum logprob {total['sum_logprob']:.4f}, "
          f"corpus perplexity {total['corpus_perplexity']:.4f}", file=sys.stderr, flush=True)
    return 1 if stats["errors"] else 0
