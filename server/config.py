"""ServerConfig: every server setting, each settable by a flag and by an env var KVSERVE_<NAME>.

Precedence: command-line flag > environment variable > default. The flag of field ``max_batch``
is ``--max-batch``; its env var is ``KVSERVE_MAX_BATCH``.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

ENV_PREFIX = "KVSERVE_"


def _opt(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


# (field, lowest, highest) of every numeric setting but two that validate() checks on their
# own: max_temperature (above 0) and default_max_new_tokens (up to max_new_tokens)
_BOUNDS = (
    ("port", 0, 65535),
    ("http_port", -1, 65535),
    ("metrics_port", -1, 65535),
    ("max_chat_messages", 1, 100_000),
    ("max_chat_chars", 1, 100_000_000),
    ("max_n", 1, 128),
    ("max_http_body_bytes", 1024, 1 << 30),
    ("max_batch", 1, 1024),
    ("max_queue", 0, 100_000),
    ("threads", 0, 1024),
    ("max_context", 0, 10_000_000),
    ("max_new_tokens", 1, 10_000_000),
    ("max_prompt_chars", 1, 1_000_000_000),
    ("max_stop_strings", 0, 1024),
    ("max_stop_string_chars", 1, 65_536),
    ("max_stop_token_ids", 0, 65_536),
    ("max_top_logprobs", 0, 1024),
    ("max_logits_floats", 0, 1_000_000_000),
    ("max_attention_floats", 0, 1_000_000_000),
    ("max_score_sequences", 1, 100_000),
    ("max_score_tokens", 1, 100_000_000),
    ("score_chunk_floats", 1, 1_000_000_000),
    ("prefill_chunk_tokens", 0, 65_536),
    ("max_repetition_penalty", 1, 1e6),
    ("max_abs_penalty", 0, 1e6),
    ("request_time_limit", 0, 7 * 86_400),
    ("stream_interval_ms", 0, 1000),
    ("stream_interval_max_ms", 0, 1000),
    ("max_concurrent_rpcs", 0, 100_000),
    ("drain_grace", 0, 86_400),
    ("prefix_cache_mb", 0, 1 << 20),
    ("speculative_tokens", 0, 16),
)


@dataclass
class ServerConfig:
    host: str = _opt("127.0.0.1", "address to listen on (0.0.0.0 for every interface)")
    port: int = _opt(50051, "gRPC port (0 = pick a free one)")
    metrics_port: int = _opt(-1, "Prometheus metrics HTTP port (0 = pick a free one, "
                                 "-1 = off)")
    http_port: int = _opt(-1, "OpenAI-compatible HTTP API port (/v1/completions, "
                              "/v1/chat/completions, /v1/models, /health; 0 = pick a free "
                              "one, -1 = off)")
    served_model_name: str = _opt("", "the model name of the HTTP API (/v1/models; requests "
                                      "naming another model get 404); empty = the artifact "
                                      "directory's name")
    port_file: str = _opt("", "write the bound gRPC (and metrics, HTTP) ports here as JSON once "
                              "serving")
    provider: str = _opt("auto", "onnxruntime execution provider", choices=("auto", "cpu", "cuda"))
    threads: int = _opt(0, "onnxruntime intra-op threads (0 = automatic)")
    spin: bool = _opt(True, "let idle onnxruntime threads spin between ops (lower latency; "
                            "off: they sleep, which leaves shared or busy cores to others)")
    tf32: bool = _opt(False, "CUDA: let fp32 matmuls use TF32 (faster; logits then differ from "
                             "the CPU provider by ~1e-3 instead of ~1e-6)")
    stream_interval_ms: float = _opt(20.0, "a streaming caller is woken at most once per this "
                                          "many ms (tokens ready together arrive together; "
                                          "first token and end at once; 0 = every token); "
                                          "with N callers streaming, N times this, up to "
                                          "--stream-interval-max-ms")
    stream_interval_max_ms: float = _opt(50.0, "the longest wake-up interval of many streaming "
                                               "callers (their wake-ups per second stay about "
                                               "1000 / --stream-interval-ms in all)")
    max_batch: int = _opt(8, "sequences decoded together in one step",
                          limit="not an error: further requests wait in the queue")
    max_queue: int = _opt(64, "requests waiting for a batch slot; beyond: RESOURCE_EXHAUSTED",
                          limit="RESOURCE_EXHAUSTED at once (Generate; Score calls in progress: "
                                "max_queue + 1); retry later")
    max_context: int = _opt(0, "prompt + new tokens per sequence (0 = the model's max_seq_len)",
                            limit="INVALID_ARGUMENT (a prompt, a Score sequence, or prompt + "
                                  "max_new_tokens over it)")
    default_max_new_tokens: int = _opt(64, "max_new_tokens when a request leaves it at 0",
                                       limit="not an error: the default, capped by the context "
                                             "left after the prompt")
    max_new_tokens: int = _opt(1024, "upper bound of max_new_tokens", limit="INVALID_ARGUMENT")
    max_prompt_chars: int = _opt(200_000, "upper bound of a text prompt, in characters",
                                 limit="INVALID_ARGUMENT (Generate text, each Score text, each "
                                       "Tokenize text; a Score or Tokenize call: 4x in all)")
    max_stop_strings: int = _opt(8, "stop strings per request", limit="INVALID_ARGUMENT")
    max_stop_string_chars: int = _opt(128, "characters per stop string",
                                      limit="INVALID_ARGUMENT")
    max_stop_token_ids: int = _opt(32, "stop token ids per request", limit="INVALID_ARGUMENT")
    max_top_logprobs: int = _opt(20, "top_logprobs per token",
                                 limit="INVALID_ARGUMENT (Generate and Score)")
    max_logits_floats: int = _opt(4_000_000, "return_logits: max_new_tokens x vocab floats "
                                             "per request", limit="INVALID_ARGUMENT")
    max_attention_floats: int = _opt(4_000_000, "attention diagnostics: floats per request",
                                     limit="INVALID_ARGUMENT")
    max_chat_messages: int = _opt(256, "messages per chat request (gRPC chat prompt, "
                                       "/v1/chat/completions)",
                                  limit="INVALID_ARGUMENT (HTTP: 400)")
    max_chat_chars: int = _opt(200_000, "characters of a chat request's message contents and "
                                        "roles, all messages together (the rendered prompt is "
                                        "then bounded like any prompt)",
                               limit="INVALID_ARGUMENT (HTTP: 400)")
    max_n: int = _opt(4, "choices per HTTP completion request (n x prompts)",
                      limit="HTTP 400 (the HTTP form of INVALID_ARGUMENT)")
    max_http_body_bytes: int = _opt(8 << 20, "bytes of an HTTP request body",
                                    limit="HTTP 413 (the HTTP form of RESOURCE_EXHAUSTED: send "
                                          "less)")
    max_score_sequences: int = _opt(32, "sequences per Score call", limit="INVALID_ARGUMENT")
    max_score_tokens: int = _opt(65_536, "tokens per Score call, all sequences together",
                                 limit="INVALID_ARGUMENT (also: tokens per Detokenize "
                                       "sequence, 4x per Detokenize call)")
    score_chunk_floats: int = _opt(8_000_000, "floats held at once: Score inputs, and prompts "
                                              "of artifacts that compute every position's "
                                              "logits (portable), go through the model in "
                                              "chunks whose logits (chunk x vocab) stay under "
                                              "it; a fused prefill chunk's attention scores "
                                              "(chunk x heads x cache rows) do",
                                   limit="not an error: longer inputs are prefilled in chunks")
    prefill_chunk_tokens: int = _opt(0, "prompt tokens per prefill call, where the artifact "
                                        "computes logits for the last position only (fused), "
                                        "as far as score_chunk_floats allows the attention "
                                        "scores (never fewer than asked): also the chunk a "
                                        "long prompt is fed per iteration while others "
                                        "stream, smaller for shorter pauses; 0: up to 512, "
                                        "never fewer than the logits cap's",
                                     limit="not an error: longer prompts are prefilled in "
                                           "chunks")
    prefix_cache_mb: int = _opt(256, "memory (MiB) of the prefix cache: KV rows of earlier "
                                     "prompts and outputs, reused by requests that begin with "
                                     "the same tokens (allocated once; 0 = off; Score's "
                                     "log-probabilities kept with its blocks take up to "
                                     "~4 KB of host memory a block beside it)",
                                limit="not an error: least recently used blocks are evicted")
    speculative_tokens: int = _opt(8, "most draft tokens a sequence verifies per step "
                                      "(n-gram speculative decoding: exact, adaptive, paused "
                                      "while it would lose speed; 0 = off)")
    constraint_fast_forward: bool = _opt(True, "feed the tokens a constraint forces (a JSON "
                                               "schema's fixed keys, ...) as that row's draft, "
                                               "verified in one call instead of one step each "
                                               "(exact; independent of speculative_tokens)")
    inexact_speedups: bool = _opt(False, "on unpaired int8, int4 and fp16 artifacts (paired "
                                         "ones run the features exactly), where calls of "
                                         "other shapes round a row up to ~1e-2 of the logits "
                                         "apart: the prefix cache, speculation and constraint "
                                         "fast-forward anyway, and a resume's delivered "
                                         "tokens prefilled (default: off there, exact; fp32 "
                                         "artifacts have them either way)")
    reasoning_parser: str = _opt("none", "HTTP chat: 'think' returns a reply's <think> ... "
                                         "</think> thought as the message's "
                                         "reasoning_content, apart from its content (Qwen3, "
                                         "DeepSeek-R1, SmolLM3); 'none': the reply as "
                                         "written", choices=("none", "think"))
    max_temperature: float = _opt(100.0, "upper bound of temperature",
                                  limit="INVALID_ARGUMENT (below 1e-5 is served as greedy)")
    max_repetition_penalty: float = _opt(100.0, "upper bound of repetition_penalty",
                                         limit="INVALID_ARGUMENT outside [1/limit, limit]")
    max_abs_penalty: float = _opt(100.0, "bound of |presence_penalty| and |frequency_penalty|",
                                  limit="INVALID_ARGUMENT")
    request_time_limit: float = _opt(0.0, "seconds a Generate may take from its arrival, "
                                          "time queued included (0 = no server limit; the "
                                          "caller's deadline always applies)",
                                      limit="the stream ends with Complete, finish_reason "
                                            "TIME_LIMIT (the caller's own deadline: "
                                            "DEADLINE_EXCEEDED); a request still queued then "
                                            "never started: RESOURCE_EXHAUSTED (HTTP 429), "
                                            "retryable")
    max_concurrent_rpcs: int = _opt(0, "gRPC calls in progress (0 = max_batch + max_queue + 16)",
                                    limit="RESOURCE_EXHAUSTED from gRPC itself")
    drain_grace: float = _opt(30.0, "seconds in-flight calls get to finish after SIGTERM",
                              limit="calls still in flight: UNAVAILABLE 'the server is shutting "
                                    "down'; new calls during the drain: UNAVAILABLE; streams "
                                    "of clients that resume move at once (UNAVAILABLE)")
    tls_cert: str = _opt("", "PEM certificate chain (enables TLS with --tls-key)")
    tls_key: str = _opt("", "PEM private key")
    auth_token: str = _opt("", "require `authorization: Bearer <token>` (health is exempt); "
                               "prefer the env var KVSERVE_AUTH_TOKEN over the flag")
    attention: bool = _opt(True, "load the attention-diagnostics graphs when present")
    attention_copy: bool = _opt(False, "give the attention-diagnostics graph its own packed "
                                       "copy of the weights: steps that carry attention run "
                                       "~3x faster, for the weights' size in memory (off: it "
                                       "reads them from the memory-mapped artifact; int4 / "
                                       "int8-block artifacts always take the copy)")
    attention_kernel: str = _opt("auto", "the CPU attention kernel of fused artifacts: "
                                         "kvserve's own (native/attention.cc, built at install "
                                         "or by `kvserve native build`; checked against "
                                         "onnxruntime's at load) where it is built and takes "
                                         "the graph's attention, else onnxruntime's "
                                         "GroupQueryAttention (auto); native: refuse to start "
                                         "without it; onnxruntime: always onnxruntime's",
                                 choices=("auto", "native", "onnxruntime"))
    verify: bool = _opt(True, "verify the artifact against its manifest before loading (off: "
                              "no sha256 or onnx.checker; paths, sizes, schema and the config "
                              "against the graphs are still checked)")
    trusted_key: str = _opt("", "Ed25519 public key (PEM): serve only an artifact whose "
                                "manifest is signed by it (manifest.sig)")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"invalid server config: {msg}")

        need(len(self.served_model_name) <= 256 and self.served_model_name.isprintable(),
             "served_model_name must be at most 256 printable characters")
        need(self.provider in ("auto", "cpu", "cuda"), "provider must be auto, cpu or cuda")
        for name, lo, hi in _BOUNDS:  # every number: a floor and a ceiling
            v = getattr(self, name)
            need(lo <= v <= hi, f"{name} must be in [{lo}, {hi}]")
        need(1 <= self.default_max_new_tokens <= self.max_new_tokens,
             "default_max_new_tokens must be in [1, max_new_tokens]")
        need(0 < self.max_temperature <= 1e6, "max_temperature must be in (0, 1e6]")
        need(self.stream_interval_max_ms >= self.stream_interval_ms,
             "stream_interval_max_ms must be at least stream_interval_ms")
        need(bool(self.tls_cert) == bool(self.tls_key), "tls_cert and tls_key go together")
        need(self.verify or not self.trusted_key, "trusted_key needs verify (the signature "
                                                  "covers the manifest, verify the files)")
        # the largest Score response (App._send_limit) must fit gRPC's message limit (2 GiB)
        need(self.max_score_tokens * (24 + 32 * self.max_top_logprobs) < (1 << 31) - (2 << 20),
             "max_score_tokens x max_top_logprobs: a Score response could pass gRPC's 2 GiB "
             "message limit (each token 24 bytes and 32 a top logprob): lower one of them")

    @property
    def concurrent_rpcs(self) -> int:
        return self.max_concurrent_rpcs or (self.max_batch + self.max_queue + 16)

    # --- flags and env ----------------------------------------------------------------------
    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            env = ENV_PREFIX + f.name.upper()
            help_ = f"{f.metadata.get('help', '')} (env {env}; default {f.default!r})"
            if f.type in ("bool", bool):
                parser.add_argument(flag, dest=f.name, default=None,
                                    action=argparse.BooleanOptionalAction, help=help_)
            else:
                typ = {"int": int, "float": float, "str": str}[str(f.type)]
                parser.add_argument(flag, dest=f.name, default=None, type=typ, help=help_,
                                    choices=f.metadata.get("choices"))

    @classmethod
    def from_args(cls, args: argparse.Namespace | None = None,
                  environ: dict[str, str] | None = None) -> "ServerConfig":
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            v = getattr(args, f.name, None) if args is not None else None
            if v is None:
                raw = environ.get(ENV_PREFIX + f.name.upper())
                if raw is not None and raw != "":
                    v = _parse_env(f, raw)
            if v is not None:
                values[f.name] = v
        return cls(**values)

    def public_dict(self) -> dict[str, Any]:
        """For logs: no secrets."""
        d = dataclasses.asdict(self)
        d["auth_token"] = "***" if self.auth_token else ""
        return d


def _parse_env(f: dataclasses.Field, raw: str) -> Any:
    name = ENV_PREFIX + f.name.upper()
    t = str(f.type)
    try:
        if t == "bool":
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if t == "int":
            return int(raw)
        if t == "float":
            return float(raw)
        return raw
    except ValueError:
        raise ValueError(f"invalid server config: {name}={raw!r} is not a valid {t}") from None
