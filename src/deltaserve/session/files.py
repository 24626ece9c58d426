"""Files in a directory a neighbour may write to: opened safely, authenticated, deleted only when they are ours.

The state store, the stored responses and the saved chats keep files in a directory that other processes may also
reach (a shared --state-dir, a directory somebody else can write). What this module guarantees for them:

- **Opened once, checked on the descriptor.** `open_checked` opens with O_NOFOLLOW (a symlink is refused, never
  followed), O_NONBLOCK (a FIFO opens at once instead of blocking the thread until somebody writes into it) and
  O_CLOEXEC, then checks the *descriptor* with fstat: a regular file, owned by this user, readable by nobody else,
  within a size bound. Checking a name and then opening it loses a race to a neighbour who swaps the file between
  the two; everything after the open reads the descriptor, never the name.
- **Private directories.** `private_dir` creates a directory 0700; an existing one that others may read is
  tightened to 0700 with a notice, and one owned by another user is refused.
- **A key per directory.** `directory_key` reads the directory's secret (32 random bytes in `.deltaserve-key`,
  0600), creating it once. Files written there carry an HMAC under it: a neighbour who can write the directory but
  not read the key cannot forge or relabel what the files say (a CRC finds accidents, not forgeries).
- **Our own marker.** A temporary file's name carries a tag derived from the key (`tmp_name`): at start only
  temporaries that carry it (and whose writer is gone) are removed; a neighbour's file, whatever its name, is left
  alone. `owner_tag` is the same idea for the files themselves (written into their headers).
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import re
import socket
import stat
import threading
import time
from pathlib import Path
from typing import Callable

from deltaserve.errors import DeltaserveError

KEY_NAME = ".deltaserve-key"
KEY_BYTES = 32
READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
WRITE_FLAGS = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
STALE_TMP_S = 600.0  # a temporary file of ours this old is a crashed write, whoever wrote it
HOST = re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:32] or "host"
_TMP = re.compile(r"^\.tmp-(?P<host>[A-Za-z0-9]+)-(?P<pid>\d+)-(?P<tid>\d+)-(?P<tag>[0-9a-f]{16})-(?P<final>.+)$")


class UnsafeFile(DeltaserveError):
    """A file that is not opened: `kind` says why ("missing", "symlink", "fifo", "directory", "special", "foreign
    owner", "open mode", "too large", "unreadable")."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


def _describe(mode: int) -> tuple[str, str]:
    if stat.S_ISLNK(mode):
        return "symlink", "a symlink"
    if stat.S_ISDIR(mode):
        return "directory", "a directory"
    if stat.S_ISFIFO(mode):
        return "fifo", "a FIFO"
    if stat.S_ISSOCK(mode):
        return "special", "a socket"
    return "special", "not a regular file"


def check_descriptor(fd: int, name: str, max_bytes: int | None = None, private: bool = True) -> os.stat_result:
    """fstat of an open descriptor, refused (UnsafeFile) unless a regular file of this user's, readable by nobody
    else (`private`), of at most `max_bytes`."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        kind, what = _describe(st.st_mode)
        raise UnsafeFile(f"{name} is {what}, not a file this server wrote", kind)
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        raise UnsafeFile(f"{name} belongs to another user (uid {st.st_uid}), not to this server's", "foreign owner")
    if private and stat.S_IMODE(st.st_mode) & 0o077:
        raise UnsafeFile(f"{name} is readable or writable by others (mode {stat.S_IMODE(st.st_mode):04o}); this "
                         "server writes its files 0600", "open mode")
    if max_bytes is not None and st.st_size > max_bytes:
        raise UnsafeFile(f"{name} holds {st.st_size} bytes, more than the {max_bytes} it can hold", "too large")
    return st


def open_checked(path: str | os.PathLike, max_bytes: int | None = None, private: bool = True) -> tuple[int, os.stat_result]:
    """(descriptor, its stat): `path` opened without following a symlink and without blocking on a FIFO, then
    checked on the descriptor (`check_descriptor`). The caller closes the descriptor."""
    name = Path(path).name
    try:
        fd = os.open(path, READ_FLAGS)
    except FileNotFoundError:
        raise UnsafeFile(f"{name} does not exist", "missing") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeFile(f"{name} is a symlink: never followed", "symlink") from None
        if e.errno in (errno.ENXIO, errno.EISDIR):
            raise UnsafeFile(f"{name} is not a regular file", "special") from None
        raise UnsafeFile(f"{name} cannot be opened ({e.strerror})", "unreadable") from None
    try:
        return fd, check_descriptor(fd, name, max_bytes, private)
    except BaseException:
        os.close(fd)
        raise


def read_all(fd: int, size: int, offset: int = 0) -> bytearray:
    """`size` bytes of a descriptor from `offset` (pread: the descriptor's position is not used)."""
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = os.preadv(fd, [view[got:]], offset + got) if hasattr(os, "preadv") else _pread_into(fd, view[got:], offset + got)
        if n == 0:
            raise UnsafeFile(f"the file ended after {got} of {size} bytes", "unreadable")
        got += n
    return buf


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    data = os.pread(fd, len(view), offset)
    view[:len(data)] = data
    return len(data)


def read_checked(path: str | os.PathLike, max_bytes: int, private: bool = True) -> bytes:
    """A whole small file's bytes, read through `open_checked`."""
    fd, st = open_checked(path, max_bytes, private)
    try:
        return bytes(read_all(fd, st.st_size))
    finally:
        os.close(fd)


# -- directories and their keys ---------------------------------------------------------------------------------

def private_dir(path: str | os.PathLike, what: str, say: Callable[[str], None] | None = None) -> Path:
    """`path` as a directory of this user's that nobody else may read: created 0700 (its parents as the umask
    says), tightened to 0700 with a notice where it exists and others may read it; one owned by another user, or not
    a directory, is refused (DeltaserveError naming `what`, e.g. '--state-dir')."""
    path = Path(path)
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.stat(path)
    except OSError as e:
        raise DeltaserveError(f"{what} {path}: cannot create it ({e.strerror})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise DeltaserveError(f"{what} {path}: not a directory")
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        raise DeltaserveError(f"{what} {path}: belongs to another user (uid {st.st_uid}); the conversations kept "
                              "there would be theirs to read and forge: use a directory of your own")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        try:
            os.chmod(path, 0o700)
        except OSError as e:
            raise DeltaserveError(f"{what} {path}: others may read it (mode {mode:04o}) and it cannot be made "
                                  f"private ({e.strerror})") from None
        if say is not None:
            say(f"[deltaserve] {what} {path} was readable by others (mode {mode:04o}): now 0700 (conversations are "
                "the user's alone)")
    if not os.access(path, os.W_OK):
        raise DeltaserveError(f"{what} {path}: not writable by this user")
    return path


_KEYS: dict[str, bytes] = {}
_KEYS_LOCK = threading.Lock()


def directory_key(directory: str | os.PathLike) -> bytes:
    """The directory's secret (created once, 0600, beside its files); cached per directory for the process. A key
    file that is not this user's private regular file of 32 bytes is refused (DeltaserveError): its files cannot be
    trusted, nor written so that they could be."""
    directory = Path(directory)
    cache = os.path.realpath(directory)
    with _KEYS_LOCK:
        if cache in _KEYS:
            return _KEYS[cache]
        path = directory / KEY_NAME
        for _ in range(3):
            try:
                key = read_checked(path, KEY_BYTES)
            except UnsafeFile as e:
                if e.kind != "missing":
                    raise DeltaserveError(f"{path}: the directory's key is unusable ({e}); remove it to start "
                                          "afresh (the files signed with it will be refused)") from None
            else:
                if len(key) != KEY_BYTES:
                    raise DeltaserveError(f"{path}: the directory's key holds {len(key)} bytes, not {KEY_BYTES} (a "
                                          "write cut short?); remove it to start afresh")
                _KEYS[cache] = key
                return key
            key = os.urandom(KEY_BYTES)
            tmp = directory / f".tmp-key-{HOST}-{os.getpid()}-{threading.get_ident()}"
            try:
                fd = os.open(tmp, WRITE_FLAGS, 0o600)
                try:
                    os.write(fd, key)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.link(tmp, path)  # fails if another process made the key first: then its key is read
            except FileExistsError:
                pass
            except OSError as e:
                raise DeltaserveError(f"{directory}: cannot write its key ({e.strerror})") from None
            finally:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
        raise DeltaserveError(f"{path}: the directory's key could not be read or made")


def owner_tag(key: bytes) -> str:
    """A tag only a holder of the key writes: a file whose header carries it was written by this server (or a
    replica sharing its directory and key), so a damaged one of them may be removed."""
    return hmac.new(key, b"deltaserve-owner", hashlib.sha256).hexdigest()[:32]


def mac(key: bytes) -> "hmac.HMAC":
    return hmac.new(key, digestmod=hashlib.sha256)


# -- temporary files ----------------------------------------------------------------------------------------------

def _tmp_tag(key: bytes, final: str) -> str:
    return hmac.new(key, b"deltaserve-tmp:" + final.encode("utf-8", "surrogateescape"), hashlib.sha256).hexdigest()[:16]


def tmp_name(key: bytes, final: str, host: str | None = None, pid: int | None = None, tid: int | None = None) -> str:
    """The temporary name a write of `final` uses: this host, process and thread (unless given), and the key's tag
    for `final`."""
    host = host or HOST
    pid = os.getpid() if pid is None else pid
    tid = threading.get_ident() if tid is None else tid
    return f".tmp-{host}-{pid}-{tid}-{_tmp_tag(key, final)}-{final}"


def stale_tmp(directory: Path, name: str, key: bytes, now: float | None = None) -> bool:
    """Whether `name` is a temporary file of ours (it carries the key's tag) that a crashed write left: older than
    STALE_TMP_S, or named by this host and a pid that no longer runs. Anything else, whoever wrote it, is not."""
    m = _TMP.match(name)
    if m is None or not hmac.compare_digest(m["tag"], _tmp_tag(key, m["final"])):
        return False
    try:
        st = os.lstat(directory / name)
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode) or (hasattr(os, "geteuid") and st.st_uid != os.geteuid()):
        return False
    if (now if now is not None else time.time()) - st.st_mtime > STALE_TMP_S:
        return True
    if m["host"] != HOST:
        return False
    try:
        os.kill(int(m["pid"]), 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def remove_stale_tmps(directory: Path, key: bytes, suffix: str) -> int:
    """Remove the temporaries of ours (`stale_tmp`) ending in `suffix` in `directory`; how many."""
    n = 0
    now = time.time()
    try:
        names = [e.name for e in os.scandir(directory) if e.name.startswith(".tmp-") and e.name.endswith(suffix)]
    except OSError:
        return 0
    for name in names:
        if stale_tmp(directory, name, key, now):
            try:
                os.unlink(directory / name)
                n += 1
            except OSError:
                pass
    return n


def write_atomic(path: Path, data: bytes | memoryview, key: bytes) -> int:
    """`data` to `path`, atomically: written 0600 under a temporary name of ours (created exclusively, never through
    a symlink), fsynced, renamed. The bytes written."""
    path = Path(path)
    tmp = path.with_name(tmp_name(key, path.name))
    try:
        fd = os.open(tmp, WRITE_FLAGS, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return len(data)


def unlink_ours(path: Path) -> bool:
    """Remove `path` if it is a regular file of this user's (a symlink, a directory or another user's file in its
    place is left alone); whether it was removed."""
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or (hasattr(os, "geteuid") and st.st_uid != os.geteuid()):
            return False
        os.unlink(path)
        return True
    except OSError:
        return False
