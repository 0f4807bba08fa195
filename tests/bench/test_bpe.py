"""The locally trained byte-level BPE (superfluid/bench/bpe.py): exactly the vocabulary
asked, engine.tiny's id layout (bytes, then the specials, then merges), the
same bytes from the same seed (and others from another), text round-trips,
grammars compile over it, and the cache trains once."""

from __future__ import annotations

import json

import pytest

from superfluid.bench import bpe
from superfluid.engine.tiny import SPECIAL_TOKENS, _bytes_to_unicode
from superfluid.executor.grammar import GrammarRegistry

tokenizers = pytest.importorskip("tokenizers")

V = 3000


@pytest.fixture(scope="module")
def trained() -> str:
    return bpe.train_bpe(V, seed=1)


def test_the_layout_is_tinys(trained):
    doc = json.loads(trained)
    vocab = doc["model"]["vocab"]
    assert sorted(vocab.values()) == list(range(V))
    b2u = _bytes_to_unicode()
    assert all(vocab[b2u[b]] == b for b in range(256))
    assert [vocab[s] for s in SPECIAL_TOKENS] == list(range(256, 256 + len(SPECIAL_TOKENS)))
    added = {a["content"]: a["id"] for a in doc["added_tokens"]}
    assert added == {s: 256 + i for i, s in enumerate(SPECIAL_TOKENS)}


def test_the_same_seed_gives_the_same_tokenizer(trained):
    assert bpe.train_bpe(V, seed=1) == trained
    assert bpe.train_bpe(V, seed=2) != trained


def test_text_round_trips_and_merges_are_used(trained):
    tok = tokenizers.Tokenizer.from_str(trained)
    for s in ['{"name": "shaiter", "age": 12}', "def f(x):\n    return x", "héllo wörld ✓"]:
        ids = tok.encode(s).ids
        assert tok.decode(ids) == s
    assert len(tok.encode("the return of the value").ids) < len("the return of the value")
    assert tok.encode("<|eos|>").ids == [257]


def test_grammars_compile_over_it(trained):
    reg = GrammarRegistry(trained, V, {257})
    m = reg.compile("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                               "required": ["a"]})).matcher()
    tok = tokenizers.Tokenizer.from_str(trained)
    assert m.replay(tok.encode('{"a":42}').ids) and m.is_complete()


def test_the_cache_trains_once(tmp_path, monkeypatch):
    monkeypatch.setenv("SUPERFLUID_CACHE", str(tmp_path))
    first = bpe.bpe_tokenizer_json(500, seed=3)
    monkeypatch.setattr(bpe, "train_bpe", lambda *a: pytest.fail("trained again"))
    assert bpe.bpe_tokenizer_json(500, seed=3) == first
    assert [p.name.startswith("bpe-500-") for p in tmp_path.iterdir()] == [True]


def test_a_vocabulary_smaller_than_the_bytes_is_refused():
    with pytest.raises(ValueError):
        bpe.train_bpe(100)
