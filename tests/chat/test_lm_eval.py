"""lm-evaluation-harness (0.4.13, not a project dependency: skipped without it) offline on
three tiny local tasks (multiple_choice, loglikelihood_rolling, generate_until; task YAMLs and
JSON data written here) against the served model through ``local-completions`` and against
lm-eval's own ``hf`` backend on the same weights (a random-init transformers Llama, imported
and exported by kvserve): per-sample loglikelihoods within 2e-3, the same accuracies, the same
generations; and once with no local tokenizer (the server's /tokenize and /tokenizer_info)."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("lm_eval")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvserve_testing import TRAIN_TEXTS, running_app  # noqa: E402

LL_TOL = 2e-3
MC = [{"question": "def add(a, b):", "choices": ["\n    return a + b", "\n    print(i)",
                                                  " café"], "answer": 0},
      {"question": "for i in range(10):", "choices": ["\n    print(i * 2)", " emoji",
                                                      "\n    return"], "answer": 0},
      {"question": "class Point:", "choices": [" naïve", "\n    def __init__(self, x, y):"],
       "answer": 1}]
ROLL = [{"text": "naïve café, 日本語のテキスト"},
        {"text": "def add(a, b):\n    return a + b"}]
GEN = [{"question": "# doc 3\ndef", "answer": " add"}, {"question": "for i in", "answer": " range"}]
TASKS = {
    "kv_mc": dict(output_type="multiple_choice", doc_to_text="{{question}}",
                  doc_to_choice="{{choices}}", doc_to_target="{{answer}}",
                  metric_list=[{"metric": "acc"}]),
    "kv_roll": dict(output_type="loglikelihood_rolling", doc_to_text="", doc_to_target="{{text}}",
                    metric_list=[{"metric": "word_perplexity"}]),
    "kv_gen": dict(output_type="generate_until", doc_to_text="{{question}}",
                   doc_to_target="{{answer}}", metric_list=[{"metric": "exact_match"}],
                   generation_kwargs={"until": ["\n"], "max_gen_toks": 8, "do_sample": False}),
}
DATA = {"kv_mc": MC, "kv_roll": ROLL, "kv_gen": GEN}


def _write_tasks(root) -> None:
    for name, spec in TASKS.items():
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in DATA[name]))
        cfg = dict(task=name, dataset_path="json", dataset_kwargs={"data_files":
                                                                   {"test": str(data)}},
                   test_split="test", **spec)
        (root / f"{name}.yaml").write_text(json.dumps(cfg))  # JSON is YAML


@pytest.fixture(scope="module")
def served_llama(tmp_path_factory):
    """(served app, HF directory): a random-init transformers Llama with a trained BPE,
    imported, exported and served over HTTP."""
    from kvserve.export.pipeline import export_artifacts
    from kvserve.model.hf_import import import_hf
    from kvserve.model.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("lm_eval")
    tok = train_bpe(TRAIN_TEXTS, vocab_size=512, min_frequency=1)
    cfg = transformers.LlamaConfig(
        vocab_size=tok.vocab_size, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id,
        initializer_range=0.15, tie_word_embeddings=False, attn_implementation="eager")
    torch.manual_seed(77)
    hf = transformers.LlamaForCausalLM(cfg).float().eval()
    hf_dir = root / "hf"
    hf.save_pretrained(str(hf_dir), safe_serialization=True)
    (hf_dir / "tokenizer.json").write_text(tok.to_str())
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast",
         "eos_token": tok.id_to_token(tok.eos_id), "model_max_length": 512}))
    ckpt = import_hf(hf_dir, root / "ckpt")
    art = export_artifacts(ckpt, root / "art", attention=False, progress=False, threads=1)

    class _A:
        dir = art

    with running_app(_A, http_port=0, max_batch=4) as app:
        yield app, hf_dir


def _evaluate(model: str, model_args: dict, tasks_dir) -> dict:
    from lm_eval import evaluator
    from lm_eval.tasks import TaskManager

    out = evaluator.simple_evaluate(model=model, model_args=model_args, tasks=list(TASKS),
                                    task_manager=TaskManager(include_path=str(tasks_dir)),
                                    log_samples=True, batch_size=1, random_seed=0,
                                    numpy_random_seed=0, torch_random_seed=0,
                                    fewshot_random_seed=0)
    return out


def _per_sample(out: dict) -> dict:
    got = {}
    for task in TASKS:
        got[task] = [s["filtered_resps"] for s in sorted(out["samples"][task],
                                                         key=lambda s: s["doc_id"])]
    return got


def _lls(resps) -> list[float]:
    flat = []
    for r in resps:
        for x in r:
            flat.append(float(x[0]) if isinstance(x, (list, tuple)) else float(x))
    return flat


def test_lm_eval_served_equals_hf_backend(served_llama, tmp_path, monkeypatch):
    app, hf_dir = served_llama
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "ds_cache"))
    monkeypatch.setenv("OPENAI_API_KEY", "unused")
    _write_tasks(tmp_path)
    base = f"http://127.0.0.1:{app.http_port}/v1/completions"
    ref = _evaluate("hf", {"pretrained": str(hf_dir), "dtype": "float32", "device": "cpu"},
                    tmp_path)
    want = _per_sample(ref)
    runs = {"local tokenizer": {"tokenizer": str(hf_dir), "tokenizer_backend": "huggingface"},
            "remote tokenizer": {"tokenizer_backend": "remote"}}
    for what, tok_args in runs.items():
        got_out = _evaluate("local-completions", {"model": "art", "base_url": base,
                                                  "num_concurrent": 1, "max_retries": 1,
                                                  **tok_args}, tmp_path)
        got = _per_sample(got_out)
        # the same choice picked per question (what accuracy counts), not only the same mean
        picks = [[max(range(len(r)), key=lambda k: r[k][0]) for r in g[task]]
                 for g in (got, want) for task in ("kv_mc",)]
        assert picks[0] == picks[1], what
        for task in ("kv_mc", "kv_roll"):
            a, b = _lls(got[task]), _lls(want[task])
            assert len(a) == len(b) and len(a) > 0, (what, task)
            assert max(abs(x - y) for x, y in zip(a, b)) < LL_TOL, (what, task, a, b)
        assert got["kv_gen"] == want["kv_gen"], what  # the same greedy generations
        assert any(g[0] for g in got["kv_gen"]), "empty generations prove nothing"
        assert got_out["results"]["kv_mc"]["acc,none"] == ref["results"]["kv_mc"]["acc,none"]
        assert got_out["results"]["kv_gen"]["exact_match,none"] == \
            ref["results"]["kv_gen"]["exact_match,none"]
