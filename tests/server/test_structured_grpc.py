"""Constrained decoding through the real gRPC server on the tiny random-init model: its output
is valid only because the server enforces the constraint (mask before sampling, greedy and
sampled, alone and sharing a batch with unconstrained rows); bad constraints are refused
naming the field."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import pytest

from kvserve.clients.messages import completion, generate_request
from kvserve.v1 import inference_pb2 as pb

# bounded fields: a random model's free integer or string would run to max_new_tokens
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0,
                                                   "maximum": 150},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"], "additionalProperties": False}
SAMPLINGS = [dict(), dict(temperature=0.9, seed=11), dict(temperature=1.3, top_k=50, seed=3)]


def _generate(stub, prompt="The answer:", **kw):
    msgs = list(stub.Generate(generate_request(prompt, max_new_tokens=96, **kw), timeout=120))
    return completion(msgs[-1].complete)


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "sampled", "hot"])
def test_every_kind_of_constraint_holds(stub, sampling):
    done = _generate(stub, json_schema=SCHEMA, **sampling)
    jsonschema.validate(json.loads(done.text), SCHEMA)
    assert done.finish_reason in ("constraint", "eos_token")
    obj = _generate(stub, json_object=True, **sampling)
    if obj.finish_reason == "length":  # an unbounded object may outrun max_new_tokens
        assert obj.text.startswith("{")
    else:
        assert isinstance(json.loads(obj.text), dict)
    rx = _generate(stub, regex=r"[a-c]{2,5}-[0-9]{3}", **sampling)
    assert re.fullmatch(r"[a-c]{2,5}-[0-9]{3}", rx.text), rx.text
    ch = _generate(stub, choice=["red", "green", "blue sky"], **sampling)
    assert ch.text in ("red", "green", "blue sky")
    gr = _generate(stub, grammar='start: "(" NUM ("," NUM)? ("," NUM)? ")"\nNUM: /[0-9]{1,3}/',
                   **sampling)
    assert re.fullmatch(r"\(\d{1,3}(,\d{1,3}){0,2}\)", gr.text), gr.text


def test_constrained_and_free_rows_share_a_batch(stub):
    """Eight calls at once: four constrained, four free; each free one equals its output
    alone (the mask touches its own row only)."""
    free = dict(prompt="def f(x):")
    solo = _generate(stub, **free)
    with ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(_generate, stub, json_schema=SCHEMA) if i % 2 else
                pool.submit(_generate, stub, **free) for i in range(8)]
        outs = [f.result() for f in futs]
    for i, out in enumerate(outs):
        if i % 2:
            jsonschema.validate(json.loads(out.text), SCHEMA)
        else:
            assert out.text == solo.text


def test_forced_tokens_are_fast_forwarded_and_counted(app, stub):
    """The schema's fixed keys are forced: the server feeds them as drafts (on by default) and
    its Prometheus endpoint counts them."""
    from test_metrics import scrape, value

    before = app.metrics.forced_tokens.get()
    done = _generate(stub, json_schema=SCHEMA)
    jsonschema.validate(json.loads(done.text), SCHEMA)
    gained = app.metrics.forced_tokens.get() - before
    assert gained >= len('{"name":"'), gained  # (the tiny BPE spells it out: a token a char)
    _, body = scrape(app.metrics_server.port)
    assert value(body, "kvserve_constraint_forced_tokens_total") >= gained


@pytest.mark.parametrize("structured, field", [
    (pb.Structured(json_schema="{not json"), "structured.json_schema"),
    (pb.Structured(regex="(unclosed"), "structured.regex"),
    (pb.Structured(grammar="start: undefined_rule"), "structured.grammar"),
    (pb.Structured(choice=pb.ChoiceList()), "structured.choice"),
    (pb.Structured(json_object=False), "structured"),
    (pb.Structured(json_schema='{"$ref": "#"}'), "structured.json_schema"),  # no first token
])
def test_bad_constraints_are_refused_naming_the_field(stub, structured, field):
    req = generate_request("hi", max_new_tokens=4)
    req.structured.CopyFrom(structured)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(req, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in e.value.details()


def test_a_dead_end_schema_fails_instead_of_finishing(stub):
    """A required property whose $ref leads only back to itself: llguidance lets '{"a":'
    through, then allows only an end token; the request ends INVALID_ARGUMENT naming the dead
    end, where it had finished '{"a":' with the end token as if the JSON were complete."""
    schema = {"type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}, "required": ["a"],
              "$defs": {"n": {"$ref": "#/$defs/n"}}}
    with pytest.raises(grpc.RpcError) as e:
        _generate(stub, json_schema=schema)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("the constraint allows no next token after the output "
                                        "so far: no complete output"), e.value.details()
