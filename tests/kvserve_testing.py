"""Shared test helpers (a module name of its own: ``conftest``/``helpers`` are ambiguous across
test directories). ``tests/`` is on sys.path because ``tests/conftest.py`` lives there.

- ``build_artifact``: the session's tiny served model (random init, fixed seed, a BPE trained
  on a small multilingual text), exported through the real pipeline (parity gate, manifest);
  the torch model is kept for reference comparisons.
- ``running_app``: a real gRPC server (``App``) on a free loopback port, drained on exit;
  ``ready_channel``: a channel to it, connected.
- request builders and torch references for the server, client and hardening tests.
"""
from __future__ import annotations

import contextlib
import socket
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TRAIN_TEXTS = [
    f"# doc {i}\n" + s
    for i in range(40)
    for s in (
        "def add(a, b):\n    return a + b\n",
        "naïve café, 日本語のテキスト, emoji 😀🚀, Ünïcödé ñ\n",
        "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
        "for i in range(10):\n    print(i * 2)\n",
    )
]
SEED = 1234


@dataclass
class Artifact:
    dir: Path
    model: object  # the torch Transformer
    tokenizer: object  # kvserve.model.tokenizer.Tokenizer
    cfg: object  # ModelConfig


def build_artifact(root: Path, attention: bool = True, out_name: str = "artifact",
                   chat: bool = False) -> Artifact:
    """``chat``: the checkpoint saved as ``kvserve train`` saves it (its tokenizer reserves
    ChatML's tokens, so it carries the ChatML template); without it the tokenizer goes in as a
    plain file, as for an imported model without a template (the session's plain artifact)."""
    import torch

    from kvserve.export.pipeline import export_artifacts
    from kvserve.model.checkpoint import TOKENIZER, save_checkpoint
    from kvserve.model.config import preset
    from kvserve.model.tokenizer import train_bpe
    from kvserve.model.transformer import Transformer

    tok = train_bpe(TRAIN_TEXTS, vocab_size=512, min_frequency=1)
    cfg = preset("tiny", vocab_size=tok.vocab_size, eos_token_id=tok.eos_id,
                 pad_token_id=tok.pad_id, init_std=0.1)
    torch.manual_seed(SEED)
    model = Transformer(cfg).eval()
    if chat:
        ckpt = save_checkpoint(root / "ckpt", model, tokenizer_json=tok.to_str())
    else:
        ckpt = save_checkpoint(root / "ckpt", model,
                               extra_files={TOKENIZER: tok.to_str().encode()})
    out = export_artifacts(ckpt, root / out_name, attention=attention, precision="fp32",
                           progress=False, threads=2)
    return Artifact(Path(out), model, tok, cfg)


# --- chat ---------------------------------------------------------------------------------------
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Meta's Llama 3 instruct template (bos_token, strip, raise_exception on a bad role order)
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}"
    "{% for message in loop_messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Only system, user and assistant roles are supported!') }}{% endif %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")
LLAMA3_TOKENS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")


def chat_tokenizer(tokens=CHATML_TOKENS + LLAMA3_TOKENS):
    """The test BPE with the chat templates' control tokens added as special tokens."""
    from kvserve.model.tokenizer import Tokenizer, train_bpe

    tok = train_bpe(TRAIN_TEXTS, vocab_size=512, min_frequency=1)
    hf = tok._tok
    hf.add_special_tokens(list(tokens))
    return Tokenizer(hf)


def build_chat_artifact(root: Path, template: str = CHATML_TEMPLATE,
                        eos_token: str = "<|im_end|>", bos_token: str | None = None
                        ) -> Artifact:
    """A tiny model (context 1024) whose checkpoint carries tokenizer_config.json with
    ``template`` (exported without the attention graphs: quicker)."""
    import json

    import torch

    from kvserve.export.pipeline import export_artifacts
    from kvserve.model.checkpoint import TOKENIZER_CONFIG, save_checkpoint
    from kvserve.model.config import preset
    from kvserve.model.transformer import Transformer

    tok = chat_tokenizer()
    # a longer context than the plain tiny model: answers long enough to interrupt
    cfg = preset("tiny", vocab_size=tok.vocab_size, eos_token_id=tok.eos_id,
                 pad_token_id=tok.pad_id, init_std=0.1, max_seq_len=1024)
    torch.manual_seed(SEED)
    model = Transformer(cfg).eval()
    tc = {"chat_template": template, "eos_token": eos_token}
    if bos_token is not None:
        tc["bos_token"] = bos_token
    ckpt = save_checkpoint(root / "ckpt", model, tokenizer_json=tok.to_str(),
                           extra_files={TOKENIZER_CONFIG: json.dumps(tc).encode()})
    out = export_artifacts(ckpt, root / "artifact", attention=False, precision="fp32",
                           progress=False, threads=2)
    return Artifact(Path(out), model, tok, cfg)


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports: every socket stays bound until all are chosen, since the
    kernel may hand a just-closed port out again (CI once gave two compose replicas one port)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def free_port() -> int:
    return free_ports(1)[0]


def server_config(**kw):
    from kvserve.server.config import ServerConfig

    base = dict(host="127.0.0.1", port=0, metrics_port=-1, threads=1, max_batch=4,
                max_queue=16, drain_grace=2.0)
    base.update(kw)
    return ServerConfig(**base)


@contextlib.contextmanager
def ready_channel(port: int, timeout: float = 10.0):
    """An insecure channel to 127.0.0.1:``port``, connected (or TimeoutError), closed on exit."""
    import grpc

    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        grpc.channel_ready_future(ch).result(timeout=timeout)
        yield ch
    finally:
        ch.close()


@contextlib.contextmanager
def running_app(artifact: Artifact, **kw):
    """A real server (App) on a free loopback port; drained on exit."""
    from kvserve.server.app import App

    app = App(artifact.dir, server_config(**kw))
    app.load()
    app.start()
    try:
        yield app
    finally:
        app.drain(0.5)


def self_signed(tmp: Path) -> tuple[Path, Path, bytes]:
    """A throwaway certificate for localhost / 127.0.0.1: (cert path, key path, cert PEM)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
            .sign(key, hashes.SHA256()))
    pem = cert.public_bytes(serialization.Encoding.PEM)
    cp, kp = tmp / "cert.pem", tmp / "key.pem"
    cp.write_bytes(pem)
    kp.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                     serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption()))
    return cp, kp, pem


# --- tampering with an artifact (verify / serve refusal tests) ----------------------------------
def read_manifest(root: Path) -> dict:
    import json

    return json.loads((root / "manifest.json").read_text())


def write_manifest(root: Path, m: dict) -> None:
    import json

    (root / "manifest.json").write_text(json.dumps(m, indent=2, sort_keys=True))


def rehash(root: Path, rel: str) -> None:
    """Make the manifest agree with the file as it is now (so that only the check under test
    can catch the change)."""
    from kvserve.artifact.manifest import sha256_file

    m = read_manifest(root)
    m["files"][rel] = {"sha256": sha256_file(root / rel), "bytes": (root / rel).stat().st_size}
    write_manifest(root, m)


def relocate_external_data(root: Path, location: str) -> None:
    """Point one initializer of the artifact's first graph (model.onnx, or decode.onnx of a
    portable artifact) at ``location`` (where a copy of the real data is, so a loader that
    follows it would succeed), then re-hash the graph."""
    import onnx

    graph = "model.onnx" if (root / "model.onnx").is_file() else "decode.onnx"
    path = root / graph
    m = onnx.load(str(path), load_external_data=False)
    t = next(t for t in m.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
    for e in t.external_data:
        if e.key == "location":
            e.value = location
    path.write_bytes(m.SerializeToString())
    rehash(root, graph)


# --- requests ---------------------------------------------------------------------------------
def gen_request(prompt, max_new_tokens=16, *, ignore_eos=True, sampling=None, stop=(),
                stop_token_ids=(), min_new_tokens=0, **response):
    from kvserve.v1 import inference_pb2 as pb

    r = pb.GenerateRequest(
        stopping=pb.StoppingOptions(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos,
                                    stop=list(stop), stop_token_ids=list(stop_token_ids),
                                    min_new_tokens=min_new_tokens),
        sampling=sampling or pb.SamplingOptions(),
        response=pb.ResponseOptions(**response))
    if isinstance(prompt, str):
        r.text = prompt
    else:
        r.token_ids.ids.extend(prompt)
    return r


def collect(stream):
    """-> (chunks, complete) of a Generate stream; exactly one Complete, at the end."""
    chunks, complete = [], None
    for msg in stream:
        assert complete is None
        if msg.HasField("chunk"):
            chunks.append(msg.chunk)
        else:
            complete = msg.complete
    assert complete is not None, "the stream ended without a Complete event"
    return chunks, complete


# --- torch references -------------------------------------------------------------------------
def to_params(s):
    """pb.SamplingOptions -> model.sampling.SamplingParams (unset optionals = off)."""
    from kvserve.model.sampling import SamplingParams

    return SamplingParams(
        temperature=s.temperature, top_k=s.top_k, top_p=s.top_p if s.HasField("top_p") else 1.0,
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        seed=s.seed if s.HasField("seed") else None)


def torch_generate(model, ids, n, params=None):
    from kvserve.model.generate import generate
    from kvserve.model.sampling import SamplingParams

    return generate(model, [list(ids)], n, params or SamplingParams()).tokens[0]


def torch_step_logits(model, ids) -> np.ndarray:
    """Logits predicting the token after ``ids`` (full forward, no cache)."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits[0, -1].float().numpy()


def torch_logprobs(model, ids) -> np.ndarray:
    """(T-1,) log p(ids[t] | ids[:t])."""
    import torch

    from kvserve.model.sampling import log_softmax

    with torch.no_grad():
        lp = log_softmax(model(torch.tensor([list(ids)])).logits[0].float().numpy())
    return lp[np.arange(len(ids) - 1), np.asarray(ids[1:])]


def fail_iteration(engine, at: int, before: bool = False) -> list[int]:
    """Make ``engine``'s ``at``-th iteration raise (after its work ran, or ``before`` it), as
    an unexpected failure would (``Engine._fail_all``). Returns the iterations counted so
    far (a one-item list)."""
    seen = [0]

    def hook(work):
        seen[0] += 1
        if before and seen[0] == at:
            raise RuntimeError("injected before the iteration's work")
        work()
        if not before and seen[0] == at:
            raise RuntimeError("injected after the iteration's work")
    engine.iteration_hook = hook
    return seen
