# The message codec's fast path (abi/sf_codec.c); packers.py builds the schema and calls it.
from typing import Any

from typing_extensions import Buffer

# (kind, offset, struct code, length, record index): one field as packers.py's _schema() lays it out
_Field = tuple[int, int, str, int, int]
# (record class, size, has a leading struct_size, fields)
_Record = tuple[type[tuple[Any, ...]], int, bool, tuple[_Field, ...]]

def setup(schema: tuple[_Record, ...], /) -> None: ...

# Bytes written, or None where codec.py's Python path must answer.
def encode_into(buf: Buffer, index: int, record: tuple[Any, ...], kind: int, session: int, /) -> int | None: ...

# The record, or None where codec.py's Python path must answer.
def decode(buf: Buffer, index: int, kind: int, /) -> tuple[Any, ...] | None: ...
