"""The tier a location names, one rule for every reader of checkpoints (the ``ckpt`` commands and
:func:`ckpt.export`).

* a path (no scheme): the local tier in that directory (a ``local_dir``);
* a ``file://`` URL of a local tier's directory (one a ``Checkpointer``'s ``local_dir`` made: it holds
  the owner lock file): that same local tier, listed, verified, exported and pruned as one;
* any other URL: the remote tier there (a job tier when every rank saved to it).

What is a URL and what is a path is :func:`ckpt.fs.is_url`'s rule (a mistyped URL is refused, never
taken for a relative directory), and a URL is opened with its ``storage_options`` by
:func:`ckpt.fs.resolve` only, so a ``"backend"`` choice means the same everywhere. A directory that
does not exist is an error: a command that reads or prunes never creates one.
"""

from __future__ import annotations

import errno
import os
from typing import Any

from ..fs import is_local_fs, is_url, local_tier_dir, resolve
from .base import StoredTier

__all__ = ["open_tier", "local_path"]


def open_tier(location: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> StoredTier:
    """The :class:`~ckpt.tiers.LocalTier` or :class:`~ckpt.tiers.RemoteTier` at ``location`` (see the
    module docstring): a :class:`~ckpt.tiers.base.StoredTier`, whose records and chunks a reader lists and
    fetches. Raises ``FileNotFoundError`` for a directory (or ``file://`` URL's directory) that
    does not exist, ``ValueError`` for a mistyped URL or an unknown scheme or backend."""
    from .local import LocalTier

    text = os.fspath(location)
    path = local_path(text, storage_options)
    if path is not None:
        return LocalTier(path)
    from .remote import RemoteTier

    return RemoteTier(text, storage_options)


def local_path(location: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> str | None:
    """The local tier's directory ``location`` names (a path, or a ``file://`` URL of a local tier's
    directory), or ``None`` for a remote tier's URL; a directory that must exist, checked here."""
    text = os.fspath(location)
    if not is_url(text):
        if not os.path.isdir(text):
            raise FileNotFoundError(errno.ENOENT, "no such checkpoint directory (local_dir)", text)
        return text
    store = resolve(text, storage_options)
    if is_local_fs(store.fs) and not os.path.isdir(store.root):  # opening the remote tier would create it
        raise FileNotFoundError(errno.ENOENT, "no such checkpoint directory", text)
    return local_tier_dir(text, storage_options)
