"""``verify_artifacts`` / ``kvserve verify`` refuse every kind of tampering with a clear
message: changed bytes, truncation, a manifest that does not match (edited hash, unlisted
file, missing file), external data outside the directory (``../``, absolute) and symlinks."""
from __future__ import annotations

import shutil
from pathlib import Path

import onnx
import pytest
from export_matrix import CONFIGS, make_config

from kvserve import cli
from kvserve.artifact import schema
from kvserve.artifact.manifest import sha256_file
from kvserve_testing import read_manifest, rehash, relocate_external_data, write_manifest
from kvserve.artifact.verify import VerifyError, verify_artifacts


def _refused(root: Path, pattern: str, capsys) -> None:
    with pytest.raises(VerifyError, match=pattern):
        verify_artifacts(root)
    capsys.readouterr()
    assert cli.main(["verify", str(root)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvserve verify: FAILED: ") and len(err.splitlines()) == 1, err


def test_pristine_copy_verifies(artifact_copy, capsys):
    m = verify_artifacts(artifact_copy)
    assert set(m["graphs"]) == {"model", "model_attn"}
    assert cli.main(["verify", str(artifact_copy)]) == 0
    assert "kvserve verify: OK" in capsys.readouterr().out


def test_flipped_byte_in_data(artifact_copy, capsys):
    p = artifact_copy / "model.onnx.data"
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))
    _refused(artifact_copy, r"^model\.onnx\.data does not match its sha256 in the manifest "
                            r"\(modified\)$", capsys)


def test_truncated_graph(artifact_copy, capsys):
    p = artifact_copy / "model.onnx"
    data = p.read_bytes()
    p.write_bytes(data[:len(data) // 2])
    _refused(artifact_copy, rf"^model\.onnx has {len(data) // 2} bytes, the manifest says "
                            rf"{len(data)} \(truncated or replaced\)$", capsys)


def test_truncated_graph_with_matching_manifest(artifact_copy, capsys):
    """Even re-hashed, a truncated graph is not a readable model."""
    p = artifact_copy / "model.onnx"
    p.write_bytes(p.read_bytes()[:100])
    rehash(artifact_copy, "model.onnx")
    _refused(artifact_copy, r"graph model .*(not a readable ONNX model|fails onnx\.checker)",
             capsys)


def test_edited_hash(artifact_copy, capsys):
    m = read_manifest(artifact_copy)
    m["files"]["config.json"]["sha256"] = "0" * 64
    write_manifest(artifact_copy, m)
    _refused(artifact_copy, r"^config\.json does not match its sha256", capsys)


@pytest.mark.parametrize("rel", ["notes.txt", "sub/extra.onnx.data"])
def test_unlisted_file(artifact_copy, capsys, rel):
    (artifact_copy / rel).parent.mkdir(exist_ok=True)
    (artifact_copy / rel).write_bytes(b"x")
    _refused(artifact_copy, rf"^files not in the manifest: {rel}$", capsys)


def test_missing_file(artifact_copy, capsys):
    (artifact_copy / "tokenizer.json").unlink()
    _refused(artifact_copy, r"^tokenizer\.json is listed in the manifest but missing$", capsys)


def test_missing_graph_entry_file(artifact_copy, capsys):
    """Graph file removed and un-listed: the graph entry still needs it."""
    (artifact_copy / "model_attn.onnx").unlink()
    m = read_manifest(artifact_copy)
    del m["files"]["model_attn.onnx"]
    write_manifest(artifact_copy, m)
    _refused(artifact_copy, r"graph model_attn file 'model_attn\.onnx' is not hashed", capsys)


def test_manifest_path_escaping(artifact_copy, capsys):
    m = read_manifest(artifact_copy)
    m["files"]["../config.json"] = m["files"]["config.json"]
    write_manifest(artifact_copy, m)
    _refused(artifact_copy, r"manifest file '\.\./config\.json' escapes the artifact directory",
             capsys)


def test_external_data_location_traversal(artifact_copy, capsys):
    shutil.copy(artifact_copy / "model.onnx.data", artifact_copy.parent / "model.onnx.data")
    relocate_external_data(artifact_copy, "../model.onnx.data")
    _refused(artifact_copy, r"^graph model external data location '\.\./model\.onnx\.data' "
                            r"escapes the artifact directory$", capsys)


def test_external_data_absolute_location(artifact_copy, capsys):
    outside = artifact_copy.parent / "elsewhere.data"
    shutil.copy(artifact_copy / "model.onnx.data", outside)
    relocate_external_data(artifact_copy, str(outside.resolve()))
    _refused(artifact_copy, r"^graph model external data location '/.*elsewhere\.data' "
                            r"escapes the artifact directory$", capsys)


def test_external_data_unhashed_location(artifact_copy, capsys):
    """Inside the directory but not hashed (the manifest itself is the one such file):
    refused, since no hash vouches for what the graph would read."""
    relocate_external_data(artifact_copy, "manifest.json")
    _refused(artifact_copy, r"^graph model external data 'manifest\.json' is not in the "
                            r"manifest$", capsys)


@pytest.mark.parametrize("rel", ["config.json", "model.onnx.data"])
def test_symlinked_file(artifact_copy, capsys, rel):
    """Same bytes, so the hash matches: only the symlink rule can refuse it."""
    target = artifact_copy.parent / ("outside-" + Path(rel).name)
    shutil.copy(artifact_copy / rel, target)
    (artifact_copy / rel).unlink()
    (artifact_copy / rel).symlink_to(target)
    assert sha256_file(artifact_copy / rel) == read_manifest(artifact_copy)["files"][rel]["sha256"]
    _refused(artifact_copy, rf"^manifest file '{rel}' goes through a symlink", capsys)


def test_symlinked_directory(artifact_copy, tmp_path, capsys):
    link = tmp_path / "link"
    link.symlink_to(artifact_copy)
    _refused(link, r"is a symlink; refused", capsys)


def test_no_manifest(artifact_copy, capsys):
    (artifact_copy / "manifest.json").unlink()
    _refused(artifact_copy, r"has no manifest\.json", capsys)


@pytest.mark.parametrize("name,portable", [(n, False) for n in CONFIGS] + [("gpt2", True),
                                                                          ("llama", True)])
def test_position_tables_are_found_by_their_names(store, name, portable):
    """The tables with a row per position (RoPE's cos / sin, learned or sinusoidal positions)
    are found under the names the export writes, in every graph that has them, so a
    config.json that claims more positions than they hold is refused; a graph that computes
    its positions' rows (no positions; the portable graphs' RoPE) has none to check."""
    root = store.artifact(name, portable=portable)
    cfg = make_config(name)
    computed = cfg.positions == "none" or (portable and cfg.positions != "learned")
    for g, spec in read_manifest(root)["graphs"].items():
        model = onnx.load(root / spec["file"], load_external_data=False)
        assert schema.position_rows(model) == (None if computed else cfg.max_seq_len), g

