"""The chat template renders exactly as transformers' apply_chat_template does (ChatML-style and
Llama-3-style templates, with and without the generation prompt), tokenizes to the same ids, and
a template that tries to leave jinja's sandbox fails cleanly (FAILED_PRECONDITION), never runs."""
from __future__ import annotations

import pytest

from kvserve.server.chat_template import ChatTemplate
from kvserve.server.domain import FailedPrecondition, InvalidArgument

from kvserve_testing import CHATML_TEMPLATE, LLAMA3_TEMPLATE, chat_tokenizer

transformers = pytest.importorskip("transformers")

CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "You are terse.\n"},
     {"role": "user", "content": "  naïve café 😀 <b>&amp;</b> {{ not jinja }} "},
     {"role": "assistant", "content": "ok"},
     {"role": "user", "content": "again\n\n"}],
]
STYLES = [(CHATML_TEMPLATE, {"eos_token": "<|im_end|>"}),
          (LLAMA3_TEMPLATE, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"})]


@pytest.fixture(scope="module")
def tok():
    return chat_tokenizer()


def hf_tokenizer(tok, template, special):
    from tokenizers import Tokenizer as HFTokenizer

    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=HFTokenizer.from_str(tok.to_str()), chat_template=template, **special)


def _ids(out):
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("style", STYLES, ids=["chatml", "llama3"])
@pytest.mark.parametrize("chat", range(len(CHATS)))
@pytest.mark.parametrize("agp", [True, False])
def test_renders_exactly_as_transformers(tok, style, chat, agp):
    template, special = style
    hf = hf_tokenizer(tok, template, special)
    want = hf.apply_chat_template(CHATS[chat], tokenize=False, add_generation_prompt=agp)
    ours = ChatTemplate.from_tokenizer_config({"chat_template": template, **special})
    got = ours.render(CHATS[chat], add_generation_prompt=agp)
    assert got == want
    assert tok.encode(got) == _ids(hf.apply_chat_template(CHATS[chat], tokenize=True,
                                                          add_generation_prompt=agp))
    # the control tokens are single special tokens, not byte pieces
    assert tok.encode(got).count(tok.token_to_id(special["eos_token"])) >= 1


def test_template_features_as_transformers(tok):
    """tojson without HTML escaping, namespace, loop controls, dict(), {% generation %}."""
    template = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'skip' %}"
                "{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}{% generation %}"
                "{{ m | tojson }}{% endgeneration %}\n{% endfor %}{{ ns.n }}"
                "{{ dict(a=1) | tojson }}{{ eos_token }}")
    msgs = [{"role": "user", "content": "<a href='x'>é</a>"}, {"role": "skip", "content": "-"},
            {"role": "assistant", "content": "\"q\""}]
    hf = hf_tokenizer(tok, template, {"eos_token": "<|im_end|>"})
    want = hf.apply_chat_template(msgs, tokenize=False)
    got = ChatTemplate(template, {"eos_token": "<|im_end|>"}).render(msgs, False)
    assert got == want and "<a href='x'>é</a>" in got


@pytest.mark.parametrize("template", [
    "{{ messages.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ messages.append({'role': 'x'}) }}",
    "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",
    "{{ raise_exception.__globals__ }}{{ ''.__class__.__base__.__subclasses__() }}",
])
def test_sandbox_escape_fails_cleanly(template):
    t = ChatTemplate(template)
    with pytest.raises(FailedPrecondition) as e:
        t.render([{"role": "user", "content": "hi"}])
    assert "sandbox" in str(e.value) and "Traceback" not in str(e.value)


def test_raise_exception_is_the_callers_error():
    t = ChatTemplate(LLAMA3_TEMPLATE, {"bos_token": "<s>"})
    with pytest.raises(InvalidArgument, match="Only system, user and assistant roles"):
        t.render([{"role": "tool", "content": "x"}])


def test_template_sources(tmp_path):
    from kvserve.server.chat_template import TOKENIZER_CONFIG

    assert ChatTemplate.load(tmp_path) is None
    (tmp_path / TOKENIZER_CONFIG).write_text('{"chat_template": [{"name": "tool_use", '
                                             '"template": "T"}, {"name": "default", '
                                             '"template": "D{{ bos_token }}"}], '
                                             '"bos_token": {"content": "<s>"}}')
    assert ChatTemplate.load(tmp_path).render([{"role": "u", "content": "c"}]) == "D<s>"
    (tmp_path / TOKENIZER_CONFIG).write_text('{"chat_template": "{% for %}"}')
    with pytest.raises(ValueError, match="unusable chat template"):
        ChatTemplate.load(tmp_path)


def test_exported_artifact_carries_the_template(chat_artifact):
    """export copied the checkpoint's tokenizer_config.json; the manifest hashes it (so verify
    refuses a changed template)."""
    import json

    from kvserve.artifact.manifest import sha256_file
    from kvserve.server.chat_template import TOKENIZER_CONFIG

    path = chat_artifact.dir / TOKENIZER_CONFIG
    manifest = json.loads((chat_artifact.dir / "manifest.json").read_text())
    assert manifest["files"][TOKENIZER_CONFIG]["sha256"] == sha256_file(path)
    assert ChatTemplate.load(chat_artifact.dir).source == CHATML_TEMPLATE
