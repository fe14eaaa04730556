"""Assemble the server: verify and load the artifact, engine, gRPC server (auth, TLS, health,
reflection, limits), warm-up, metrics; and the drain on shutdown."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from concurrent import futures
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvserve import __version__
from kvserve.model.tokenizer import Tokenizer
from kvserve.v1 import inference_pb2 as pb
from kvserve.artifact.loader import load_lm
from kvserve.artifact.manifest import MANIFEST, TOKENIZER
from kvserve.v1 import inference_pb2_grpc as pb_grpc

from . import wire
from .auth import BearerTokenInterceptor
from .chat_template import ChatTemplate
from .config import ServerConfig
from .detok import TokenBytes
from .domain import GenerateRequest, OutputParams, StopParams
from .engine import Engine
from .guides import Guides
from .interfaces import NullMetrics
from .metrics import Metrics, MetricsServer
from .prompts import Prompts
from .servicer import InferenceServicer, model_info
from .state import ServingState
from .validation import Limits

if TYPE_CHECKING:
    from .http_api import HttpServer

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["Inference"].full_name  # kvserve.v1.Inference


class ArtifactError(Exception):
    """The artifact directory cannot be served; the message says why."""


def verify(artifact_dir: Path, trusted_key: str | None = None, full: bool = True) -> None:
    try:
        from kvserve.artifact.verify import VerifyError, verify_artifacts
    except ImportError as e:  # pragma: no cover - the export package ships with the server
        raise ArtifactError(f"cannot verify artifacts: {e}") from None
    try:
        verify_artifacts(artifact_dir, trusted_key=trusted_key or None, check_graphs=full,
                         check_hashes=full)
    except VerifyError as e:
        raise ArtifactError(str(e)) from None
    except PermissionError as e:  # e.g. a host export mounted into a container's other uid
        raise ArtifactError(_cannot_read(e.filename)) from None
    # verified: the tree holds the manifest's files only. Without --verify the weights were not
    # read yet: say now, in the same words, what onnxruntime would fail on later.
    for p in sorted(Path(artifact_dir).rglob("*")):
        if p.is_file() and not os.access(p, os.R_OK):
            raise ArtifactError(_cannot_read(p))


def _cannot_read(path) -> str:
    import pwd

    uid = os.geteuid()
    try:
        user = f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        user = f"uid {uid}"
    return (f"cannot read artifact file {path} as user {user}; make the artifact's files "
            f"readable by it (chmod a+r)")


class App:
    def __init__(self, artifact_dir: str | Path, cfg: ServerConfig):
        self.dir, self.cfg = Path(artifact_dir), cfg
        self.state = ServingState()
        self.metrics = Metrics()
        self.server: grpc.Server | None = None
        self.metrics_server: MetricsServer | None = None
        self.http_server: HttpServer | None = None
        self.port = 0
        self.http_port: int | None = None

    # --- load ------------------------------------------------------------------------------
    def load(self) -> None:
        t0 = time.monotonic()
        # without --verify still the cheap checks: nothing is sized from an unchecked config
        verify(self.dir, self.cfg.trusted_key, full=self.cfg.verify)
        try:
            self.lm = load_lm(self.dir, provider=self.cfg.provider,
                              threads=self.cfg.threads or None, spin=self.cfg.spin,
                              tf32=self.cfg.tf32, attention=self.cfg.attention,
                              attention_copy=self.cfg.attention_copy,
                              attention_kernel=self.cfg.attention_kernel)
            # verified: tokenizer.json is either listed in the manifest and intact, or absent
            tok_path = self.dir / TOKENIZER
            self.tokenizer = Tokenizer.from_file(tok_path) if tok_path.is_file() else None
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            # (RuntimeError: what the provider cannot run, e.g. a float32 cache on an
            # onnxruntime-gpu without a CUDA attention kernel for it; onnxruntime's own errors)
            raise ArtifactError(f"cannot load {self.dir}: {e}") from None
        mcfg = self.lm.cfg
        eos = mcfg.eos_token_id
        if self.tokenizer is None:
            self.token_bytes = TokenBytes.without_text(mcfg.vocab_size)
            log.warning("%s has no tokenizer.json: serving token ids only (text prompts, Score "
                        "texts, Tokenize, Detokenize and stop strings answer "
                        "FAILED_PRECONDITION; streamed tokens carry ids, no text)", self.dir)
        else:
            from tokenizers import Tokenizer as HFTokenizer
            self.token_bytes = TokenBytes(HFTokenizer.from_str(self.tokenizer.to_str()),
                                          mcfg.vocab_size)
            if eos is None and self.tokenizer.eos_id is not None \
                    and self.tokenizer.eos_id < mcfg.vocab_size:
                eos = self.tokenizer.eos_id
        self.eos_id = eos
        self.limits = Limits.make(self.cfg, mcfg.vocab_size, mcfg.n_layers, mcfg.n_heads,
                                  mcfg.max_seq_len)
        template, template_error = None, ""
        try:
            template = ChatTemplate.load(self.dir)
        except ValueError as e:  # served without chat; chat requests are told why
            log.warning("chat disabled: %s", e)
            template_error = "this model's chat template is unusable (see the server log)"
        self.prompts = Prompts(self.tokenizer, self.limits, template, template_error)
        self.eos_ids = self._eos_ids(eos, template)
        self.guides = Guides(self.tokenizer.to_str() if self.tokenizer is not None else None,
                             mcfg.vocab_size, sorted(self.eos_ids))
        try:
            self.engine = self._engine(eos)
        except MemoryError as e:  # (the prefix pool: beyond this machine's memory, or
            # onnxruntime's std::bad_alloc allocating it)
            raise ArtifactError(f"no memory for a prefix cache of {self.cfg.prefix_cache_mb} "
                                f"MiB ({e}): lower --prefix-cache-mb (0 turns it off)") from None
        if self.engine.prefix is not None:
            self.metrics.prefix_bytes.set(self.engine.prefix.nbytes)
        sha = hashlib.sha256((self.dir / MANIFEST).read_bytes()).hexdigest()
        self.state.info["model_info"] = model_info(self.lm, self.limits, sha, eos, __version__,
                                                   eos_ids=self.eos_ids,
                                                   chat=template is not None)
        log.info("loaded %s in %.1fs: %d layers, vocab %d, provider %s, attention "
                 "diagnostics %s, attention kernel: %s", self.dir, time.monotonic() - t0,
                 mcfg.n_layers, mcfg.vocab_size, self.lm.provider, self.lm.has_attention,
                 getattr(self.lm, "attention_kernel", "") or "standard ops (portable)")
        precision = self.lm.manifest.get("precision", "fp32")
        if precision == "fp16" and self.lm.provider == "CPUExecutionProvider":
            log.warning("%s is an fp16 artifact, made for the CUDA provider; on the CPU provider "
                        "onnxruntime computes it through casts and it runs slower than fp32: "
                        "export with --precision fp32 (or int8) for CPU", self.dir)

    def _engine(self, eos: int | None) -> Engine:
        return Engine(self.lm, self.token_bytes, max_batch=self.cfg.max_batch,
                      max_queue=self.cfg.max_queue,
                      score_chunk_floats=self.cfg.score_chunk_floats, eos_id=eos,
                      prefill_chunk_tokens=self.cfg.prefill_chunk_tokens,
                      request_time_limit=self.cfg.request_time_limit,
                      metrics=self.metrics, eos_ids=tuple(self.eos_ids),
                      stream_interval=self.cfg.stream_interval_ms / 1000,
                      stream_interval_max=self.cfg.stream_interval_max_ms / 1000,
                      prefix_cache_bytes=self.cfg.prefix_cache_mb << 20,
                      speculative_tokens=self.cfg.speculative_tokens,
                      fast_forward=self.cfg.constraint_fast_forward,
                      inexact_speedups=self.cfg.inexact_speedups)

    def _eos_ids(self, eos: int | None, template: ChatTemplate | None) -> list[int]:
        """Every id that ends generation: the config's eos ids (``stop_ids``: eos_token_id and
        the generation config's list), the tokenizer's eos when the config has none, and the
        chat template's eos_token."""
        ids = list(self.lm.cfg.stop_ids) + ([] if eos is None else [eos])
        name = template.special_tokens.get("eos_token") if template is not None else None
        tid = self.tokenizer.token_to_id(name) if name and self.tokenizer is not None else None
        if tid is not None:
            ids.append(tid)
        return sorted({i for i in ids if 0 <= i < self.lm.cfg.vocab_size})

    # --- serve -----------------------------------------------------------------------------
    def _send_limit(self) -> int:
        """The largest response: a Generate chunk with logits and attention rows, or a Score
        response with top logprobs."""
        c, m = self.cfg, self.lm.cfg
        per_chunk = 4 * (m.vocab_size + c.max_attention_floats) + 64 * (c.max_top_logprobs + 1)
        score = c.max_score_tokens * (24 + 32 * c.max_top_logprobs)
        return max(4 << 20, per_chunk, score) + (1 << 20)

    def receive_limit(self) -> int:
        """grpc.max_receive_message_length: the largest valid request (from the caps)."""
        return wire.receive_limit(wire.request_limits(self.cfg, self.limits))

    def _on_refused(self, rpc: str) -> None:
        self.metrics.requests.inc(rpc=rpc, outcome="InvalidArgument")

    def start(self) -> int:
        c = self.cfg
        # auth first: a call without the right token is refused before its bytes are parsed;
        # then the request bytes are checked and parsed by wire (never by gRPC itself)
        interceptors = [BearerTokenInterceptor(c.auth_token)] if c.auth_token else []
        interceptors.append(wire.WireInterceptor(
            wire.request_limits(c, self.limits),
            on_malformed=lambda rpc: self.metrics.malformed.inc(rpc=rpc),
            on_refused=self._on_refused))
        limit = self.receive_limit()
        options = [
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", self._send_limit()),
            ("grpc.keepalive_time_ms", 60_000),
            ("grpc.keepalive_timeout_ms", 20_000),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.so_reuseport", 0),
        ]
        workers = c.concurrent_rpcs + 4
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers,
                                                             thread_name_prefix="kvserve-rpc"),
                                  interceptors=interceptors, options=options,
                                  maximum_concurrent_rpcs=c.concurrent_rpcs)
        self.servicer = InferenceServicer(self.engine, self.tokenizer, self.token_bytes,
                                          self.limits, self.state, self.metrics, self.prompts,
                                          self.guides)
        pb_grpc.add_InferenceServicer_to_server(self.servicer, self.server)
        self.health = health.HealthServicer(experimental_non_blocking=True)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        for name in ("", SERVICE):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        reflection.enable_server_reflection(
            (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), self.server)
        addr = f"{c.host}:{c.port}"
        try:  # grpc returns 0 or raises RuntimeError('Failed to bind ...'), by version
            if c.tls_cert:
                creds = grpc.ssl_server_credentials(
                    [(Path(c.tls_key).read_bytes(), Path(c.tls_cert).read_bytes())])
                self.port = self.server.add_secure_port(addr, creds)
            else:
                self.port = self.server.add_insecure_port(addr)
        except RuntimeError:
            self.port = 0
        if not self.port:
            raise OSError(f"cannot listen on {addr} (port in use?)")
        self.server.start()
        log.info("gRPC listening on %s:%d (%s%s), max request %d bytes", c.host, self.port,
                 "TLS" if c.tls_cert else "plaintext", ", auth" if c.auth_token else "", limit)
        if c.metrics_port >= 0:
            self.metrics_server = MetricsServer(self.metrics, c.host, c.metrics_port)
            self.metrics_server.start()
        if c.http_port >= 0:  # up before warm-up: /health answers 503 until ready
            from .http_api import HttpServer, OpenAIApi  # (aiohttp: only for the HTTP API)

            api = OpenAIApi(self.engine, self.prompts, self.token_bytes, self.state, self.metrics,
                            model_name=c.served_model_name or self.dir.resolve().name,
                            created=int((self.dir / MANIFEST).stat().st_mtime),
                            auth_token=c.auth_token, guides=self.guides,
                            tokenizer_info=self._tokenizer_info(),
                            reasoning=c.reasoning_parser == "think")
            self.http_server = HttpServer(api, c.host, c.http_port, c.max_http_body_bytes,
                                          c.tls_cert, c.tls_key)
            self.http_port = self.http_server.start()
        self.engine.start()
        t0 = time.monotonic()
        # warm-up requests are not traffic: they go to no metric (requests_total, tokens, ...)
        live, self.engine.metrics = self.engine.metrics, NullMetrics()
        try:
            self.engine.warmup(self._warmup_request)
        finally:
            self.engine.metrics = live
        log.info("warm-up done in %.2fs", time.monotonic() - t0)
        self.state.ready = True
        for name in ("", SERVICE):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if c.port_file:
            self._write_port_file()
        return self.port

    def _tokenizer_info(self) -> dict | None:
        """vLLM's /tokenizer_info body (None without a tokenizer: no tokenizer routes)."""
        from .http_tokenize import read_tokenizer_config, tokenizer_info

        if self.tokenizer is None:
            return None
        return tokenizer_info(read_tokenizer_config(self.dir), self.tokenizer,
                              self.limits.max_context, self.eos_id)

    def _warmup_request(self, attention: bool) -> GenerateRequest:
        from kvserve.model.sampling import SamplingParams

        m = self.lm.cfg
        out = OutputParams(logprobs=True, top_logprobs=2,
                           attention_layers=(0,) if attention else (),
                           attention_heads=(0,) if attention else ())
        return GenerateRequest(prompt_ids=[i % m.vocab_size for i in range(4)],
                               sampling=SamplingParams(temperature=1.0, top_k=8, seed=0),
                               stopping=StopParams(max_new_tokens=3, ignore_eos=True),
                               output=out, request_id="warmup")

    def _write_port_file(self) -> None:
        p = Path(self.cfg.port_file)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(json.dumps({"port": self.port, "metrics_port":
                                   self.metrics_server.port if self.metrics_server else None,
                                   "http_port": self.http_port, "pid": os.getpid()}))
        tmp.replace(p)

    # --- stop ------------------------------------------------------------------------------
    def drain(self, grace: float | None = None) -> None:
        """Health NOT_SERVING, refuse new calls (UNAVAILABLE), let in-flight calls finish
        within ``grace`` seconds, then stop."""
        grace = self.cfg.drain_grace if grace is None else grace
        log.info("draining: refusing new calls, %.1fs grace for %s", grace,
                 self.engine.load() if hasattr(self, "engine") else {})
        self.state.draining = True  # from now on the servicer answers UNAVAILABLE
        end = time.monotonic() + grace
        if self.server is not None:
            self.health.enter_graceful_shutdown()
            # in-flight calls (and requests still queued) finish; gRPC's own stop would answer
            # new calls on open connections with CANCELLED, so it comes last
            while self.state.inflight and time.monotonic() < end:
                time.sleep(0.02)
            self.engine.stop_accepting()
            remaining = max(0.0, end - time.monotonic())
            if self.state.inflight:
                # past the grace: the engine ends what is left (queued or decoding) with "the
                # server is shutting down", which the servicer answers as UNAVAILABLE; only then
                # gRPC's own stop, whose bare "Cancelling all calls" says nothing to a caller.
                # The calls end at once, so the short stop grace only lets their status out.
                self.engine.stop()
                remaining = 1.0
            self.server.stop(remaining).wait()
        if hasattr(self, "engine"):
            self.engine.stop()
        if self.http_server is not None:
            self.http_server.stop()
        if self.metrics_server is not None:
            self.metrics_server.stop()
        log.info("stopped")
