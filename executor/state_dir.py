"""The one folder an op's `path` may name (EXPORT_ENTRY writes there,
IMPORT_STATE reads there).

A planner is not trusted with the daemon's file system: a path is a name
under the state directory (an absolute path must lie inside it), walked one
component at a time with O_NOFOLLOW from the directory's own descriptor, so
no `..`, symlink or rename race leads out of it. Only regular files are
read or written; opens never block (a FIFO is refused, not waited on);
reads stop at a cap whatever st_size says (/dev/zero reports 0). A write
goes to a temporary file first and is linked under its name only once it
is whole: a new name never replaces an existing one unless the op says
`overwrite` (then by a rename). What the directory holds is bounded
(max_bytes): exports cannot fill the file system under it.
"""

from __future__ import annotations

import itertools
import os
import stat

from superfluid.abi import OpStatus
from superfluid.executor.op_fields import OpError, echo
from superfluid.rings.liveness import pid_alive

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symlink"))
_CHUNK = 1 << 20
_TMP = ".sf-write."  # + pid + "." + n: a write not yet linked under its name


def _bad(path: object, why: str) -> OpError:
    return OpError(OpStatus.BadRequest, f"field 'path': {echo(path)} {why}")


def _kind(mode: int) -> str | None:
    """What a file that is not a regular file is, in words; None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


class StateDir:
    """The state directory at `root`, holding at most `max_bytes` (None: no limit).

    The directory is opened per op: one removed meanwhile makes the op a
    BadRequest, not a failure of the worker."""

    def __init__(self, root: str | os.PathLike[str], max_bytes: int | None = None):
        self.given = os.path.abspath(root)  # as configured (its parents may be symlinks)
        self.root = os.path.realpath(root)
        self.max_bytes = max_bytes
        self._seq = itertools.count()
        self._sweep()

    def _sweep(self) -> None:
        """Remove the temporary files of writers that died (a kill mid-export)."""
        try:
            names = os.listdir(self.root)
        except OSError:
            return
        for name in names:
            pid = name[len(_TMP):].split(".", 1)[0]
            if name.startswith(_TMP) and pid.isdigit() and not pid_alive(int(pid)):
                try:
                    os.unlink(os.path.join(self.root, name))
                except OSError:
                    pass

    def check(self, path: object) -> list[str]:
        """The components of `path` under the root; BadRequest for a path that is not one (no I/O)."""
        if not isinstance(path, str) or not path:
            raise OpError(OpStatus.BadRequest, "field 'path': expected a file name in the state directory")
        try:
            path.encode()
        except UnicodeEncodeError:
            raise _bad(path, "is not valid UTF-8") from None
        if "\0" in path:
            raise _bad(path, "holds a NUL byte")
        rel = path
        if os.path.isabs(path):
            inside = [r for r in (self.root, self.given) if path.startswith(r + os.sep) or path == r]
            if not inside:
                raise _bad(path, f"is outside the state directory {self.root}")
            rel = path[len(inside[0]) + 1:]
        if path.endswith("/"):
            raise _bad(path, "names a folder, not a file")
        parts = [p for p in rel.split("/") if p]
        if not parts:
            raise _bad(path, "names the state directory itself, not a file in it")
        if any(p in (".", "..") for p in parts):
            raise _bad(path, "may not hold '.' or '..': it must stay inside the state directory")
        if parts[-1].startswith(_TMP):
            raise _bad(path, f"names a write in progress ({_TMP}*)")
        return parts

    def _open_root(self, path: object) -> int:
        try:
            return os.open(self.root, _DIR)
        except OSError as err:
            raise _bad(path, f"cannot be reached: the state directory {self.root} cannot be opened "
                             f"({err.strerror})") from None

    def _walk(self, path: object) -> tuple[int, str]:
        """(a descriptor of the file's folder, the file's name): the caller closes the descriptor."""
        parts = self.check(path)
        fd = self._open_root(path)
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
            chunks: list[bytes] = []
            size = 0
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
        """Write `data` to a regular file at `path` (mode 0600): a new one, or
        with `overwrite` an existing regular file replaced whole."""
        dir_fd, name = self._walk(path)
        try:
            old = self._existing(path, dir_fd, name, overwrite)
            self._within_limit(path, len(data) - old)
            tmp = self._write_tmp(path, dir_fd, data)
            try:
                if overwrite:
                    os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                else:
                    os.link(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
            except FileExistsError:
                raise _bad(path, "exists: give 'overwrite': true to replace it") from None
            except OSError as err:
                raise _bad(path, f"cannot be written: {err.strerror}") from None
            finally:
                try:
                    os.unlink(tmp, dir_fd=dir_fd)
                except FileNotFoundError:
                    pass  # renamed over the name
        finally:
            os.close(dir_fd)

    def _existing(self, path: object, dir_fd: int, name: str, overwrite: bool) -> int:
        """The size of what `name` holds now (0 if nothing); BadRequest where a write may not go."""
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return 0
        except OSError as err:
            raise _bad(path, f"cannot be written: {err.strerror}") from None
        what = _kind(st.st_mode)
        if what:
            raise _bad(path, f"is {what}: only a regular file is " + ("replaced" if overwrite else "written"))
        if not overwrite:
            raise _bad(path, "exists: give 'overwrite': true to replace it")
        return st.st_size

    def _within_limit(self, path: object, grows: int) -> None:
        if self.max_bytes is None or grows <= 0:
            return
        held = self.held_bytes()
        if held + grows > self.max_bytes:
            raise _bad(path, f"would take {grows} bytes more; the state directory holds {held} of the "
                             f"{self.max_bytes} it may (remove exports, or serve --state-dir-bytes)")

    def held_bytes(self) -> int:
        """The bytes of the regular files under the root (symlinks not followed)."""
        total, stack = 0, [self.root]
        while stack:
            try:
                with os.scandir(stack.pop()) as it:
                    for e in it:
                        if e.is_dir(follow_symlinks=False):
                            stack.append(e.path)
                        elif e.is_file(follow_symlinks=False):
                            total += e.stat(follow_symlinks=False).st_size
            except OSError:
                continue
        return total

    def _write_tmp(self, path: object, dir_fd: int, data: bytes) -> str:
        tmp = f"{_TMP}{os.getpid()}.{next(self._seq)}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
        except OSError as err:
            raise _bad(path, f"cannot be written: {err.strerror}") from None
        try:
            _write_all(fd, data)
        except OSError as err:
            os.unlink(tmp, dir_fd=dir_fd)
            raise _bad(path, f"cannot be written: {err.strerror}") from None
        finally:
            os.close(fd)
        return tmp

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
