"""A byte-level BPE (32k by default) trained here from generated text: the
vocabulary a grammar benchmark needs (a mask's cost grows with the vocabulary),
with nothing downloaded.

`train_bpe` generates a corpus from a seed (word-like strings with a Zipf
spread, sentences, JSON documents, code-like lines), trains the `tokenizers`
BPE on it, and renumbers the result the way engine.tiny lays its tokenizer
out: ids 0..255 are the bytes, SPECIAL_TOKENS follow, then the merges in the
order they were learnt. So it drops into a write_tiny checkpoint of that
vocabulary size (eos 257 and 259 mean the same). The same seed gives the same
tokenizer.json byte for byte. `bpe_tokenizer_json` caches it under
$SUPERFLUID_CACHE, as engine.tiny.default_model_dir caches the demo model.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import tempfile
from pathlib import Path

from superfluid.engine.tiny import SPECIAL_TOKENS, _bytes_to_unicode

_FORMAT = 1  # bump when what train_bpe writes for given arguments changes (the cache key)
_SYLLABLES = [c + v for c in ("", *"bcdfghklmnprstvwz", "ch", "sh", "th", "st", "pr", "tr")
              for v in ("a", "e", "i", "o", "u", "ai", "ou", "er", "an", "on", "in")]


def _corpus(seed: int, n_words: int, n_lines: int) -> list[str]:
    """Lines of generated text; a pure function of its arguments (random.Random's
    draws are the same on every platform)."""
    r = random.Random(seed)
    words = ["".join(r.choice(_SYLLABLES) for _ in range(r.randint(1, 4))) for _ in range(n_words)]
    cdf = list(itertools.accumulate(1.0 / k for k in range(1, n_words + 1)))  # Zipf

    def pick(n: int) -> list[str]:
        return r.choices(words, cum_weights=cdf, k=n)

    lines = []
    for i in range(n_lines):
        kind = i % 4
        if kind == 0:  # a sentence
            lines.append(" ".join(pick(r.randint(4, 15))).capitalize() + r.choice(".?!,"))
        elif kind == 1:  # a JSON document, compact or spaced
            keys = pick(r.randint(1, 5))
            vals = [r.choice((json.dumps(" ".join(pick(2))), str(r.randint(-999, 99999)),
                              f"{r.gauss(0, 100):.3f}", "true", "false", "null", "[]")) for _ in keys]
            sep = (",", ":") if r.random() < 0.5 else (", ", ": ")
            lines.append("{" + sep[0].join(f'"{k}"{sep[1]}{v}' for k, v in zip(keys, vals)) + "}")
        elif kind == 2:  # code-like
            a, b, c = pick(3)
            lines.append(r.choice((f"def {a}_{b}({c}):", f"    return {a}.{b}({c}, {r.randint(0, 63)})",
                                   f"let {a} = {b}[{c}] + {r.randint(0, 9)};", f"# {a} {b} {c}")))
        else:  # capitalised names and dates
            a, b = pick(2)
            lines.append(f"{a.title()} {b.title()}, {r.randint(1900, 2099)}-{r.randint(1, 12):02d}-"
                         f"{r.randint(1, 28):02d}")
    return lines


def train_bpe(vocab_size: int = 32000, seed: int = 0) -> str:
    """The tokenizer.json text of a byte-level BPE of exactly vocab_size tokens."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as e:  # pragma: no cover - depends on the install
        raise RuntimeError("training a BPE needs `tokenizers` (pip install tokenizers)") from e
    n_special = len(SPECIAL_TOKENS)
    if vocab_size < 256 + n_special:
        raise ValueError(f"vocab_size must be >= {256 + n_special}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    lines = _corpus(seed, n_words=max(2000, vocab_size * 2), n_lines=max(4000, vocab_size * 2))
    tok.train_from_iterator(lines, trainer=trainer)
    doc = json.loads(tok.to_str())
    old = doc["model"]["vocab"]
    if len(old) != vocab_size:
        raise RuntimeError(f"the corpus gave {len(old)} tokens, not {vocab_size}")
    # engine.tiny's layout: the bytes, the specials, then the merges as learnt.
    b2u = _bytes_to_unicode()
    new = {b2u[b]: b for b in range(256)}
    new.update({s: 256 + i for i, s in enumerate(SPECIAL_TOKENS)})
    for t in sorted((t for t in old if t not in new), key=old.__getitem__):
        new[t] = len(new)
    doc["model"]["vocab"] = new
    for a in doc["added_tokens"]:
        a["id"] = new[a["content"]]
    return json.dumps(doc, ensure_ascii=False, sort_keys=True)


def bpe_tokenizer_json(vocab_size: int = 32000, seed: int = 0) -> str:
    """train_bpe's text, trained once into $SUPERFLUID_CACHE (default
    ~/.cache/superfluid) and read from there after."""
    key = json.dumps({"format": _FORMAT, "vocab_size": vocab_size, "seed": seed}, sort_keys=True)
    root = Path(os.environ.get("SUPERFLUID_CACHE") or Path.home() / ".cache" / "superfluid")
    final = root / f"bpe-{vocab_size}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    if final.is_file():
        return final.read_text(encoding="utf-8")
    text = train_bpe(vocab_size, seed)
    root.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".bpe-", dir=root)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, final)  # a reader never sees half a file; racing writers agree
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return text
