"""The ``ckpt`` command: ``demo``, ``ls``, ``inspect``, ``verify``, ``gc``, ``promote``.

``ls --dcp``, ``verify --dcp`` and ``gc --dcp`` act on checkpoints written by ``dcp.save`` through
:mod:`ckpt.integrations.dcp`."""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import sys
import time
import traceback
from typing import Any, Iterator

__all__ = ["main"]


class _UsageError(Exception):
    """A mistake in the command line: exit status 2."""


class _Failure(Exception):
    """An operational failure the command itself found (nothing to inspect, say): exit status 1."""


class _Parser(argparse.ArgumentParser):
    """Usage mistakes raise instead of printing the usage and exiting, so that :func:`main` reports
    every failure the same way: one ``ckpt: error: ...`` line."""

    def error(self, message: str) -> None:   # type: ignore[override]
        raise _UsageError(f"{self.prog.removeprefix('ckpt').strip() + ': ' if self.prog != 'ckpt' else ''}"
                          f"{message} (see '{self.prog} --help')")


def _json_object(text: str) -> str:
    """``--storage-options``: checked to be a JSON object while parsing, kept as text."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object ({{\"key\": value, ...}}), got {text!r}")
    return text


def _tier(path: str, storage_options: str | None = None):
    """The local tier at ``path``, or the remote tier when ``path`` is a URL (``s3://``, ``file://`` ...).

    A directory that does not exist is an error (never created by a command that only reads or prunes)."""
    from .tiers import LocalTier, RemoteTier

    if "://" in path:
        opts = json.loads(storage_options) if storage_options else None
        _must_exist(path, opts)
        return RemoteTier(path, opts)
    if not os.path.isdir(path):
        raise FileNotFoundError(errno.ENOENT, "no such checkpoint directory (local_dir)", path)
    return LocalTier(path)


def _must_exist(url: str, opts: dict | None) -> None:
    """On a file system with real directories (``file://``), the URL's directory must exist: opening the
    remote tier would create it. An object store has no empty directories to check."""
    import fsspec

    from .tiers.remote import is_local_fs

    fs, root = fsspec.core.url_to_fs(url, **(opts or {}))
    if is_local_fs(fs) and not fs.isdir(root):
        raise FileNotFoundError(errno.ENOENT, "no such checkpoint directory", url)


def _opts(args: argparse.Namespace) -> dict | None:
    return json.loads(args.storage_options) if args.storage_options else None


def _ls_dcp(args: argparse.Namespace) -> int:
    from .integrations.dcp import list_checkpoints

    rows = list_checkpoints(args.dir, _opts(args))
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"{'size':>10} {'ranks':>5}  checkpoint id (dcp.save through ckpt.integrations.dcp)")
        for r in rows:
            print(f"{_size(r['bytes']):>10} {r['world_size']:>5}  {r['id']}")
    return 0


def _verify_each(names: list[Any], check: Any, key: str, label: Any, as_json: bool, where: str = "") -> int:
    """``check(name)`` (a dict with ``bytes``, maybe ``items``; raises on a bad checkpoint) for each name;
    prints one OK / FAILED line per name, or JSON; returns the exit status (1 if any failed, with one
    ``ckpt: error:`` line on stderr). Nothing to verify is a failure too."""
    from .errors import CheckpointError

    if not names:
        raise _Failure(f"no committed checkpoint to verify under {where}")
    results = []
    for n in names:
        t0 = time.perf_counter()
        try:
            results.append({key: n, "ok": True, **check(n), "seconds": time.perf_counter() - t0})
        except (CheckpointError, OSError) as e:
            results.append({key: n, "ok": False, "error": str(e)})
    if as_json:
        print(json.dumps(results, indent=1))
    else:
        for r in results:
            if r["ok"]:
                items = f"{r['items']} items, " if "items" in r else ""
                print(f"{label(r[key])}: OK ({items}{_size(r['bytes'])} verified in {r['seconds']:.2f} s)")
            else:
                print(f"{label(r[key])}: FAILED: {r['error']}")
    failed = sum(not r["ok"] for r in results)
    if failed:
        sys.stdout.flush()
        print(f"ckpt: error: {failed} of {len(results)} {'checkpoints' if key == 'id' else 'steps'} failed "
              f"verification under {where}", file=sys.stderr)
    return 1 if failed else 0


def _verify_dcp(args: argparse.Namespace) -> int:
    from .integrations.dcp import list_checkpoints, verify

    ids = [args.id] if args.id else [r["id"] for r in list_checkpoints(args.dir, _opts(args))]
    return _verify_each(ids, lambda i: {k: v for k, v in verify(args.dir, i, _opts(args)).items() if k != "id"},
                        "id", str, args.json, args.dir)


def _ls(args: argparse.Namespace) -> int:
    """Committed checkpoints newest first: the live branch by (timeline, step), then the abandoned
    branch of a rollback (``ckpt.policy.live_and_abandoned``)."""
    if args.dcp:
        return _ls_dcp(args)
    from .policy import live_and_abandoned

    tier = _tier(args.dir, args.storage_options)
    live, abandoned = live_and_abandoned(tier.committed())
    rows = []
    for e in live + abandoned:
        s = e.step
        d = tier.step_dir(s)
        flags = {"timeline": e.timeline.number, "abandoned": e in abandoned, "linked": e.linked}
        if tier.name == "remote":   # sizes and time from the commit record: one read per step
            c = tier.read_commit(s)
            rows.append({"step": s, "path": d, "bytes": sum(c.data.values()), "committed_unix": c.created_unix,
                         "world_size": c.world_size, **flags})
            continue
        size = sum(f.stat().st_size for f in d.iterdir() if f.is_file())
        rows.append({"step": s, "path": str(d), "bytes": size,
                     "committed_unix": (d / "COMMIT").stat().st_mtime, "world_size": 1, **flags})
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"{'step':>10} {'timeline':>8} {'size':>10} {'ranks':>5}  committed            path")
        for r in rows:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["committed_unix"]))
            note = "  (abandoned branch)" if r["abandoned"] else ""
            note += "  (linked)" if r["linked"] else ""
            print(f"{r['step']:>10} {r['timeline']:>8} {_size(r['bytes']):>10} {r['world_size']:>5}  {when}  "
                  f"{r['path']}{note}")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    tier = _tier(args.dir, args.storage_options)
    step = args.step if args.step is not None else _newest(tier)
    if tier.name == "remote":   # any saved rank of a job tier (rank 0 by default)
        commit = tier.read_commit(step)
        manifests = tier.read_manifests(step, commit)
        if not 0 <= args.rank < len(manifests):
            raise _UsageError(f"--rank {args.rank}: step {step} of {args.dir} was saved by {len(manifests)} "
                              f"rank(s): pass --rank 0 to {len(manifests) - 1}")
        manifest = manifests[args.rank]
    else:
        commit, manifest = tier.open(step)
    out: dict[str, Any] = {"step": step, "world_size": commit.world_size, "data_bytes": manifest.data_bytes,
                           "chunk_bytes": manifest.chunk_bytes, "checksum": manifest.checksum_algorithm,
                           "items": [{"key": it.key, "dtype": it.dtype, "shape": it.shape, "device": it.device,
                                      "offset": it.offset, "nbytes": it.nbytes, "alias_of": it.alias_of}
                                     for it in manifest.items]}
    if args.json:
        out["tree"] = manifest.tree
        print(json.dumps(out, indent=1))
        return 0
    print(f"step {step}: {len(manifest.items)} tensors, {_size(manifest.data_bytes)}, world size "
          f"{commit.world_size}, {len(manifest.chunks)} {manifest.checksum_algorithm} chunks of "
          f"{_size(manifest.chunk_bytes)}")
    for it in out["items"]:
        alias = f"  (same memory as item {it['alias_of']})" if it["alias_of"] is not None else ""
        print(f"  {it['key']:<60} {it['dtype']:<9} {str(it['shape']):<20} {it['device']}{alias}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    if args.dcp:
        return _verify_dcp(args)
    tier = _tier(args.dir, args.storage_options)
    steps = [args.step] if args.step is not None else tier.committed_steps()

    def check(step: int) -> dict:
        m = tier.verify(step)   # a remote tier verifies every rank's parts
        return {"bytes": sum(x.data_bytes for x in m) if isinstance(m, list) else m.data_bytes}

    return _verify_each(steps, check, "step", lambda s: f"step {s}", args.json, args.dir)


def _gc(args: argparse.Namespace) -> int:
    """Delete all but the newest ``--keep`` checkpoints, and never the newest one that verifies:
    candidates are verified (every byte read) newest first until one passes, and it is kept too.
    When none verifies, no committed checkpoint is deleted and the exit status is 1."""
    from .errors import CheckpointError, NoCheckpointError

    verb = "would remove" if args.dry_run else "removed"
    if args.dcp:
        from .integrations.dcp import prune as prune_dcp

        try:
            gone = prune_dcp(args.dir, max(1, args.keep), _opts(args), dry_run=args.dry_run, verify=True)
        except NoCheckpointError as e:
            print(f"ckpt gc: {e}", file=sys.stderr)
            return 1
        for i in gone:
            print(f"{verb} {i}")
        return 0
    from .policy import prune

    tier = _tier(args.dir, args.storage_options)
    checked: list[tuple[int, bool]] = []

    def verifies(step: int) -> bool:
        try:
            tier.verify(step)   # a remote tier verifies every rank's parts
            ok = True
        except (CheckpointError, OSError) as e:
            print(f"ckpt gc: step {step} does not verify, so it does not count as the checkpoint to keep: {e}",
                  file=sys.stderr)
            ok = False
        checked.append((step, ok))
        return ok

    # Deleting from a local_dir is writing there: refused (LockedError) while a live Checkpointer owns it.
    owner = tier.acquire_owner() if tier.name == "local" and not args.dry_run else None
    try:
        gone = prune(tier, max(1, args.keep), dry_run=args.dry_run, verified=verifies)
        for s in gone:
            print(f"{verb} step {s}")
        if checked and not any(ok for _, ok in checked):
            print(f"ckpt gc: no checkpoint under {args.dir} verifies, so no committed checkpoint was deleted "
                  "(`ckpt verify` says why)", file=sys.stderr)
            return 1
        if checked and not checked[0][1]:
            print(f"ckpt gc: kept step {checked[-1][0]}: the newest checkpoint that verifies", file=sys.stderr)
    finally:
        if owner is not None:
            owner.release()
    return 0


def _promote(args: argparse.Namespace) -> int:
    from .api import promote

    opts = _opts(args)
    t0 = time.perf_counter()
    if promote(args.step, args.to, local_dir=args.dir, url=args.url, storage_options=opts,
               compression=args.compression):
        print(f"step {args.step} copied to the {args.to} tier in {time.perf_counter() - t0:.2f} s")
    else:
        print(f"step {args.step} is already on the {args.to} tier and verifies: nothing copied")
    return 0


def _newest(tier) -> int:
    from .policy import live_and_abandoned

    live = live_and_abandoned(tier.committed())[0]
    if not live:
        raise _Failure(f"no committed checkpoint under {getattr(tier, 'url', tier.root)}")
    return live[0].step


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _parser() -> argparse.ArgumentParser:
    from . import demo

    common = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: a subcommand without --debug must not reset a --debug given before it
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the full traceback of a failure")
    p = _Parser(prog="ckpt", description="Tiered asynchronous checkpointing for PyTorch.",
                epilog="Exit status: 0 on success, 1 when the operation failed (a corrupt, incomplete or missing "
                       "checkpoint, an I/O error; for verify: any step failed its check), 2 for a usage mistake.")
    p.add_argument("--debug", action="store_true", help="show the full traceback of a failure")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{demo,ls,inspect,verify,gc,promote}")
    d = sub.add_parser("demo", parents=[common], help="train, checkpoint, get SIGKILLed, resume; compare bit for bit")
    demo.add_arguments(d)
    for name, fn, helptext in (("ls", _ls, "list committed checkpoints of a local or remote tier"),
                               ("inspect", _inspect, "show the tensors of a checkpoint"),
                               ("verify", _verify, "read every byte and check its checksum"),
                               ("gc", _gc, "delete all but the newest committed checkpoints (keeping the newest that verifies)")):
        q = sub.add_parser(name, parents=[common], help=helptext)
        q.add_argument("dir", help="local tier directory (local_dir), or a remote tier URL (every rank's files "
                                   "of a job tier)")
        q.add_argument("--json", action="store_true", help="machine-readable output")
        q.add_argument("--storage-options", type=_json_object, default=None,
                       help="JSON object passed to fsspec (for a URL)")
        if name in ("inspect", "verify"):
            q.add_argument("--step", type=int, default=None, help="step (default: newest / all)")
        if name in ("ls", "verify", "gc"):
            q.add_argument("--dcp", action="store_true", help="checkpoints written by dcp.save through "
                                                              "ckpt.integrations.dcp (named by checkpoint id)")
        if name == "verify":
            q.add_argument("--id", default=None, help="with --dcp: one checkpoint id (default: all)")
        if name == "inspect":
            q.add_argument("--rank", type=int, default=0, help="which saved rank's tensors (a job tier)")
        if name == "gc":
            q.add_argument("--keep", type=int, default=2, help="newest checkpoints to keep (at least 1)")
            q.add_argument("--dry-run", action="store_true")
        q.set_defaults(fn=fn)
    q = sub.add_parser("promote", parents=[common],
                       help="copy a committed checkpoint between the local and remote tiers")
    q.add_argument("dir", help="local tier directory (local_dir)")
    q.add_argument("url", help="remote tier URL (any fsspec URL)")
    q.add_argument("--step", type=int, required=True)
    q.add_argument("--to", choices=("remote", "local"), required=True)
    q.add_argument("--storage-options", type=_json_object, default=None, help="JSON object passed to fsspec")
    q.add_argument("--compression", choices=("zstd",), default=None)
    q.set_defaults(fn=_promote)
    return p


def _one_line(e: BaseException) -> str:
    """``e`` as one line; the library's own errors also name their type (``CorruptCheckpointError``...)."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if isinstance(e, (OSError, _Failure, _UsageError)) else f"{text} ({type(e).__name__})"


def main(argv: list[str] | None = None) -> int:
    """The ``ckpt`` command. Returns the exit status: 0 success, 1 operational failure, 2 usage mistake.

    Every failure is one ``ckpt: error: ...`` line on stderr; ``--debug`` adds the traceback."""
    from . import demo
    from .errors import CheckpointError

    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv
    try:
        args = _parser().parse_args(argv)
        debug = bool(getattr(args, "debug", False))
        with _logging(debug):
            if args.cmd == "demo":
                args.child = False
                return demo.parent(args)
            return args.fn(args)
    except _UsageError as e:
        print(f"ckpt: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ckpt: error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:   # `ckpt ls DIR | head`: the reader left; not worth a message
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 1
    except (CheckpointError, OSError, ValueError, _Failure) as e:
        if debug:
            traceback.print_exc()
        print(f"ckpt: error: {_one_line(e)}", file=sys.stderr)
        return 1
    except Exception as e:   # noqa: BLE001 - a bug: still one line, the traceback on request
        if debug:
            traceback.print_exc()
        print(f"ckpt: error: unexpected {type(e).__name__}: {' '.join(str(e).split())} (rerun with --debug "
              "for the traceback, and please report it)", file=sys.stderr)
        return 1


class _LogLines(logging.Handler):
    """The library's warnings as ``ckpt: warning: ...`` lines on stderr (one line each)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(f"ckpt: {record.levelname.lower()}: {' '.join(record.getMessage().split())}", file=sys.stderr)
        except Exception:   # noqa: BLE001 - logging must never fail the command
            self.handleError(record)


@contextlib.contextmanager
def _logging(debug: bool) -> Iterator[None]:
    """While a command runs: the library's warnings as one line each, or (``--debug``) its whole log."""
    logger = logging.getLogger("ckpt")
    handler: logging.Handler = _LogLines(logging.WARNING)
    if debug:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    saved = logger.level
    logger.addHandler(handler)
    if debug:
        logger.setLevel(logging.DEBUG)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved)


if __name__ == "__main__":
    sys.exit(main())
