"""The flight recorder's files (docs/recorder.md): framing, kinds, names,
the header, and what identifies a model.

A worker's record is a folder `DIR/worker-<i>/` of segment files
`<seq:08d>.sfrec`, oldest first. A file is its magic, then frames:

    u32 body length | u32 crc32 of the body | body = u8 kind + msgpack

The first frame of every file is a HEADER (a msgpack map: format and ABI
versions, the worker's argv and the files its options name, the model's
identity, the epoch, where the data rings stood, ...): a file is readable
from its own start. A frame that runs past the end of the file or fails its
crc ends what is read of it (a worker killed in a write leaves at most one
such frame, at the end).
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import msgpack

from superfluid.abi import codec

MAGIC = b"SFREC\x00\x01\n"
FORMAT_VERSION = 1
FRAME = struct.Struct("<II")
SUFFIX = ".sfrec"
_NAME = re.compile(r"^(\d{8})\.sfrec$")
WORKER_DIR = "worker-{}"
_WORKER_RE = re.compile(r"^worker-(\d+)$")

# Record kinds (the body's first byte).
HEADER = 1  # map: see header() below
SESSION = 2  # [session id]: the worker began serving a new planner session
OP = 3  # [payload]: an op, as the executor got it, before it ran
OP_DONE = 4  # [completion, reads]: what it answered
PLAN = 5  # [message, try_empty, prompts]: a plan, before its tick ran
DONE = 6  # [path, outcome, reads, tokens, logits]: the tick's outcome
FLUSH = 7  # []: the worker took the pending op completions out without a tick
KINDS = {HEADER: "HEADER", SESSION: "SESSION", OP: "OP", OP_DONE: "OP_DONE", PLAN: "PLAN", DONE: "DONE",
         FLUSH: "FLUSH"}

# Where a plan went (DONE's path): tick_empty answered it; decode_plan and the
# tick; decode_plan refused it.
PATH_EMPTY, PATH_TICK, PATH_UNDECODED = 0, 1, 2

# Worker options whose value names a file that shapes what the worker does:
# the header carries the file's bytes, and a replay serves them from there.
FILE_OPTIONS: tuple[str, ...] = ("--fault-schedule",)

# Model files up to this size are hashed whole; a .safetensors file is
# identified by its size, its header and a sample of its tensor bytes.
_HASH_WHOLE_MAX = 64 << 20
_SAMPLES, _SAMPLE = 16, 4096


def _plain(v: Any) -> Any:
    """What msgpack cannot take as it is (a numpy scalar or array)."""
    if hasattr(v, "tolist"):
        return v.tolist()
    raise TypeError(f"cannot record a {type(v).__name__}")


_packer = msgpack.Packer(use_bin_type=True, default=_plain)


def pack(obj: Any) -> bytes:
    return _packer.pack(obj)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def message_bytes(slot: codec.Message) -> bytes:
    """The plan message in a slot, copied (the whole slot when its header is bad)."""
    try:
        return codec.copy_message(slot)[1]
    except codec.CodecError:
        return bytes(slot)


def frame(kind: int, payload: bytes) -> bytes:
    body = bytes((kind,)) + payload
    return FRAME.pack(len(body), zlib.crc32(body)) + body


@dataclass
class Frame:
    kind: int
    body: Any  # the unpacked payload
    offset: int  # of the frame in its file


@dataclass
class FileRead:
    path: str
    frames: list[Frame]
    torn_at: int | None  # where an unreadable tail starts (None: the file ends on a frame)
    torn_bytes: int = 0


def read_file(path: str) -> FileRead:
    """Every whole frame of a segment file; ValueError when it is not one."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < len(MAGIC) and MAGIC.startswith(data):  # killed as it made the file
        return FileRead(path, [], 0 if data else None, len(data))
    if not data.startswith(MAGIC):
        raise ValueError(f"{path}: not a superfluid record file (magic {data[:len(MAGIC)]!r})")
    frames: list[Frame] = []
    at = len(MAGIC)
    while at < len(data):
        if at + FRAME.size > len(data):
            break
        n, crc = FRAME.unpack_from(data, at)
        body = data[at + FRAME.size:at + FRAME.size + n]
        if n == 0 or len(body) < n or zlib.crc32(body) != crc:
            break
        try:
            payload = unpack(body[1:])
        except Exception:  # a crc that matched garbage: end the file here
            break
        frames.append(Frame(body[0], payload, at))
        at += FRAME.size + n
    torn = None if at >= len(data) else at
    return FileRead(path, frames, torn, 0 if torn is None else len(data) - at)


def write_file(path: str, frames: list[tuple[int, Any]]) -> None:
    """A segment file of these (kind, body) frames (tests and tools)."""
    with open(path, "wb") as f:
        f.write(MAGIC + b"".join(frame(k, pack(b)) for k, b in frames))


def segment_files(worker_dir: str) -> list[tuple[int, str]]:
    """(seq, path) of a worker folder's segment files, oldest first."""
    try:
        names = os.listdir(worker_dir)
    except FileNotFoundError:
        return []
    out = [(int(m[1]), os.path.join(worker_dir, n)) for n in names if (m := _NAME.match(n))]
    return sorted(out)


def segment_name(seq: int) -> str:
    return f"{seq:08d}{SUFFIX}"


def worker_dirs(root: str) -> list[tuple[int, str]]:
    """(index, path) of the worker folders of a record, by index."""
    out = [(int(m[1]), os.path.join(root, n)) for n in os.listdir(root) if (m := _WORKER_RE.match(n))]
    return sorted(out)


# ------------------------------------------------------------ identity


def _safetensors_id(path: str, size: int) -> str:
    """Its size, its header (every tensor's name, dtype, shape and offsets),
    and SAMPLES pieces of its tensor bytes spread evenly over the file: a
    checkpoint of other weights differs there, yet a worker's start reads a
    few KiB, not the whole file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        h.update(head + f.read(min(n, 100 << 20)))
        data = 8 + n
        span = max(0, size - data - _SAMPLE)
        for i in range(_SAMPLES):
            f.seek(data + span * i // max(1, _SAMPLES - 1))
            h.update(f.read(_SAMPLE))
    return f"size {size}, header and samples {h.hexdigest()[:32]}"


def model_identity(model: str | None) -> dict[str, str]:
    """What identifies a checkpoint folder, per file: a digest of each file's
    content (a .safetensors: its size, header and a sample of its tensor
    bytes; any other file past 64 MiB: its size). {"runtime": "fake"} for the fake runtime (model None)."""
    if model is None:
        return {"runtime": "fake"}
    out: dict[str, str] = {}
    for name in sorted(os.listdir(model)):
        p = os.path.join(model, name)
        if not os.path.isfile(p):
            continue
        size = os.path.getsize(p)
        if name.endswith(".safetensors"):
            out[name] = _safetensors_id(p, size)
        elif size <= _HASH_WHOLE_MAX:
            with open(p, "rb") as f:
                out[name] = f"sha256 {hashlib.sha256(f.read()).hexdigest()[:32]}"
        else:
            out[name] = f"size {size}"
    return out


def identity_difference(recorded: dict[str, str], here: dict[str, str]) -> str | None:
    """The first file whose identity differs, said in a line; None when equal."""
    for name in sorted(set(recorded) | set(here)):
        a, b = recorded.get(name), here.get(name)
        if a != b:
            return f"{name}: recorded {a or 'absent'}, here {b or 'absent'}"
    return None


def option_files(argv: list[str]) -> dict[str, bytes]:
    """The bytes of each file a FILE_OPTIONS option of argv names."""
    out: dict[str, bytes] = {}
    for i, a in enumerate(argv):
        opt, eq, val = a.partition("=")
        if opt in FILE_OPTIONS:
            path = val if eq else (argv[i + 1] if i + 1 < len(argv) else None)
            if path is not None:
                with open(path, "rb") as f:
                    out[opt] = f.read()
    return out

