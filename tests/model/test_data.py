"""Data pipeline: inputs, errors, deterministic split, memmapped tokens, batches."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from kvserve.model import data as D
from kvserve.model.corpus import stdlib_sources


def test_resolve_inputs_dirs_globs_files(tiny_corpus, tiny_jsonl):
    files = D.resolve_inputs([tiny_corpus])
    assert len(files) == 48 and files == sorted(files)
    (tiny_corpus / "__pycache__").mkdir(exist_ok=True)
    (tiny_corpus / "__pycache__" / "x.pyc").write_bytes(b"\xff\xfe")
    (tiny_corpus / ".hidden").write_text("no")
    assert D.resolve_inputs([tiny_corpus]) == files
    globbed = D.resolve_inputs([str(tiny_corpus / "pkg1" / "*.py")])
    assert len(globbed) == 16
    rec = D.resolve_inputs([str(tiny_corpus / "**" / "*.py")])
    assert rec == files
    both = D.resolve_inputs([tiny_corpus, str(tiny_corpus / "pkg0" / "*.py"), tiny_jsonl])
    assert len(both) == 49  # de-duplicated


def test_missing_and_empty_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        D.resolve_inputs([tmp_path / "nope.txt"])
    with pytest.raises(FileNotFoundError, match="no files match"):
        D.resolve_inputs([str(tmp_path / "*.zzz")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="contains no files"):
        D.resolve_inputs([tmp_path / "empty"])
    (tmp_path / "e.txt").write_text("")
    with pytest.raises(ValueError, match="no text found"):
        D.split_units([tmp_path / "e.txt"], "text")
    with pytest.raises(ValueError, match="no training data"):
        D.resolve_inputs([])


def test_bad_files(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok \xff\xfe not utf8")
    with pytest.raises(ValueError, match=r"bad.txt is not valid UTF-8 \(byte offset 3\)"):
        list(D.iter_documents([bad]))
    j = tmp_path / "d.jsonl"
    j.write_text('{"text": "a"}\n\n{"body": "b"}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:3: no 'text' field"):
        list(D.iter_documents([j]))
    j.write_text('{"text": "a"}\n{"text": 3}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:2: field 'text' is int"):
        list(D.iter_documents([j]))
    j.write_text('{"text": "a"}\nnot json\n')
    with pytest.raises(ValueError, match=r"d.jsonl:2: invalid JSON"):
        list(D.iter_documents([j]))
    if os.geteuid() != 0:  # root reads everything
        unreadable = tmp_path / "locked.txt"
        unreadable.write_text("x")
        unreadable.chmod(0)
        with pytest.raises(ValueError, match="cannot read"):
            list(D.iter_documents([unreadable]))


def test_jsonl_text_field(tmp_path):
    j = tmp_path / "d.jsonl"
    j.write_text(json.dumps({"body": "hello\nworld"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    assert list(D.iter_documents([j], "body")) == ["hello\nworld", "x"]


def test_split_is_deterministic_and_nonempty(tiny_docs):
    units = [D.doc_hash_unit(d) for d in tiny_docs]
    a = D.assign_split(units, 0.1)
    assert a == D.assign_split([D.doc_hash_unit(d) for d in tiny_docs], 0.1)
    assert 0 < sum(a) < len(a)
    assert D.assign_split([0.9, 0.95], 0.05) == [True, False]  # never an empty side
    assert D.assign_split([0.01, 0.02], 0.05) == [True, False]


def test_build_tokens_memmap(tiny_corpus, tiny_tokenizer, tmp_path):
    files = D.resolve_inputs([tiny_corpus])
    data = D.build_tokens(files, tiny_tokenizer, tmp_path / "tok", val_fraction=0.2)
    assert isinstance(data.train, np.memmap) and data.train.dtype == np.uint16
    eos = tiny_tokenizer.eos_id
    docs = list(D.iter_documents(files))
    assert int((data.train == eos).sum()) + int((data.val == eos).sum()) == len(docs)
    # the streams decode back to the documents, joined by eos
    is_val = D.assign_split([D.doc_hash_unit(d) for d in docs], 0.2)
    want_val = "".join(d + "<|endoftext|>" for d, v in zip(docs, is_val) if v)
    assert tiny_tokenizer.decode(data.val.tolist()) == want_val
    assert data.meta["n_val_docs"] == sum(is_val)
    again = D.build_tokens(files, tiny_tokenizer, tmp_path / "tok2", val_fraction=0.2)
    assert np.array_equal(again.train, data.train) and np.array_equal(again.val, data.val)
    assert D.open_tokens(tmp_path / "tok").meta == data.meta  # reused from disk


def test_single_document_is_split_by_tokens(tmp_path, tiny_tokenizer):
    f = tmp_path / "one.txt"
    f.write_text("def f(x):\n    return x * 2\n" * 100)
    data = D.build_tokens([f], tiny_tokenizer, tmp_path / "tok", val_fraction=0.1)
    n = data.meta["n_train"] + data.meta["n_val"]
    assert data.meta["n_val"] == n - round(n * 0.9) and data.meta["n_val"] > 0


def test_token_dtype():
    assert D.token_dtype(4096) == np.uint16
    assert D.token_dtype(65535) == np.uint16
    assert D.token_dtype(65536) == np.uint32


def test_batch_sampler_deterministic_and_sharded():
    tokens = np.arange(1000, dtype=np.uint16)
    s = D.BatchSampler(tokens, batch_size=4, seq_len=16, seed=3, grad_accum=2)
    x, y = s.micro_batch(7, 1)
    assert x.shape == (4, 16) and str(x.dtype) == "torch.int64"
    assert (y[:, :-1] == x[:, 1:]).all() and (y[:, -1] == x[:, -1] + 1).all()
    x2, _ = D.BatchSampler(tokens, 4, 16, seed=3, grad_accum=2).micro_batch(7, 1)
    assert (x == x2).all()
    assert not (s.micro_batch(8, 1)[0] == x).all()
    # two ranks with batch 2 == one process with batch 4, micro by micro
    one = D.BatchSampler(tokens, 4, 16, seed=3, grad_accum=2)
    r0 = D.BatchSampler(tokens, 2, 16, seed=3, grad_accum=2, world_size=2, rank=0)
    r1 = D.BatchSampler(tokens, 2, 16, seed=3, grad_accum=2, world_size=2, rank=1)
    for m in range(2):
        joined = np.concatenate([r0.micro_batch(5, m)[0], r1.micro_batch(5, m)[0]])
        assert (one.micro_batch(5, m)[0].numpy() == joined).all()
    with pytest.raises(ValueError, match="fewer than seq_len"):
        D.BatchSampler(tokens[:10], 2, 16, seed=0)


def test_eval_starts_and_unigram():
    st = D.eval_starts(100, 10, 5)
    assert st[0] == 0 and st[-1] == 89 and len(st) == 5
    with pytest.raises(ValueError, match="validation split"):
        D.eval_starts(5, 10, 2)
    assert D.unigram_entropy(np.array([1, 1, 2, 2]), 4) == pytest.approx(np.log(2))
    assert D.unigram_entropy(np.array([3, 3, 3]), 4) == 0.0


def test_stdlib_corpus_is_sorted_and_capped():
    files = stdlib_sources(max_bytes=300_000)
    assert files == sorted(files) and files
    assert sum(f.stat().st_size for f in files) <= 300_000
    assert all(f.suffix == ".py" and "site-packages" not in f.parts for f in files)
    assert all("test" not in f.parts for f in files)
