"""The one folder an op's `path` may name (EXPORT_ENTRY writes there,
IMPORT_STATE reads there).

A planner is not trusted with the daemon's file system: a path is a name
under the state directory (an absolute path must lie inside it), walked one
component at a time with O_NOFOLLOW from the directory's own descriptor, so
no `..`, symlink or rename race leads out of it. Only regular files are
read or written; opens never block (a FIFO is refused, not waited on);
reads stop at a cap whatever st_size says (/dev/zero reports 0); a write
makes a new file and replaces an existing one only when the op says
`overwrite`, and then by renaming a complete new file over it.
"""

from __future__ import annotations

import os
import stat

from superfluid.abi import OpStatus
from superfluid.executor.op_fields import OpError, echo

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symlink"))
_CHUNK = 1 << 20


def _bad(path: str, why: str) -> OpError:
    return OpError(OpStatus.BadRequest, f"field 'path': {echo(path)} {why}")


def _kind(mode: int) -> str | None:
    """What a file that is not a regular file is, in words; None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


class StateDir:
    """The state directory at `root` (it must exist: the daemon makes it)."""

    def __init__(self, root: str | os.PathLike):
        self.root = os.path.realpath(root)
        fd = os.open(self.root, _DIR)  # a missing or non-directory root fails here, at start-up
        os.close(fd)

    def check(self, path: object) -> list[str]:
        """The components of `path` under the root; BadRequest for a path that is not one (no I/O)."""
        if not isinstance(path, str) or not path:
            raise OpError(OpStatus.BadRequest, "field 'path': expected a file name in the state directory")
        if "\0" in path:
            raise _bad(path, "holds a NUL byte")
        rel = path
        if os.path.isabs(path):
            if not path.startswith(self.root + os.sep):
                raise _bad(path, f"is outside the state directory {self.root}")
            rel = path[len(self.root) + 1:]
        parts = [p for p in rel.split("/") if p]
        if not parts:
            raise _bad(path, "names no file")
        if any(p in (".", "..") for p in parts):
            raise _bad(path, "may not hold '.' or '..': it must stay inside the state directory")
        return parts

    def _walk(self, path: object) -> tuple[int, str]:
        """(a descriptor of the file's folder, the file's name): the caller closes the descriptor."""
        parts = self.check(path)
        fd = os.open(self.root, _DIR)
        try:
            for i, part in enumerate(parts[:-1]):
                try:
                    sub = os.open(part, _DIR, dir_fd=fd)
                except OSError as err:
                    where = "/".join(parts[:i + 1])
                    raise _bad(path, f"cannot be reached: {where!r} is not a folder of the state directory "
                                     f"({err.strerror})") from None
                os.close(fd)
                fd = sub
        except BaseException:
            os.close(fd)
            raise
        return fd, parts[-1]

    def read(self, path: object, cap: int) -> bytes:
        """The whole regular file at `path`, at most `cap` bytes (more: BadRequest)."""
        dir_fd, name = self._walk(path)
        try:
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
            except OSError as err:
                raise self._open_error(path, name, dir_fd, err, "read") from None
        finally:
            os.close(dir_fd)
        try:
            what = _kind(os.fstat(fd).st_mode)
            if what:
                raise _bad(path, f"is {what}, not a regular file")
            chunks, size = [], 0
            while True:
                chunk = os.read(fd, min(_CHUNK, cap + 1 - size))
                if not chunk:
                    return b"".join(chunks)
                chunks.append(chunk)
                size += len(chunk)
                if size > cap:
                    raise _bad(path, f"holds more than {cap} bytes, the most an import can be")
        except OSError as err:
            raise _bad(path, f"cannot be read: {err.strerror}") from None
        finally:
            os.close(fd)

    def write(self, path: object, data: bytes, *, overwrite: bool = False) -> None:
        """Write `data` to a new regular file at `path` (mode 0600); an existing
        one only with `overwrite`, replaced whole by a rename."""
        dir_fd, name = self._walk(path)
        try:
            if overwrite:
                self._replace(path, dir_fd, name, data)
            else:
                self._create(path, dir_fd, name, data)
        finally:
            os.close(dir_fd)

    def _create(self, path: object, dir_fd: int, name: str, data: bytes) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(name, flags, 0o600, dir_fd=dir_fd)
        except FileExistsError:
            raise _bad(path, "exists: give 'overwrite': true to replace it") from None
        except OSError as err:
            raise self._open_error(path, name, dir_fd, err, "written") from None
        try:
            _write_all(fd, data)
        except OSError as err:
            os.unlink(name, dir_fd=dir_fd)  # no partial file is left behind
            raise _bad(path, f"cannot be written: {err.strerror}") from None
        finally:
            os.close(fd)

    def _replace(self, path: object, dir_fd: int, name: str, data: bytes) -> None:
        try:
            what = _kind(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
        except FileNotFoundError:
            what = None
        except OSError as err:
            raise _bad(path, f"cannot be written: {err.strerror}") from None
        if what:
            raise _bad(path, f"is {what}: only a regular file is replaced")
        tmp = f".{name[:200]}.{os.getpid()}.tmp"
        try:
            os.unlink(tmp, dir_fd=dir_fd)  # a leftover of a write that died
        except FileNotFoundError:
            pass
        except OSError as err:
            raise _bad(path, f"cannot be written: {err.strerror}") from None
        self._create(path, dir_fd, tmp, data)
        try:
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except OSError as err:
            os.unlink(tmp, dir_fd=dir_fd)
            raise _bad(path, f"cannot be written: {err.strerror}") from None

    @staticmethod
    def _open_error(path: object, name: str, dir_fd: int, err: OSError, doing: str) -> OpError:
        try:  # O_NOFOLLOW fails a symlink with ELOOP: say what it is
            what = _kind(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
        except OSError:
            what = None
        if what:
            return _bad(path, f"is {what}, not a regular file")
        return _bad(path, f"cannot be {doing}: {err.strerror}")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
