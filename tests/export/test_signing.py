"""Signed artifacts: ``kvserve sign`` (a key pair, then a signature over the manifest),
``kvserve verify --trusted-key`` and ``kvserve serve --trusted-key`` accept exactly an
artifact signed by the trusted key, and refuse it unsigned, signed by another key, with a
re-hashed manifest (modified after signing), with a tampered signature, or with a key that is
not Ed25519. ``kvserve export --sign-key`` signs what it exports."""
from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys

import pytest

from kvserve import cli
from kvserve.artifact.signing import SIGNATURE, verify_manifest
from kvserve.artifact.verify import VerifyError, verify_artifacts
from kvserve_testing import rehash


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    for name in ("a", "b"):
        assert cli.main(["sign", "--generate-key", str(d / name)]) == 0
    return d


@pytest.fixture
def signed(artifact_copy, keys, capsys):
    assert cli.main(["sign", str(artifact_copy), "--key", str(keys / "a")]) == 0
    assert "wrote" in capsys.readouterr().out
    return artifact_copy


def _verify_refused(root, pub, part, capsys):
    with pytest.raises(VerifyError, match=part):
        verify_artifacts(root, trusted_key=pub)
    capsys.readouterr()
    assert cli.main(["verify", str(root), "--trusted-key", str(pub)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvserve verify: FAILED: ") and len(err.splitlines()) == 1, err
    assert part in err, err


def test_key_files(keys):
    assert (keys / "a").stat().st_mode & 0o777 == 0o600
    assert b"PRIVATE KEY" in (keys / "a").read_bytes()
    assert (keys / "a.pub").read_bytes().startswith(b"-----BEGIN PUBLIC KEY-----")
    assert cli.main(["sign", "--generate-key", str(keys / "a")]) == 1  # never overwrites


def test_signed_artifact_verifies_with_its_key(signed, keys, capsys):
    assert cli.main(["verify", str(signed), "--trusted-key", str(keys / "a.pub")]) == 0
    assert "manifest signed by the trusted key" in capsys.readouterr().out
    env = json.loads((signed / SIGNATURE).read_text())
    stmt = json.loads(base64.b64decode(env["dsseEnvelope"]["payload"]))
    assert env["dsseEnvelope"]["payloadType"] == "application/vnd.in-toto+json"
    assert stmt["subject"][0]["name"] == "manifest.json"
    # the signature sits beside the manifest and is not one of its files
    assert cli.main(["verify", str(signed)]) == 0


def test_unsigned_is_refused(artifact_copy, keys, capsys):
    _verify_refused(artifact_copy, keys / "a.pub", "the artifact is not signed", capsys)


def test_other_key_is_refused(signed, keys, capsys):
    _verify_refused(signed, keys / "b.pub", "no valid signature by the trusted key", capsys)


def test_rehashed_manifest_after_signing_is_refused(signed, keys, capsys):
    """Whoever can write the directory can re-hash the manifest, not re-sign it."""
    (signed / "tokenizer.json").write_text((signed / "tokenizer.json").read_text() + " ")
    rehash(signed, "tokenizer.json")
    assert verify_artifacts(signed)  # hashes alone: fine
    _verify_refused(signed, keys / "a.pub", "manifest.json is not the manifest that was "
                                            "signed", capsys)


def test_tampered_signature_is_refused(signed, keys, capsys):
    env = json.loads((signed / SIGNATURE).read_text())
    sig = bytearray(base64.b64decode(env["dsseEnvelope"]["signatures"][0]["sig"]))
    sig[0] ^= 1
    env["dsseEnvelope"]["signatures"][0]["sig"] = base64.b64encode(bytes(sig)).decode()
    (signed / SIGNATURE).write_text(json.dumps(env))
    _verify_refused(signed, keys / "a.pub", "no valid signature by the trusted key", capsys)


def test_swapped_payload_is_refused(signed, keys, capsys):
    env = json.loads((signed / SIGNATURE).read_text())
    stmt = json.loads(base64.b64decode(env["dsseEnvelope"]["payload"]))
    stmt["subject"][0]["digest"]["sha256"] = "0" * 64
    env["dsseEnvelope"]["payload"] = base64.b64encode(json.dumps(stmt).encode()).decode()
    (signed / SIGNATURE).write_text(json.dumps(env))
    _verify_refused(signed, keys / "a.pub", "no valid signature by the trusted key", capsys)


@pytest.mark.parametrize("content,part", [
    ("not json", "manifest.sig is not valid JSON"),
    ('{"dsseEnvelope": []}', "manifest.sig is not a signature envelope"),
    ("[" * 20_000 + "]" * 20_000, "manifest.sig is nested too deeply"),
    (" " * 100_000, "manifest.sig has 100000 bytes; the limit is 65536"),
])
def test_garbage_signature_is_refused(signed, keys, capsys, content, part):
    (signed / SIGNATURE).write_text(content)
    _verify_refused(signed, keys / "a.pub", part, capsys)


def test_symlinked_signature_is_refused(signed, keys, tmp_path, capsys):
    shutil.move(signed / SIGNATURE, tmp_path / "sig")
    (signed / SIGNATURE).symlink_to(tmp_path / "sig")
    _verify_refused(signed, keys / "a.pub", "the artifact is not signed", capsys)


def test_a_key_that_is_not_ed25519(signed, tmp_path, capsys):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    pub = tmp_path / "ec.pub"
    pub.write_bytes(ec.generate_private_key(ec.SECP256R1()).public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    _verify_refused(signed, pub, "is not an Ed25519 public key", capsys)
    (tmp_path / "junk.pub").write_text("hello")
    _verify_refused(signed, tmp_path / "junk.pub", "is not a readable PEM public key", capsys)


def test_the_private_key_as_trusted_key_names_its_public_half(signed, keys, capsys):
    _verify_refused(signed, keys / "a", "is a private key: give its public key", capsys)
    with pytest.raises(VerifyError) as e:
        verify_artifacts(signed, trusted_key=keys / "a")
    assert f"({keys / 'a'}.pub, written beside it by --generate-key)" in str(e.value)


def test_encrypted_signing_key(artifact_copy, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVSERVE_SIGN_KEY_PASSWORD", "s3cret")
    assert cli.main(["sign", "--generate-key", str(tmp_path / "k")]) == 0
    assert b"ENCRYPTED" in (tmp_path / "k").read_bytes()
    assert cli.main(["sign", str(artifact_copy), "--key", str(tmp_path / "k")]) == 0
    verify_manifest(artifact_copy, (artifact_copy / "manifest.json").read_bytes(),
                    tmp_path / "k.pub")
    monkeypatch.delenv("KVSERVE_SIGN_KEY_PASSWORD")
    capsys.readouterr()
    assert cli.main(["sign", str(artifact_copy), "--key", str(tmp_path / "k")]) == 1
    assert "is encrypted: set KVSERVE_SIGN_KEY_PASSWORD" in capsys.readouterr().err


def test_sign_refuses_an_artifact_that_does_not_verify(artifact_copy, keys, capsys):
    (artifact_copy / "extra.txt").write_text("x")
    assert cli.main(["sign", str(artifact_copy), "--key", str(keys / "a")]) == 1
    assert "files not in the manifest: extra.txt" in capsys.readouterr().err
    assert not (artifact_copy / SIGNATURE).exists()


def _serve(root, *extra, timeout=120):
    return subprocess.run([sys.executable, "-m", "kvserve.cli", "serve", str(root), "--port", "0",
                           "--threads", "1", *extra], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "KVSERVE_LOG_LEVEL": "WARNING"})


def test_serve_refuses_unsigned_and_wrongly_signed(artifact_copy, keys, capsys):
    p = _serve(artifact_copy, "--trusted-key", keys / "a.pub")
    assert p.returncode == 1 and p.stderr.startswith("kvserve serve: refusing to serve"), p.stderr
    assert "the artifact is not signed" in p.stderr and len(p.stderr.splitlines()) == 1
    assert cli.main(["sign", str(artifact_copy), "--key", str(keys / "b")]) == 0
    p = _serve(artifact_copy, "--trusted-key", keys / "a.pub")
    assert p.returncode == 1 and "no valid signature by the trusted key" in p.stderr, p.stderr
    p = _serve(artifact_copy, "--trusted-key", keys / "a.pub", "--no-verify")
    assert p.returncode == 2 and "trusted_key needs verify" in p.stderr, p.stderr


def test_serve_loads_a_signed_artifact(signed, keys):
    from kvserve.server.app import App
    from kvserve_testing import server_config

    app = App(signed, server_config(trusted_key=str(keys / "a.pub")))
    app.load()  # verified, signature included; nothing to serve here
    assert app.lm.cfg.n_layers >= 1


def test_generate_key_makes_its_directory(tmp_path, monkeypatch, capsys):
    """`kvserve sign --generate-key keys/release` as the README writes it, with no keys/ yet:
    the directory is made (0700), the private key is 0600, and keys/ is git-ignored."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KVSERVE_SIGN_KEY_PASSWORD", raising=False)
    assert cli.main(["sign", "--generate-key", "keys/release"]) == 0
    assert (tmp_path / "keys").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "keys" / "release").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "keys" / "release.pub").is_file()
    assert "wrote keys/release" in capsys.readouterr().out
    (tmp_path / "file").write_text("x")  # a path under a file: one line, no traceback
    assert cli.main(["sign", "--generate-key", "file/k"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvserve sign: FAILED: ") and len(err.splitlines()) == 1, err


def test_the_readme_key_directory_is_git_ignored():
    import shutil
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    if shutil.which("git") is None or not (repo / ".git").exists():
        pytest.skip("needs git and a checkout")
    for path in ("keys/release", "keys/release.pub"):
        r = subprocess.run(["git", "-C", str(repo), "check-ignore", "-q", path],
                           capture_output=True)
        assert r.returncode == 0, f"{path} is not git-ignored"
