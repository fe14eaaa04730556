"""Signed artifacts: an Ed25519 signature over manifest.json, stored beside it as manifest.sig.
Torch-free (``cryptography`` only). The manifest holds the sha256 of every file, so the
signature covers the whole artifact.

The shape follows OpenSSF model signing (a DSSE envelope around an in-toto statement):
manifest.sig is ``{"mediaType": ..., "dsseEnvelope": {"payload": b64, "payloadType":
"application/vnd.in-toto+json", "signatures": [{"keyid": ..., "sig": b64}]}}``; the payload is
an in-toto Statement v1 whose one subject is ``manifest.json`` with its sha256, and the
signature is Ed25519 over DSSE's pre-authentication encoding of (payloadType, payload).
``keyid`` is the sha256 of the raw 32-byte public key.

    kvserve sign --generate-key keys/signing          # keys/signing (0600) + keys/signing.pub
    kvserve export CKPT --out ART --sign-key keys/signing
    kvserve sign ART --key keys/signing               # sign (or re-sign) an existing artifact
    kvserve verify ART --trusted-key keys/signing.pub
    kvserve serve ART --trusted-key keys/signing.pub
"""
from __future__ import annotations

import base64
import binascii
import datetime as _dt
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from .manifest import MANIFEST, SIGNATURE

MEDIA_TYPE = "application/vnd.kvserve.signature.v1+json"
PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://github.com/kvserve/kvserve/manifest-signature/v1"
MAX_SIGNATURE_BYTES = 64 << 10
MAX_KEY_BYTES = 16 << 10
PASSWORD_ENV = "KVSERVE_SIGN_KEY_PASSWORD"


class SignatureError(ValueError):
    """No valid signature by the trusted key; the message says why."""


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE v1 pre-authentication encoding: what is actually signed."""
    t = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(t), t, len(payload), payload)


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode("ascii")


def _read_key_file(path: str | Path, what: str) -> bytes:
    p = Path(path)
    try:
        if p.stat().st_size > MAX_KEY_BYTES:
            raise SignatureError(f"{what} {p} is not a PEM key (too large)")
        return p.read_bytes()
    except OSError as e:
        raise SignatureError(f"cannot read {what} {p}: {e.strerror}") from None


def load_private_key(path: str | Path):
    """An Ed25519 private key in PEM (PKCS#8); encrypted keys take their password from the
    environment variable KVSERVE_SIGN_KEY_PASSWORD."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    data = _read_key_file(path, "signing key")
    password = os.environ.get(PASSWORD_ENV)
    try:
        key = serialization.load_pem_private_key(data, password.encode() if password else None)
    except TypeError:
        raise SignatureError(f"signing key {path} is encrypted: set {PASSWORD_ENV}") from None
    except ValueError:
        raise SignatureError(f"signing key {path} is not a readable PEM private key (or the "
                             f"password is wrong)") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise SignatureError(f"signing key {path} is not an Ed25519 key")
    return key


def load_public_key(path: str | Path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    data = _read_key_file(path, "trusted key")
    if b"PRIVATE KEY-----" in data:  # (the signing key itself: its public half is beside it)
        raise SignatureError(f"trusted key {path} is a private key: give its public key "
                             f"({path}.pub, written beside it by --generate-key)")
    try:
        key = serialization.load_pem_public_key(data)
    except ValueError:
        raise SignatureError(f"trusted key {path} is not a readable PEM public key") from None
    if not isinstance(key, Ed25519PublicKey):
        raise SignatureError(f"trusted key {path} is not an Ed25519 public key")
    return key


def key_id(public_key) -> str:
    from cryptography.hazmat.primitives import serialization

    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()


def generate_key(path: str | Path) -> tuple[Path, Path]:
    """A new Ed25519 key pair: ``path`` (private, PEM PKCS#8, mode 0600, unencrypted unless
    KVSERVE_SIGN_KEY_PASSWORD is set) and ``path.pub`` (public, PEM). Missing directories are
    made (mode 0700: only the owner lists a key directory)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    priv, pub = Path(path), Path(str(path) + ".pub")
    for p in (priv, pub):
        if p.exists():
            raise FileExistsError(f"{p} exists; not overwriting a key")
    priv.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    password = os.environ.get(PASSWORD_ENV)
    enc = serialization.BestAvailableEncryption(password.encode()) if password \
        else serialization.NoEncryption()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, enc)
    fd = os.open(priv, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                  serialization.PublicFormat.SubjectPublicKeyInfo))
    return priv, pub


def statement(manifest_bytes: bytes) -> dict[str, Any]:
    from kvserve import __version__

    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": MANIFEST,
                     "digest": {"sha256": hashlib.sha256(manifest_bytes).hexdigest()}}],
        "predicateType": PREDICATE_TYPE,
        "predicate": {"signed_utc": _dt.datetime.now(_dt.timezone.utc)
                      .isoformat(timespec="seconds"), "kvserve": __version__},
    }


def sign_manifest(root: str | Path, private_key) -> Path:
    """Write ``root/manifest.sig`` for the manifest as it is now. ``private_key``: a key from
    ``load_private_key`` or the path of one."""
    root = Path(root)
    key = load_private_key(private_key) if isinstance(private_key, (str, Path)) else private_key
    payload = json.dumps(statement((root / MANIFEST).read_bytes()), sort_keys=True).encode()
    envelope = {"mediaType": MEDIA_TYPE, "dsseEnvelope": {
        "payload": _b64(payload), "payloadType": PAYLOAD_TYPE,
        "signatures": [{"keyid": key_id(key.public_key()),
                        "sig": _b64(key.sign(pae(PAYLOAD_TYPE, payload)))}]}}
    tmp = root / (SIGNATURE + ".tmp")
    tmp.write_text(json.dumps(envelope, indent=2, sort_keys=True) + "\n")
    tmp.replace(root / SIGNATURE)
    return root / SIGNATURE


def verify_manifest(root: str | Path, manifest_bytes: bytes, trusted_key) -> None:
    """Raises SignatureError unless ``root/manifest.sig`` holds a valid signature by
    ``trusted_key`` (a public key or the path of one) over exactly ``manifest_bytes``."""
    from cryptography.exceptions import InvalidSignature

    from .schema import SchemaError, load_json

    key = load_public_key(trusted_key) if isinstance(trusted_key, (str, Path)) else trusted_key
    path = Path(root) / SIGNATURE
    if path.is_symlink() or not path.is_file():
        raise SignatureError(f"the artifact is not signed (no {SIGNATURE}) and a trusted key "
                             f"is required")
    try:
        env = load_json(path, SIGNATURE, MAX_SIGNATURE_BYTES)
    except SchemaError as e:
        raise SignatureError(str(e)) from None
    try:
        dsse = env["dsseEnvelope"]
        payload = base64.b64decode(dsse["payload"], validate=True)
        sigs = [base64.b64decode(s["sig"], validate=True) for s in dsse["signatures"][:16]]
        ok_type = env.get("mediaType") == MEDIA_TYPE and dsse["payloadType"] == PAYLOAD_TYPE
    except (KeyError, TypeError, binascii.Error, ValueError):
        raise SignatureError(f"{SIGNATURE} is not a signature envelope") from None
    if not ok_type:
        raise SignatureError(f"{SIGNATURE} is not a kvserve manifest signature")
    message = pae(PAYLOAD_TYPE, payload)
    for sig in sigs:
        try:
            key.verify(sig, message)
            break
        except InvalidSignature:
            continue
    else:
        raise SignatureError(f"{SIGNATURE} has no valid signature by the trusted key "
                             f"(signed by another key, or modified)")
    try:
        st = json.loads(payload)
        subject = st["subject"]
        ok = (st["_type"] == STATEMENT_TYPE and st["predicateType"] == PREDICATE_TYPE
              and len(subject) == 1 and subject[0]["name"] == MANIFEST)
        digest = subject[0]["digest"]["sha256"]
    except (ValueError, KeyError, TypeError, IndexError):
        ok, digest = False, None
    if not ok:
        raise SignatureError(f"{SIGNATURE} is signed but does not name {MANIFEST} as its "
                             f"subject")
    if digest != hashlib.sha256(manifest_bytes).hexdigest():
        raise SignatureError(f"{MANIFEST} is not the manifest that was signed (its sha256 "
                             f"differs from the one in {SIGNATURE}: modified after signing)")


# --- `kvserve sign` -----------------------------------------------------------------------------
def add_arguments(parser) -> None:
    parser.add_argument("artifacts", nargs="?", help="artifact directory to sign")
    parser.add_argument("--key", help="Ed25519 private key (PEM); encrypted keys read their "
                                      f"password from {PASSWORD_ENV}")
    parser.add_argument("--generate-key", metavar="PATH",
                        help="write a new key pair: PATH (private, mode 0600) and PATH.pub")


def main(args) -> int:
    from .verify import VerifyError, verify_artifacts

    try:
        if args.generate_key:
            priv, pub = generate_key(args.generate_key)
            print(f"kvserve sign: wrote {priv} (private: keep it secret) and {pub} (give this "
                  f"one to the servers: --trusted-key)")
            return 0
        if not args.artifacts or not args.key:
            print("kvserve sign: give ARTIFACTS and --key (or --generate-key PATH)",
                  file=sys.stderr)
            return 2
        key = load_private_key(args.key)
        verify_artifacts(args.artifacts)  # never sign something that does not verify
        path = sign_manifest(args.artifacts, key)
    except (SignatureError, VerifyError, OSError) as e:  # OSError: FileExistsError, EACCES...
        print(f"kvserve sign: FAILED: {e}", file=sys.stderr)
        return 1
    print(f"kvserve sign: wrote {path} (Ed25519, key id {key_id(key.public_key())[:16]})")
    return 0
