"""Grammars over llguidance (executor/grammar.py): every kind compiles, a bad
grammar carries the library's message, masks allow EOS exactly when the
grammar may end, walks under a JSON schema's masks give valid JSON (with a
negative control), replay equals stepwise, a batched mask fill equals one by
one, a refused token leaves the matcher usable, borrowing, and the
REGISTER_GRAMMAR / RELEASE_GRAMMAR ops through the executor."""

from __future__ import annotations

import json

import jsonschema
import msgpack
import numpy as np
import pytest

from superfluid.abi import OpKind, OpStatus
from superfluid.engine import load
from superfluid.engine.tiny import write_tiny
from superfluid.executor.executor import Executor
from superfluid.executor.grammar import KINDS, GrammarError, GrammarRegistry, GrammarsUnsupported
from superfluid.kernels import reference_sampler as reference
from superfluid.testing.executor import fake, small_rings

V = 320  # the tiny model: 256 byte tokens (id == byte), specials 256..259, unused ids after
EOS = frozenset({257, 259})

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "kind": {"enum": ["x", "y"]},
    },
    "required": ["name", "age", "ok", "tags"],
    "additionalProperties": False,
}

GOOD = {
    "json_schema": (json.dumps(SCHEMA), '{"name":"bo","age":7,"ok":true,"tags":["a"]}'),
    "regex": (r"[a-c]{2}-[0-9]{2}", "ab-12"),
    "lark": ('start: "(" num ("," num)* ")"\nnum: /[0-9]+/', "(1,22)"),
    "gbnf": ('root ::= "x" [0-9] [0-9]?', "x42"),
    "choice": (["yes", "no", "ma\"ybe"], 'ma"ybe'),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("tiny-grammar"), seed=3)


@pytest.fixture(scope="module")
def tok_json(model_dir) -> str:
    return (model_dir / "tokenizer.json").read_text()


@pytest.fixture()
def reg(tok_json) -> GrammarRegistry:
    return GrammarRegistry(tok_json, V, EOS, threads=2)


def allowed(bits_row: np.ndarray) -> set[int]:
    return set(np.flatnonzero(reference.mask_allowed(bits_row, V)).tolist())


def mask_of(m) -> np.ndarray:
    row = np.zeros((V + 31) // 32, dtype=np.int32)
    assert m.fill(row)
    return row


def walk(reg, g, rng, *, masked: bool = True, max_steps: int = 300) -> tuple[bytes, bool]:
    """Sample from random logits under the grammar's masks (the host sampler, a
    random position each step) until it completes; the bytes, and whether the
    grammar completed. Without the mask the draw ignores the grammar."""
    m = g.matcher()
    out = bytearray()
    for _ in range(max_steps):
        row = (3 * rng.standard_normal(V)).astype(np.float32)
        row[256:] = -np.inf  # no specials or unused ids: an untrained row would pick them
        bits = mask_of(m)
        if masked:
            reference.apply_bitmask(row, bits)
        tok = reference.sample(row, 1.0, 0, 0.0, 0.0, int(rng.integers(0, 2**63)))
        if masked:
            assert tok in allowed(bits)
        if not m.accept(tok):
            assert not masked, "a token the mask allowed was refused"
            out.append(tok)
            continue
        out.append(tok)
        if m.is_complete():
            return bytes(out), True
    return bytes(out), False


# ---------------------------------------------------------------- compiling


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_compiles_and_accepts_its_example(reg, kind):
    text, example = GOOD[kind]
    g = reg.compile(kind, text)
    assert g.kind == kind and g.compile_us >= 0
    m = g.matcher()
    assert not m.is_accepting()  # nothing yet: every example needs a token
    for b in example.encode():
        assert b in allowed(mask_of(m))
        assert m.accept(b)
    assert m.is_accepting() and m.is_complete()
    assert allowed(mask_of(m)) == set(EOS)  # complete: only EOS may follow
    assert m.tokens == list(example.encode())


@pytest.mark.parametrize("kind, text, says", [
    ("json_schema", '{"type": "strin"}', "strin"),
    ("json_schema", "{not json", "key must be a string"),
    ("regex", "a(b", "unclosed group"),
    ("lark", "start: foo", 'unknown name: "foo"'),
    ("gbnf", 'root ::= "x" [0-9', "GBNF"),
    ("gbnf", "root ::= foo", "foo"),
    ("choice", [], "non-empty list"),
    ("choice", ["a", 3], "list of strings"),
    ("choice", "yes", "list of strings"),
    ("regex", ["a"], "is a string"),
    ("yaml", "x", "is not one of"),
])
def test_a_bad_grammar_carries_the_library_message(reg, kind, text, says):
    with pytest.raises(GrammarError) as e:
        reg.compile(kind, text)
    assert says in str(e.value)
    assert "<state>" not in str(e.value) and "<grammar>" not in str(e.value)


def test_no_tokenizer_means_no_grammars():
    r = GrammarRegistry(None, V, EOS)
    assert not r.supported
    with pytest.raises(GrammarsUnsupported):
        r.compile("regex", "a")


def test_a_tokenizer_llguidance_cannot_read_is_unsupported():
    r = GrammarRegistry("{not a tokenizer", V, EOS)
    with pytest.raises(GrammarsUnsupported, match=r"tokenizer\.json"):
        r.compile("regex", "a")


def test_json_whitespace_is_not_flexible_unless_the_schema_asks(reg):
    strict = reg.compile("json_schema", json.dumps({"type": "object"})).matcher()
    assert strict.accept(ord("{"))
    assert ord(" ") not in allowed(mask_of(strict)) and ord("\n") not in allowed(mask_of(strict))
    loose = reg.compile("json_schema",
                        json.dumps({"type": "object", "x-guidance": {"whitespace_flexible": True}}))
    m = loose.matcher()
    assert m.accept(ord("{")) and ord(" ") in allowed(mask_of(m))


# --------------------------------------------------------------------- EOS


def test_the_mask_allows_eos_exactly_when_the_grammar_may_end(reg):
    m = reg.compile("regex", "a+").matcher()
    assert not allowed(mask_of(m)) & EOS
    assert m.accept(ord("a"))
    assert allowed(mask_of(m)) == {ord("a")} | EOS  # may end, may go on: not complete
    assert m.is_accepting() and not m.is_complete()
    assert m.accept(257) and m.is_complete()  # EOS ends it
    assert m.accept(259)  # an eos after completion: a no-op, not a refusal
    assert not m.accept(ord("a"))


def test_ids_beyond_the_tokenizer_are_never_allowed(reg):
    m = reg.compile("regex", "(.|\n)*").matcher()
    got = allowed(mask_of(m))
    assert set(range(128)) <= got and got <= set(range(256)) | EOS  # (a lone 0x80.. starts no character)
    assert not m.accept(300) and not m.accept(256)  # unused id, bos
    assert not m.accept(V) and not m.accept(-1) and not m.accept(2**40)  # outside: no error state either
    assert not m.replay([ord("a"), V, ord("b")]) and m.tokens == [ord("a")]
    assert m.error == "" and m.accept(ord("b"))


# -------------------------------------------------------------------- walks


def test_masked_walks_give_json_the_schema_validates(reg):
    g = reg.compile("json_schema", json.dumps(SCHEMA))
    rng = np.random.default_rng(11)
    for _ in range(40):
        out, done = walk(reg, g, rng)
        assert done, out
        jsonschema.validate(json.loads(out), SCHEMA)


def test_negative_control_unmasked_walks_are_not_json(reg):
    g = reg.compile("json_schema", json.dumps(SCHEMA))
    rng = np.random.default_rng(11)
    bad = 0
    for _ in range(20):
        out, _ = walk(reg, g, rng, masked=False, max_steps=60)
        try:
            jsonschema.validate(json.loads(out), SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            bad += 1
    assert bad == 20


def test_greedy_walks_on_the_masks_complete(reg):
    g = reg.compile("json_schema", json.dumps(SCHEMA))
    rng = np.random.default_rng(5)
    for _ in range(10):
        m, out = g.matcher(), bytearray()
        bias = (3 * rng.standard_normal(V)).astype(np.float32)
        for _ in range(300):
            row = bias + rng.standard_normal(V).astype(np.float32)
            reference.apply_bitmask(row, mask_of(m))
            tok = reference.greedy(row)
            assert m.accept(tok)
            if tok in EOS:
                break
            out.append(tok)
            if m.is_complete():
                break
        assert m.is_complete(), out
        jsonschema.validate(json.loads(out), SCHEMA)


# ------------------------------------------------------------------- replay


def test_replay_equals_stepwise(reg):
    g = reg.compile("json_schema", json.dumps(SCHEMA))
    rng = np.random.default_rng(2)
    out, _ = walk(reg, g, rng)
    step = g.matcher()
    for i, tok in enumerate(out):
        if i % 5 == 0:
            again = g.matcher(out[:i])
            assert again is not None and again.tokens == step.tokens
            np.testing.assert_array_equal(mask_of(again), mask_of(step))
            assert (again.is_accepting(), again.is_complete()) == (step.is_accepting(), step.is_complete())
        assert step.accept(tok)
    assert g.matcher(out).is_complete()


def test_a_replay_the_grammar_refuses(reg):
    g = reg.compile("regex", "ab")
    assert g.matcher([ord("a"), ord("c")]) is None
    m = g.matcher()
    assert not m.replay([ord("a"), ord("c")]) and m.tokens == [ord("a")]  # the ones before it stay
    assert m.accept(ord("b")) and m.is_complete()


def test_a_refused_token_leaves_the_matcher_usable(reg):
    m = reg.compile("regex", "ab|ac").matcher()
    assert m.accept(ord("a"))
    assert not m.accept(ord("d")) and m.error == ""
    assert m.accept(ord("c")) and m.is_complete()


def test_rollback_and_rebuild_after_the_error_state(reg):
    g = reg.compile("regex", "[a-z]{4}")
    m = g.matcher([ord(c) for c in "abc"])
    assert m.rollback(2) and m.tokens == [ord("a")]
    np.testing.assert_array_equal(mask_of(m), mask_of(g.matcher([ord("a")])))
    m.replay([ord("x"), ord("y")])
    m._m.consume_token(ord("1"))  # what llguidance does to a refused consume: a permanent error
    assert m.error and not m._m.rollback(1)
    assert m.rollback(1) and m.error == "" and m.tokens == [ord(c) for c in "ax"]
    assert m.accept(ord("q")) and m.accept(ord("r")) and m.is_complete()
    assert not m.rollback(9)


def test_a_copy_is_independent(reg):
    m = reg.compile("regex", "ab|ac").matcher([ord("a")])
    c = m.copy()
    assert c.accept(ord("b")) and not m.is_complete() and m.tokens == [ord("a")]


# -------------------------------------------------------------------- masks


def _matchers_at_many_states(reg, n: int):
    g = reg.compile("json_schema", json.dumps(SCHEMA))
    rng = np.random.default_rng(8)
    out, _ = walk(reg, g, rng)
    return [g.matcher(out[:len(out) * i // n]) for i in range(n)]


def test_a_batched_fill_equals_one_by_one(reg):
    ms = _matchers_at_many_states(reg, 9)
    one = np.stack([mask_of(m) for m in ms])
    bits = reg.bitmask(12)
    rows = [11, 0, 5, 3, 7, 1, 9, 2, 4]  # any rows, any order
    assert reg.fill(list(zip(ms, rows)), bits) == []
    np.testing.assert_array_equal(bits[rows], one)
    for r in set(range(12)) - set(rows):
        assert (bits[r] == -1).all()  # rows no matcher names are untouched
    assert reg.fill([(ms[3], 0)], bits) == [] and (bits[0] == one[3]).all()  # one lane: no pool
    assert reg.fill([], bits) == []


def test_a_fill_reports_matchers_in_error(reg):
    ms = _matchers_at_many_states(reg, 4)
    ms[2]._m.consume_token(300)
    bits = reg.bitmask(4)
    assert reg.fill([(m, i) for i, m in enumerate(ms)], bits) == [2]
    assert allowed(bits[2]) <= EOS  # llguidance's mask in error: EOS only


def test_fill_checks_its_arguments(reg):
    m = reg.compile("regex", "a").matcher()
    with pytest.raises(ValueError):
        reg.fill([(m, 0)], np.zeros((1, 3), dtype=np.int64))
    with pytest.raises(ValueError):
        reg.fill([(m, 2)], reg.bitmask(2))
    with pytest.raises(ValueError):
        reg.fill([(m, 0), (m, 1)], reg.bitmask(2))  # one matcher twice: two threads on it


# ---------------------------------------------------------------- borrowing


def test_one_lane_borrows_a_grammar_at_a_time(reg):
    g = reg.compile("regex", "a")
    reg.add(5, g)
    assert 5 in reg and reg.available(5) and reg.borrower(5) is None
    assert reg.cursor(5, [ord("a")]).is_complete() and reg.cursor(5, [ord("b")]) is None
    assert reg.cursor(6) is None
    reg.borrow(5, 100)
    assert not reg.available(5) and reg.borrower(5) == 100
    with pytest.raises(KeyError):
        reg.borrow(5, 101)
    reg.give_back(5, 101)  # not its borrower: nothing
    assert reg.borrower(5) == 100
    reg.give_back(5, 100)
    assert reg.available(5)
    reg.borrow(5, 101)
    assert reg.release(5) and 5 not in reg and not reg.release(5)
    reg.give_back(5, 101)  # released meanwhile: nothing
    assert reg.handles() == []


# --------------------------------------------------------------------- ops


@pytest.fixture()
def ex(model_dir) -> Executor:
    return Executor(load(model_dir, "torch", kv_cells=256, max_batch=4), small_rings())


def op(ex, **msg):
    msg.setdefault("op_id", 9)
    return ex.op(msg)


def error_of(done) -> str:
    return msgpack.unpackb(done.payload)["error"]


def _fields(kind: str) -> dict:
    text = GOOD[kind][0]
    return {"choices": text} if kind == "choice" else {"text": text}


def test_register_and_release_every_kind(ex):
    assert ex.runtime.tokenizer_json is not None and ex.registry.grammars.supported
    handles = []
    for kind in KINDS:
        done = op(ex, op="REGISTER_GRAMMAR", kind=kind, **_fields(kind))
        assert (done.status, done.op) == (int(OpStatus.OK), int(OpKind.REGISTER_GRAMMAR)), error_of(done)
        assert done.handle > 0 and done.value >= 0  # value: compile microseconds
        assert ex.registry.grammars.get(done.handle).kind == kind
        handles.append(done.handle)
    assert len(set(handles)) == len(KINDS) and ex.registry.grammars.handles() == sorted(handles)
    bias = op(ex, op="REGISTER_LOGIT_BIAS", bias={1: 1.0})
    assert bias.handle not in handles  # one handle space
    for h in handles:
        done = op(ex, op="RELEASE_GRAMMAR", handle=h)
        assert (done.status, done.handle) == (int(OpStatus.OK), h)
        assert op(ex, op="RELEASE_GRAMMAR", handle=h).status == int(OpStatus.UnknownHandle)
    assert len(ex.registry.grammars) == 0


def test_register_through_msgpack_bytes(ex):
    done = ex.op(msgpack.packb({"op": "REGISTER_GRAMMAR", "op_id": 3, "kind": "regex", "text": "[0-9]+"}))
    assert done.status == int(OpStatus.OK) and done.op_id == 3 and done.handle in ex.registry.grammars


@pytest.mark.parametrize("msg, says", [
    (dict(kind="regex", text="a(b"), "unclosed group"),
    (dict(kind="json_schema", text='{"type": "strin"}'), "strin"),
    (dict(kind="lark", text="start: foo"), "unknown name"),
    (dict(kind="choice", choices=[]), "non-empty"),
    (dict(kind="regex"), "'text' is missing"),
    (dict(kind="choice", text="yes"), "'choices' is missing"),
    (dict(kind="regex", text=5), "expected str"),
    (dict(kind="yaml", text="x"), "is not one of"),
    (dict(text="x"), "'kind' is missing"),
])
def test_a_bad_register_is_bad_request_and_registers_nothing(ex, msg, says):
    before = (ex.registry.next_handle, ex.registry.grammars.handles(), ex.state_digest())
    done = op(ex, op="REGISTER_GRAMMAR", **msg)
    assert done.status == int(OpStatus.BadRequest) and done.handle == 0
    assert says in error_of(done)
    assert before == (ex.registry.next_handle, ex.registry.grammars.handles(), ex.state_digest())


def test_a_huge_bad_grammar_gets_a_bounded_message(ex):
    done = op(ex, op="REGISTER_GRAMMAR", kind="lark", text="start: " + "x" * 100_000)
    assert done.status == int(OpStatus.BadRequest) and len(done.payload) < 400


def test_the_grammar_table_is_bounded(ex):
    ex.registry.grammars.max_grammars = 2
    for _ in range(2):
        assert op(ex, op="REGISTER_GRAMMAR", kind="regex", text="a").status == int(OpStatus.OK)
    done = op(ex, op="REGISTER_GRAMMAR", kind="regex", text="a")
    assert done.status == int(OpStatus.Capacity)


def test_release_checks_its_handle(ex):
    assert op(ex, op="RELEASE_GRAMMAR", handle=77).status == int(OpStatus.UnknownHandle)
    assert op(ex, op="RELEASE_GRAMMAR", handle=0).status == int(OpStatus.BadRequest)
    assert op(ex, op="RELEASE_GRAMMAR").status == int(OpStatus.BadRequest)


def test_release_while_borrowed_unregisters_and_the_lane_keeps_its_matcher(ex):
    h = op(ex, op="REGISTER_GRAMMAR", kind="regex", text="ab").handle
    m = ex.registry.grammars.cursor(h, [ord("a")])
    ex.registry.grammars.borrow(h, 1)
    assert op(ex, op="RELEASE_GRAMMAR", handle=h).status == int(OpStatus.OK)
    assert h not in ex.registry.grammars and not ex.registry.grammars.available(h)
    assert m.accept(ord("b")) and m.is_complete()


def test_registering_changes_the_state_digest(ex):
    d0 = ex.state_digest()
    h = op(ex, op="REGISTER_GRAMMAR", kind="regex", text="a").handle
    d1 = ex.state_digest()
    ex.registry.grammars.borrow(h, 4)
    assert len({d0, d1, ex.state_digest()}) == 3


def test_without_a_tokenizer_grammars_are_unsupported(model_dir, tmp_path):
    bare = write_tiny(tmp_path / "bare", seed=3, tokenizer=False)
    for rt in (fake(), load(bare, "torch", kv_cells=64)):
        assert rt.tokenizer_json is None
        e = Executor(rt, small_rings())
        done = op(e, op="REGISTER_GRAMMAR", kind="regex", text="a")
        assert done.status == int(OpStatus.Unsupported) and "tokenizer" in error_of(done)
