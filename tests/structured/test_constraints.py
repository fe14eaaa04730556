"""server/constraints.py: every kind, decoded greedily and sampled (seeded) over random logits
with a trained byte-level BPE and the real Qwen3 tokenizer, yields valid output; bad specs are
refused naming the field; the Constraint's contract (consume, forced, done, vocab padding)."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from decoding import RandomModel, generate
from kvserve.server.constraints import (MAX_REGEX_CHARS, ConstraintSpec, ConstraintViolation,
                                        GuideTokenizer, apply_bitmask, unpack_bitmask)
from kvserve.server.domain import InvalidArgument

jsonschema = pytest.importorskip("jsonschema")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "active": {"type": "boolean"},
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                     "zip": {"type": ["integer", "null"]}},
                    "required": ["city"], "additionalProperties": False},
    },
    "required": ["name", "age", "tags", "active", "code", "address"],
    "additionalProperties": False,
}
PHONE = r"(\+[0-9]{1,3} )?[0-9]{3}-[0-9]{4}"
CHOICES = ["yes", "no", "maybe so", 'a "quoted" one', "日本語", "new\nline"]
ARITH = """
start: expr
expr: term (("+" | "-") term)*
term: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,3}/
"""


def _check(kind: str, text: str):
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), PERSON)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(PHONE, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    else:
        lark = pytest.importorskip("lark")
        lark.Lark(ARITH, start="start").parse(text)  # raises if it does not parse


SPECS = {"json_schema": lambda: ConstraintSpec.json_schema(PERSON),
         "json_object": ConstraintSpec.json_object,
         "regex": lambda: ConstraintSpec.regex(PHONE),
         "choice": lambda: ConstraintSpec.choice(CHOICES),
         "grammar": lambda: ConstraintSpec.lark(ARITH)}


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
@pytest.mark.parametrize("kind", list(SPECS))
def test_any_logits_give_valid_output_bpe(bpe, bpe_guide, kind, greedy):
    for seed in range(4):
        model = RandomModel(bpe.to_str(), bpe.vocab_size, bpe_guide.eos_ids, seed)
        text, _, _ = generate(bpe_guide, SPECS[kind](), model, greedy,
                              fast_forward=seed % 2 == 1)
        _check(kind, text)


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
@pytest.mark.parametrize("kind", list(SPECS))
def test_any_logits_give_valid_output_qwen3(qwen3_dir, qwen3_guide, kind, greedy):
    tj = (qwen3_dir / "tokenizer.json").read_text()
    model = RandomModel(tj, qwen3_guide.vocab_size, qwen3_guide.eos_ids, seed=7)
    text, ids, _ = generate(qwen3_guide, SPECS[kind](), model, greedy, fast_forward=True)
    _check(kind, text)
    assert max(ids) < 151669  # never one of the model's padding ids (151,669-151,935)


def test_fast_forward_forces_the_only_choice(bpe, bpe_guide):
    c = bpe_guide.constraint(ConstraintSpec.choice(["def add(a, b):"]))
    ff = c.forced()
    assert bpe.decode(ff) == "def add(a, b):"
    c.consume_tokens(ff)
    # nothing can follow: done at once (the engine finishes the row: no end token needed)
    assert c.accepting and c.done
    assert np.flatnonzero(c.allowed()).tolist() == [bpe.eos_id]
    c.consume(bpe.eos_id)  # taking the end token anyway is allowed
    assert c.done


def test_done_waits_for_the_end_token_when_the_text_may_go_on(bpe, bpe_guide):
    c = bpe_guide.constraint(ConstraintSpec.choice(["ab", "abc"]))
    c.consume_tokens(bpe.encode("ab"))
    assert c.accepting and not c.done
    allowed = np.flatnonzero(c.allowed()).tolist()
    assert bpe.eos_id in allowed and bpe.token_to_id("c") in allowed
    c.consume(bpe.eos_id)
    assert c.done


def test_refused_token_raises(bpe, bpe_guide):
    c = bpe_guide.constraint(ConstraintSpec.regex("[0-9]+"))
    allowed = c.allowed()
    assert allowed[bpe.token_to_id("7")] and not allowed[bpe.token_to_id("x")]
    assert not allowed[bpe.eos_id]  # the empty string does not match [0-9]+
    with pytest.raises(ConstraintViolation, match="not allowed by the regex constraint"):
        c.consume(bpe.token_to_id("x"))


# a required property whose $ref leads only back to itself: no complete value exists
DEAD_END = {"type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}, "required": ["a"],
            "$defs": {"n": {"$ref": "#/$defs/n"}}}


@pytest.mark.parametrize("schema", [{"$ref": "#"},
                                    {"$defs": {"n": {"$ref": "#/$defs/n"}}, "$ref": "#/$defs/n"}])
def test_a_schema_with_no_first_token_is_refused(bpe_guide, schema):
    """llguidance compiles these; its matcher fails on its first mask (allowing only an end
    token), which a request took as an empty reply finished by that token."""
    spec = ConstraintSpec.json_schema(schema)  # (compiles)
    with pytest.raises(InvalidArgument, match=r"^json_schema: no output satisfies this "
                                              r"json_schema constraint: it allows no first "
                                              r"token \(e\.g\. a schema that is only a \$ref "
                                              r"to itself\)$") as e:
        bpe_guide.constraint(spec)
    assert e.value.field == "json_schema"  # (HTTP's param)


def test_a_dead_end_is_an_error_not_a_completion(bpe, bpe_guide):
    c = bpe_guide.constraint(ConstraintSpec.json_schema(DEAD_END))
    c.consume_tokens(c.forced())  # '{"a":' (forced: the only way on)
    assert c.error is None
    allowed = np.flatnonzero(c.allowed()).tolist()
    assert allowed == [bpe.eos_id] and c.error is not None


def test_apply_masks_in_place_and_matches_llguidance(bpe, bpe_guide):
    import llguidance.numpy as lln

    c = bpe_guide.constraint(ConstraintSpec.json_schema(PERSON))
    logits = np.random.default_rng(0).standard_normal(bpe.vocab_size).astype(np.float32)
    ref = logits.copy()[None]
    mask = lln.allocate_token_bitmask(1, bpe.vocab_size)
    c.fill(mask[0])
    lln.apply_token_bitmask_inplace(ref, mask)
    c.apply(logits)
    np.testing.assert_array_equal(logits, ref[0])
    allowed = unpack_bitmask(mask, bpe.vocab_size)[0]
    assert 0 < allowed.sum() < 50  # the object's opening: "{" and whitespace variants
    assert np.isneginf(logits[~allowed]).all() and np.isfinite(logits[allowed]).all()


def test_model_vocab_above_the_tokenizers_is_never_allowed(bpe):
    g = GuideTokenizer(bpe.to_str(), bpe.vocab_size + 37, [bpe.eos_id])
    c = g.constraint(ConstraintSpec.regex(".{1,5}"))
    allowed = c.allowed()
    assert allowed.shape == (bpe.vocab_size + 37,)
    assert allowed[:bpe.vocab_size].sum() > 200 and not allowed[bpe.vocab_size:].any()
    logits = np.zeros(bpe.vocab_size + 37, np.float32)
    c.apply(logits)
    assert np.isneginf(logits[bpe.vocab_size:]).all()


def test_apply_masks_a_strided_row_in_place(bpe, bpe_guide):
    c = bpe_guide.constraint(ConstraintSpec.regex("[0-9]+"))
    batch = np.asfortranarray(np.zeros((3, bpe.vocab_size), np.float32))
    row = batch[1]  # not contiguous in a Fortran-ordered batch
    assert not row.flags["C_CONTIGUOUS"]
    c.apply(row)
    allowed = np.isfinite(batch[1])
    np.testing.assert_array_equal(allowed, c.allowed())
    assert allowed[bpe.token_to_id("7")] and not allowed[bpe.token_to_id("x")]
    assert np.isfinite(batch[[0, 2]]).all()
    with pytest.raises(ValueError, match="both rows or both batches"):
        apply_bitmask(batch, np.zeros(40, np.int32))


def test_apply_bitmask_rows_and_float16():
    mask = np.array([[0b101, 0], [-1, 1]], dtype=np.int32)  # 64 bits, vocab 40
    logits = np.zeros((2, 40), np.float16)
    apply_bitmask(logits, mask)
    assert np.flatnonzero(np.isfinite(logits[0])).tolist() == [0, 2]
    assert np.flatnonzero(np.isfinite(logits[1])).tolist() == list(range(33))


@pytest.mark.parametrize("make, field, message", [
    (lambda: ConstraintSpec.json_schema({"type": "frob"}, field="response_format.json_schema"),
     "response_format.json_schema", "Invalid type: frob"),
    (lambda: ConstraintSpec.json_schema({"properties": {"a": {"$ref": "#/nope"}}}),
     "json_schema", "/nope"),
    (lambda: ConstraintSpec.json_schema("{not json", field="structured_outputs.json"),
     "structured_outputs.json", "not valid JSON"),
    (lambda: ConstraintSpec.json_schema([1, 2]), "json_schema", "must be a JSON schema"),
    (lambda: ConstraintSpec.json_schema({"type": "string", "pattern": "(?=a)b"}),
     "json_schema", "look-around"),
    (lambda: ConstraintSpec.regex("a(", field="structured_outputs.regex"),
     "structured_outputs.regex", "unclosed group"),
    (lambda: ConstraintSpec.regex(""), "regex", "non-empty string"),
    (lambda: ConstraintSpec.regex("a" * (MAX_REGEX_CHARS + 1)), "regex", "the limit is 4096"),
    (lambda: ConstraintSpec.lark("start: foo"), "grammar", 'unknown name: "foo"'),
    (lambda: ConstraintSpec.lark(42), "grammar", "non-empty string"),
    (lambda: ConstraintSpec.choice([]), "choice", "needs 1 to 1024"),
    (lambda: ConstraintSpec.choice("yes"), "choice", "must be a list of strings"),
    (lambda: ConstraintSpec.choice(["a", 3]), r"choice\[1\]", "non-empty string"),
    (lambda: ConstraintSpec("xml", "<a/>", "structured"), "structured", "unknown constraint"),
    (lambda: ConstraintSpec.json_schema(False), "json_schema", "no output matches"),
    (lambda: ConstraintSpec.json_schema("false", field="guided_json"), "guided_json",
     "no output matches"),
    # a lone surrogate, legal in JSON text, in every kind (llguidance cannot encode it)
    (lambda: ConstraintSpec.json_schema({"enum": ["\ud800"]}), "json_schema", "lone surrogate"),
    (lambda: ConstraintSpec.json_schema({"properties": {"\udfff": {}}}), "json_schema",
     "lone surrogate"),
    (lambda: ConstraintSpec.regex("a\ud800"), "regex",
     re.escape("lone surrogate '\\ud800' at character 1")),
    (lambda: ConstraintSpec.lark('start: "\ud800"'), "grammar", "lone surrogate"),
    (lambda: ConstraintSpec.choice(["ok", "\ud800"]), r"choice\[1\]", "lone surrogate"),
])
def test_bad_specs_are_refused_naming_the_field(make, field, message):
    with pytest.raises(InvalidArgument, match=f"^{field}: .*{message}|^{field} .*{message}"):
        make()


def test_the_schema_true_is_any_json_value(bpe, bpe_guide):
    """``true`` is a JSON Schema (anything goes): the output is some JSON value."""
    for seed in range(3):
        model = RandomModel(bpe.to_str(), bpe.vocab_size, bpe_guide.eos_ids, seed)
        text, _, _ = generate(bpe_guide, ConstraintSpec.json_schema("true"), model, seed != 1)
        json.loads(text)


def test_llguidance_refusals_are_invalid_argument(monkeypatch):
    """Whatever llguidance raises on a value the checks let through is the caller's error."""
    import kvserve.server.constraints as C

    def boom(*a, **k):
        raise ValueError("Expecting object schema to apply options")
    monkeypatch.setattr(C.llg.LLMatcher, "grammar_from_regex", staticmethod(boom))
    with pytest.raises(InvalidArgument, match="^guided_regex: Expecting object schema"):
        ConstraintSpec.regex("a", field="guided_regex")


def test_error_messages_are_one_bounded_line():
    with pytest.raises(InvalidArgument) as e:
        ConstraintSpec.lark("start: " + " | ".join(f'"x{i}" foo{i}' for i in range(200)))
    assert "\n" not in str(e.value) and len(str(e.value)) < 400


def test_spec_equality_and_choice_list_normalised():
    assert ConstraintSpec.choice(["a", "b"]) == ConstraintSpec.choice(("a", "b"))
    assert ConstraintSpec.json_schema('{"type": "integer"}').kind == "json_schema"
    with pytest.raises(ValueError, match="end token"):
        GuideTokenizer('{"model": {}}', 10, [])


def test_components_import_neither_torch_nor_transformers():
    """The server install is torch-free: the structured-output components stay so."""
    import subprocess
    import sys

    code = ("import sys\n"
            "import kvserve.server.constraints, kvserve.server.constraint_masks\n"
            "import kvserve.server.tool_calls, kvserve.server.tool_call_stream\n"
            "import kvserve.server.http_tokenize, kvserve.server.prompts\n"
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
            "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-500:]


def _answers(tok):
    """(spec, a valid answer's text) of each kind kvserve builds: schema, object, regex,
    choice, a request's own Lark (with ``%json``), and a forced Hermes tool call (its markers
    Qwen3's added tokens)."""
    from kvserve.server.tool_calls import Tool, ToolFormat, added_token_ids, tool_constraint

    tool = Tool("f", {"type": "object", "properties": {"x": {"type": "integer"}},
                      "required": ["x"]}, {})
    call = tool_constraint([tool], "required", ToolFormat.HERMES, False,
                           added_token_ids(tok.to_str()))
    return {"json_schema": (ConstraintSpec.json_schema(
                {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
                '{"a":1}'),
            "json_object": (ConstraintSpec.json_object(), '{"b":2}'),
            "regex": (ConstraintSpec.regex("[a-z]{2,4}!"), "abc!"),
            "choice": (ConstraintSpec.choice(["yes", "no"]), "no"),
            "grammar": (ConstraintSpec.lark('start: "n=" %json {"type": "integer"}'), "n=5"),
            "tool call": (call, '<tool_call>\n{"name":"f","arguments":{"x":3}}\n</tool_call>')}


KINDS_AFTER = ("json_schema", "json_object", "regex", "choice", "grammar", "tool call")


@pytest.mark.parametrize("kind", KINDS_AFTER)
@pytest.mark.parametrize("opened, shape, allowed", [
    (False, "<think>\nhmm\n</think>\n\n{A}", True),  # a thought, then the answer
    (False, "{A}", True),  # no thought
    (False, "hmm</think>\n{A}", False),  # a thought not opened
    (False, "<think>x</think>zz{A}", False),  # the answer still constrained
    (False, "<think>x</think>\n\n\n{A}", False),  # at most two newlines between
    (True, "hmm</think>\n{A}", True),  # the prompt opened it: the reply closes it
    (True, "{A}", "open"),  # (still the thought: the reply must close it to answer)
    (True, "<think>\nhmm\n</think>\n\n{A}", False),  # (not opened again)
])
def test_a_constraint_after_a_thought(qwen3_dir, qwen3_guide, kind, opened, shape, allowed):
    """``after_thought`` (``--reasoning-parser think``): Qwen3's ``<think>`` / ``</think>``
    tokens around free text, then what each kind of constraint allows; a complete reply
    accepted and ended by the end token; the end token refused inside the thought."""
    from tokenizers import Tokenizer

    from kvserve.server.constraints import after_thought

    tok = Tokenizer.from_file(str(qwen3_dir / "tokenizer.json"))
    o, c = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    spec, answer = _answers(tok)[kind]
    if allowed == "open" and kind == "tool call":
        allowed = False  # (its <tool_call> token: no text, so not in a thought)
    con = qwen3_guide.constraint(after_thought(spec, o, c, opened))
    ids = tok.encode(shape.replace("{A}", answer), add_special_tokens=False).ids
    if not allowed:
        with pytest.raises(ConstraintViolation):
            con.consume_tokens(ids)
        return
    thought = ids[:ids.index(c)] if c in ids else ids if allowed == "open" else []
    end = tok.token_to_id("<|im_end|>")
    con.consume_tokens(thought)
    assert not con.allowed()[end] or not thought  # (no end inside the thought)
    con.consume_tokens(ids[len(thought):])
    assert con.accepting is (allowed is True)
    assert bool(con.allowed()[end]) is (allowed is True)


def test_the_close_tag_as_text_does_not_end_a_thought(qwen3_dir, qwen3_guide):
    """``</think>`` written in pieces of text is refused inside the thought (the reply's
    split would cut there, outside the constraint)."""
    from tokenizers import Tokenizer

    from kvserve.server.constraints import after_thought

    tok = Tokenizer.from_file(str(qwen3_dir / "tokenizer.json"))
    spec = after_thought(ConstraintSpec.choice(["yes", "no"]), tok.token_to_id("<think>"),
                         tok.token_to_id("</think>"), False)
    con = qwen3_guide.constraint(spec)
    pieces = [tok.token_to_id("<think>")] + [t for piece in ("a", "</", "think>")
                                            for t in tok.encode(piece).ids]
    with pytest.raises(ConstraintViolation):
        con.consume_tokens(pieces)
