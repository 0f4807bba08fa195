"""A checkpoint directory's files as read: config.json's raw object, its
model_type, the error a config.json that cannot be served raises (ConfigError)
and the kinds its values are checked as, and the rule every file of a
checkpoint is read under: a
regular file (symlinks followed: the Hugging Face cache is made of them),
never a FIFO or a device, which would block a reader or never end. No
torch here: the daemon reads these before any worker starts."""

from __future__ import annotations

import json
import os
import stat
from typing import Any


class ConfigError(ValueError):
    """A config that cannot be served; names the field and the file."""

    def __init__(self, reason: str, *, field: str | None = None, source: str | None = None):
        self.reason = reason
        self.field = field
        self.source = source
        where = ": ".join(p for p in (source, f"field {field!r}" if field else None) if p)
        super().__init__(f"{where}: {reason}" if where else reason)


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class NotRegular(ValueError):
    """A checkpoint's file that is a FIFO, a device, a directory or a socket."""


def regular_file(path: str | os.PathLike) -> None:
    """NotRegular unless `path` is a regular file; OSError (missing, a symlink loop) as os.stat raises it."""
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")
        raise NotRegular(f"{os.fspath(path)}: {kind}, not a regular file")


def read_text(path: str | os.PathLike) -> str:
    """A regular file's text (UTF-8), opened without blocking: a FIFO is refused, not waited on."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with open(fd, encoding="utf-8", closefd=True) as f:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            regular_file(path)  # names what it is
            raise NotRegular(f"{os.fspath(path)}: not a regular file")
        return f.read()


def raw_config(path: str) -> dict:
    """config.json of checkpoint `path` as read; ValueError (or OSError) when it is not a JSON object."""
    raw = json.loads(read_text(os.path.join(path, "config.json")))
    if not isinstance(raw, dict):
        raise ValueError(f"{path}/config.json: not a JSON object")
    return raw


def model_type(path: str) -> str | None:
    """config.json's model_type (None where it cannot be read: the loader then says what is wrong)."""
    try:
        kind = raw_config(path).get("model_type")
    except (OSError, ValueError):
        return None
    return kind if isinstance(kind, str) else None
