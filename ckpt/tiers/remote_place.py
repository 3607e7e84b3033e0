"""Where a remote tier may not live: in a local tier's directory, or over the checkpoints of the local tier
beside it (a ``file://`` URL that is ``local_dir``, one of its steps, or holds it in one of its own)."""

from __future__ import annotations

import os
from typing import Any

from ..format import LATEST_NAME, parse_step_dir
from ..fs import is_local_fs
from .local import LOCK_NAME

__all__ = ["refuse_local_tier_dir", "refuse_overlap"]


def refuse_local_tier_dir(url: str, root: str) -> None:
    """Raise ``ValueError`` where the remote tier's directory ``root`` (of ``url``, on the local file system)
    is a local tier's: the two tiers lay out a step differently, so a remote tier there would find none of
    the local steps valid, and would write and prune its own steps beside a live owner's without its lock."""
    if os.path.lexists(os.path.join(root, LOCK_NAME)):
        raise ValueError(
            f"{url} is a local tier's directory (it holds {LOCK_NAME}, made by a Checkpointer with local_dir "
            f"{root}), whose layout is not the remote tier's: pass it as local_dir=, or to the ckpt commands as "
            "a path rather than a URL; a remote tier needs a directory of its own"
        )


def refuse_overlap(local_dir: str | os.PathLike, url: str, fs: Any, root: str) -> None:
    """Raise ``ValueError`` where the remote tier of ``url`` (its file system ``fs`` and path ``root``: fsspec's
    ``url_to_fs``), a ``file://`` URL, and the local tier of ``local_dir`` would share
    their checkpoints: the URL is ``local_dir`` itself (through any path to it), or a step directory (or
    ``latest``) of it, or the other way round. Both tiers would then write and prune one place: the remote
    tier's ``COMMIT`` and manifest over the local ones (a good local checkpoint that no longer verifies once
    they differ, e.g. by compression), a promote writing into ``local_dir`` without its owner lock. A URL
    elsewhere in ``local_dir`` (``file://DIR/remote``) or around it (a job tier over ``ROOT/rank-N``) shares
    nothing."""
    if not is_local_fs(fs):
        return
    a, b = os.path.realpath(os.fspath(local_dir)), os.path.realpath(root)

    def part_of(inner: str, outer: str) -> bool:
        first = os.path.relpath(inner, outer).split(os.sep)[0]
        return first != ".." and (first == "." or parse_step_dir(first) is not None or first == LATEST_NAME)

    if part_of(a, b) or part_of(b, a):
        raise ValueError(
            f"the remote tier's url {url} is local_dir {os.fspath(local_dir)} or one of its "
            "checkpoints (or holds it in one of its own): the two tiers would write one place; give "
            "the remote tier a directory of its own (a url of another directory)"
        )
