"""The identity of a local tier's directory: a random id kept in the directory itself.

The memory tier's shared-memory segments outlive the process that wrote them, and a new process finds
them by name. Names derived from the directory's path alone would hand a new job on the same path the
RAM of an old one (its directory deleted to start afresh, as :class:`~ckpt.errors.NoCheckpointError`
advises), and any local user who knows the path could create an entry at such a name first (``/dev/shm``
is world-writable). So the names derive from the path *and* an id of 128 random bits kept in the
directory (``.ckpt-id``, mode ``0600``): deleting the directory (or creating a new one at the same path)
gives it a new id, and with it segments of new names; the old ones belong to no directory any more
(:func:`ckpt.shm.orphans` finds them). Copying the directory elsewhere keeps the id but not the path,
so two directories never share segments.

The id file is created once, by whichever process of the job gets there first (a temporary file
hard-linked into place, so two processes racing agree on one id), and never rewritten.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import secrets
import stat

__all__ = ["ID_NAME", "directory_id", "directory_key"]

log = logging.getLogger(__name__)

#: the file in a local_dir holding its id
ID_NAME = ".ckpt-id"
_ID_RE = re.compile(r"^[0-9a-f]{32}\n?$")


def directory_id(local_dir: str | os.PathLike, create: bool = False) -> str | None:
    """The id of ``local_dir`` (32 hex digits), creating it when ``create`` and there is none yet.

    ``None``: the directory has no id (and ``create`` is false), or it cannot hold one (missing, not
    writable); a file at the id's name that is not a regular file of this user, or does not hold an
    id, counts as no id too (logged): nothing is ever read through a link."""
    path = os.path.join(os.fspath(local_dir), ID_NAME)
    found = _read(path)
    if found is not None or not create:
        return found
    new = secrets.token_hex(16)
    tmp = f"{path}.new-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        log.debug("%s cannot hold an id (%s): its memory tier is off", local_dir, e)
        return None
    try:
        with os.fdopen(fd, "w") as f:
            f.write(new + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # fails with EEXIST where another process put its id first: that one counts
        except FileExistsError:
            pass
        except OSError as e:
            log.debug("%s cannot hold an id (%s): its memory tier is off", local_dir, e)
            return None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return _read(path)


def _read(path: str) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        if e.errno not in (errno.ENOENT, errno.ENOTDIR):
            log.warning("%s cannot be read (%s): the directory's memory tier is off", path, e)
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size > 64:
            log.warning(
                "%s is not a directory id of this user (a regular file of at most 64 bytes owned by "
                "uid %d): the directory's memory tier is off; remove it to start a new one",
                path,
                os.getuid(),
            )
            return None
        raw = os.read(fd, 64).decode("ascii", "replace")
    finally:
        os.close(fd)
    if not _ID_RE.match(raw):
        log.warning(
            "%s does not hold a directory id: the directory's memory tier is off; remove it to start "
            "a new one",
            path,
        )
        return None
    return raw.strip()


def directory_key(local_dir: str | os.PathLike, create: bool = False) -> str | None:
    """16 hex digits naming ``local_dir`` on this node: a hash of its resolved path and its id (``None``:
    it has no id; see :func:`directory_id`)."""
    ident = directory_id(local_dir, create)
    if ident is None:
        return None
    real = os.path.realpath(os.fspath(local_dir))
    return hashlib.sha256(f"{real}\0{ident}".encode()).hexdigest()[:16]
