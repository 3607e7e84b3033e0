"""The ``ckpt`` command: ``demo``, ``ls``, ``inspect``, ``verify``, ``gc``, ``promote``, ``export``.

``ls --dcp``, ``verify --dcp`` and ``gc --dcp`` act on checkpoints written by ``dcp.save`` through
:mod:`ckpt.integrations.dcp`. ``verify``, ``gc``, ``promote`` and ``export`` draw a progress bar
(bytes, rate, ETA) on stderr when it is a terminal, unless ``--json`` or ``--no-progress`` is given
(:mod:`ckpt.progress`)."""

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

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(
            f"{self.prog.removeprefix('ckpt').strip() + ': ' if self.prog != 'ckpt' else ''}"
            f"{message} (see '{self.prog} --help')"
        )


def _json_object(text: str) -> str:
    """``--storage-options``: checked to be a JSON object while parsing, kept as text."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f'must be a JSON object ({{"key": value, ...}}), got {text!r}')
    return text


def _tier(path: str, storage_options: str | None = None):
    """The tier at ``path``: a local_dir, a remote tier's URL, or a ``file://`` URL of a local_dir, which is
    that local tier (:func:`ckpt.tiers.locate.open_tier`, the rule export follows too). A directory that
    does not exist is an error (never created by a command that only reads or prunes); a mistyped URL is a
    usage mistake."""
    from .tiers.locate import open_tier

    _location(path)
    return open_tier(path, json.loads(storage_options) if storage_options else None)


def _location(text: str) -> bool:
    """Whether ``text`` is a URL (:func:`ckpt.fs.is_url`); a mistyped URL or an unknown scheme is a usage
    mistake (exit status 2)."""
    from .fs import is_url

    try:
        return is_url(text)
    except ValueError as e:
        raise _UsageError(str(e)) from None


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
        print(
            f"ckpt: error: {failed} of {len(results)} {'checkpoints' if key == 'id' else 'steps'} failed "
            f"verification under {where}",
            file=sys.stderr,
        )
    return 1 if failed else 0


def _verify_dcp(args: argparse.Namespace) -> int:
    from .integrations.dcp import list_checkpoints, verify

    ids = [args.id] if args.id else [r["id"] for r in list_checkpoints(args.dir, _opts(args))]
    return _verify_each(
        ids,
        lambda i: {k: v for k, v in verify(args.dir, i, _opts(args)).items() if k != "id"},
        "id",
        str,
        args.json,
        args.dir,
    )


def _ls(args: argparse.Namespace) -> int:
    """Committed checkpoints newest first: the live branch by (timeline, step), then the abandoned
    branch of a rollback (``ckpt.policy.live_and_abandoned``); with ``--url``, those of the local and
    the remote tier together. Each row says which tiers hold the checkpoint, its size and age, and the
    one a restore would pick is marked."""
    if args.memory:
        return _ls_memory(args)
    if args.dir is None:
        raise _UsageError("ls: give a local_dir or URL (or --memory)")
    if args.dcp:
        return _ls_dcp(args)
    from .policy import live_and_abandoned

    if args.url is not None and _location(args.dir):
        raise _UsageError(
            f"ls: --url {args.url}: {args.dir} is a URL already; give the local_dir first "
            "(ckpt ls LOCAL_DIR --url URL)"
        )
    tiers = [_tier(args.dir, args.storage_options)]
    ram = tiers[0].left_in_ram() if _ram_holds_segments() else None
    if ram is not None:  # the snapshots its owners left in this node's RAM come first
        tiers.insert(0, ram)
    if args.url is not None:
        tiers.append(_tier(args.url, args.storage_options))
    listed = [(e, t) for t in tiers for e in t.committed()]
    live, abandoned = live_and_abandoned(e for e, _ in listed)
    gone = {e.key for e in abandoned}
    pick = _restore_pick(live, listed)
    now = time.time()
    rows = []
    for key in dict.fromkeys(e.key for e in live + abandoned):
        held = [(e, t) for e, t in listed if e.key == key]  # nearest tier first
        row: dict[str, Any] = {}
        for e, tier in held:
            info = _step_info(tier, e.step)
            for k, v in info.items():
                row.setdefault(k, v)
        e = held[0][0]
        row.update(
            {
                "step": e.step,
                "timeline": key[0],
                "tiers": [t.name for _, t in held],
                "abandoned": key in gone,
                "linked": any(x.linked for x, _ in held),
                "restore": pick[1].name if pick is not None and pick[0] == key else None,
            }
        )
        row["age_s"] = now - row["committed_unix"] if row.get("committed_unix") is not None else None
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(
        f"{'step':>10} {'timeline':>8} {'size':>10} {'ranks':>5}  {'tiers':<12} {'age':>8}  "
        "committed            path"
    )
    for r in rows:
        when = (
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["committed_unix"]))
            if r.get("committed_unix") is not None
            else "?" * 19
        )
        note = "  (abandoned branch)" if r["abandoned"] else ""
        note += "  (linked)" if r["linked"] else ""
        note += f"  <- restore picks this ({r['restore']} tier)" if r["restore"] else ""
        size = _size(r["bytes"]) if r.get("bytes") is not None else "?"
        print(
            f"{r['step']:>10} {r['timeline']:>8} {size:>10} {r.get('world_size') or '?':>5}  "
            f"{','.join(r['tiers']):<12} {_age(r['age_s']):>8}  {when}  {r.get('path', '')}{note}"
        )
    if rows and pick is None:
        print("(no checkpoint here passes the checks a restore makes first: `ckpt verify` says why)")
    if not rows:
        _hint_dcp(args.dir, args.storage_options)
    return 0


def _hint_dcp(where: str, storage_options: str | None) -> None:
    """Under an empty listing: say so, and name ``--dcp`` when ``where`` holds checkpoints of ``dcp.save``."""
    from .integrations.dcp import list_checkpoints

    try:
        ids = [
            r["id"] for r in list_checkpoints(where, json.loads(storage_options) if storage_options else None)
        ]
    except (OSError, ValueError, ImportError):
        ids = []
    if ids:
        print(
            f"ckpt ls: no Checkpointer checkpoint under {where}, but {len(ids)} written by dcp.save through "
            f"ckpt.integrations.dcp ({', '.join(ids[:5])}{', ...' if len(ids) > 5 else ''}): add --dcp "
            f"(ckpt ls {where} --dcp)",
            file=sys.stderr,
        )
    else:
        print(f"ckpt ls: no committed checkpoint under {where}", file=sys.stderr)


def _ram_holds_segments() -> bool:
    """Whether the RAM file system holds any memory-tier file at all (``ckpt-...`` in ``$CKPT_SHM_DIR`` or
    ``/dev/shm``, as :mod:`ckpt.shm` names them): a look that needs no torch, so that ``ckpt ls`` of a
    node without snapshots in RAM never imports the memory tier (and torch with it)."""
    from . import knobs

    if not knobs.get("CKPT_SHM"):
        return False
    try:
        return any(
            n.startswith(("ckpt-", ".ckpt-"))
            for n in os.listdir(os.environ.get("CKPT_SHM_DIR") or "/dev/shm")
        )
    except OSError:
        return False


def _step_info(tier: Any, step: int) -> dict[str, Any]:
    """Size, commit time, ranks and path of ``step`` on ``tier`` (what can be read of it)."""
    d = tier.describe(step)
    info = {"path": d.path, "bytes": d.nbytes, "committed_unix": d.created_unix, "world_size": d.world_size}
    return {k: v for k, v in info.items() if v is not None}


def _restore_pick(live: list[Any], listed: list[tuple[Any, Any]]) -> tuple[tuple[int, int], Any] | None:
    """The checkpoint (key, tier) a restore in one process would load now: the newest of the live branch,
    nearest tier first, whose records pass the checks a restore makes before reading data (``COMMIT``
    and manifests valid and agreeing, data sizes as committed). A restore then also verifies every
    byte, and moves on to the next candidate if one fails: ``ckpt verify`` reads them all."""
    from .errors import CheckpointError

    for e in live:
        for x, tier in listed:
            if x.key != e.key:
                continue
            try:
                tier.check(e.step, e.timeline)
            except (CheckpointError, OSError, LookupError):
                continue
            return e.key, tier
    return None


def _memory_groups(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The memory tier's segments on this node (those of ``args.dir`` when given), with whether a live
    process owns them: with ``args.dir``, whether one owns that local_dir; else whether one owns the
    local_dir their record names, ``None`` (not known) for a group with no readable record, as a live
    owner's segments are between their allocation and its first snapshot."""
    if args.dir is not None and _location(args.dir):
        raise _UsageError(f"--memory: {args.dir} is a URL; the memory tier belongs to a local_dir")
    if not _ram_holds_segments():
        return []
    from . import shm
    from .tiers.local import owned

    key = None
    if args.dir is not None:
        prefix = shm.prefix_for(args.dir, 0)  # None: the directory has no id, so no segment is its
        key = shm.local_key(prefix) if prefix is not None else ""  # every rank's segments of it, and replicas
    dir_owned = owned(args.dir) if args.dir is not None else None
    out = []
    for g in shm.segments():
        local_dir = g.local_dir
        if key is not None and shm.local_key(g.prefix) != key:
            continue
        alive = dir_owned if args.dir is not None else owned(local_dir) if local_dir is not None else None
        kind, rank = g.prefix[-6], int(g.prefix[-5:])  # r<rank>: its own snapshots; p<src>: replicas it holds
        out.append(
            {
                "prefix": g.prefix,
                "local_dir": local_dir,
                "rank": rank,
                "replica": kind == "p",
                "bytes": g.nbytes,
                "owned": alive,
                "steps": sorted(r.step for r in g.records),
                "files": [str(f) for f in g.files],
            }
        )
    return out


def _ls_memory(args: argparse.Namespace) -> int:
    from . import shm

    rows = _memory_groups(args)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    root = shm.shm_root()
    if root is None:
        print("no RAM file system for the memory tier here (/dev/shm, $CKPT_SHM_DIR), or CKPT_SHM=0")
        return 0
    print(f"{'RAM':>10}  {'owner':<8} {'snapshots':<16} {'of':<18} local_dir")
    for r in rows:
        steps = ",".join(map(str, r["steps"])) or "-"
        of = f"replica of rank {r['rank']}" if r["replica"] else f"rank {r['rank']}"
        owner = {True: "live", False: "none", None: "?"}[r["owned"]]
        print(
            f"{_size(r['bytes']):>10}  {owner:<8} {steps:<16} {of:<18} "
            f"{r['local_dir'] or '? (no readable record: ' + r['prefix'] + ')'}"
        )
    print(
        f"{len(rows)} segment group(s) in {root}, {_size(sum(r['bytes'] for r in rows))} of RAM"
        + (
            "; `ckpt gc --memory` frees those with no live owner"
            if any(r["owned"] is False for r in rows)
            else ""
        )
    )
    return 0


def _gc_memory(args: argparse.Namespace, verb: str) -> int:
    """Free the RAM of memory-tier segments whose local tier no live process owns (the snapshots a
    crashed job left); with ``dir``, those of that local_dir, refused while it is owned. Without ``dir``,
    a group with no readable record (its local_dir, so its owner, not known) is kept and named: ``gc
    --memory DIR`` frees it once DIR has no live owner."""
    rows = _memory_groups(args)
    if args.dir is not None and any(r["owned"] for r in rows):
        raise _Failure(
            f"gc --memory: {args.dir} is owned by a live process, which uses its segments; stop it "
            "(or let it close()) first"
        )
    freed, removed = 0, []
    for r in rows:
        if r["owned"] is None:
            print(
                f"ckpt gc: kept {_size(r['bytes'])} of memory-tier segments {r['prefix']}: no readable record "
                "says whose they are, and a live owner's have none before its first snapshot; `ckpt gc --memory "
                "LOCAL_DIR` frees them once LOCAL_DIR has no live owner",
                file=sys.stderr,
            )
        if r["owned"] is not False:
            continue
        if not args.dry_run:
            from . import shm

            n = shm.free(prefix=r["prefix"])
        else:
            n = r["bytes"]
        freed += n
        removed.append(
            {
                "prefix": r["prefix"],
                "local_dir": r["local_dir"],
                "rank": r["rank"],
                "replica": r["replica"],
                "bytes": n,
            }
        )
        if not args.json:
            print(f"{verb} {_size(r['bytes'])} of memory-tier segments of {r['local_dir'] or r['prefix']}")
    if args.json:
        kept = [r["prefix"] for r in rows if r["owned"] is not False]
        print(
            json.dumps(
                {"dry_run": args.dry_run, "freed_bytes": freed, "removed": removed, "kept": kept}, indent=1
            )
        )
    else:
        print(f"{verb} {_size(freed)} of RAM in all")
    return 0


def _gc_exports(args: argparse.Namespace, verb: str) -> int:
    """Remove what exports killed on the way left in ``dir`` (:func:`ckpt.export.leftovers`)."""
    from .export import leftovers, remove_leftovers

    if args.dir is None or _location(args.dir):
        raise _UsageError("gc --exports: give the directory the exports were written into (a local path)")
    if not os.path.isdir(args.dir):
        raise FileNotFoundError(errno.ENOENT, "no such directory", args.dir)
    gone = leftovers(args.dir) if args.dry_run else remove_leftovers(args.dir)
    if args.json:
        print(json.dumps({"dry_run": args.dry_run, "removed": [str(p) for p in gone]}, indent=1))
    else:
        for p in gone:
            print(f"{verb} {p} (left by an export that was killed)")
    return 0


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= size:
            return f"{s / size:.1f} {unit}" if s < 10 * size else f"{s / size:.0f} {unit}"
    return f"{s:.0f} s"


def _inspect(args: argparse.Namespace) -> int:
    tier = _tier(args.dir, args.storage_options)
    step = args.step if args.step is not None else _newest(tier)
    if step not in tier.all_step_dirs():  # never saved (or deleted): not a step with a missing COMMIT
        found = sorted({e.step for e in tier.committed()}, reverse=True)[:10]
        raise FileNotFoundError(
            errno.ENOENT, f"step {step} does not exist (committed steps: {found})", tier.step_location(step)
        )
    commit, manifests = tier.records(step)
    if len(manifests) < commit.world_size:  # one rank's own tier of a job: its one copy
        manifest = manifests[0]
    else:  # any saved rank (rank 0 by default)
        if not 0 <= args.rank < len(manifests):
            raise _UsageError(
                f"--rank {args.rank}: step {step} of {args.dir} was saved by {len(manifests)} "
                f"rank(s): pass --rank 0 to {len(manifests) - 1}"
            )
        manifest = manifests[args.rank]
    out: dict[str, Any] = {
        "step": step,
        "world_size": commit.world_size,
        "data_bytes": manifest.data_bytes,
        "chunk_bytes": manifest.chunk_bytes,
        "checksum": manifest.checksum_algorithm,
        "items": [
            {
                "key": it.key,
                "dtype": it.dtype,
                "shape": it.shape,
                "device": it.device,
                "offset": it.offset,
                "nbytes": it.nbytes,
                "alias_of": it.alias_of,
            }
            for it in manifest.items
        ],
    }
    if args.json:
        out["tree"] = manifest.tree
        print(json.dumps(out, indent=1))
        return 0
    print(
        f"step {step}: {len(manifest.items)} tensors, {_size(manifest.data_bytes)}, world size "
        f"{commit.world_size}, {len(manifest.chunks)} {manifest.checksum_algorithm} chunks of "
        f"{_size(manifest.chunk_bytes)}"
    )
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
        with _bar(args, lambda: tier.stored_bytes(step), f"verify step {step}"):
            manifests = tier.verify(step)  # every rank's copy the tier holds (a job tier: every rank's)
        return {"bytes": sum(m.data_bytes for m in manifests)}

    return _verify_each(steps, check, "step", lambda s: f"step {s}", args.json, args.dir)


def _bar(args: argparse.Namespace, total: Any, desc: str, weight: float = 1.0) -> Any:
    """A progress bar counting the bytes checksummed while the block runs (:func:`ckpt.progress.counting`),
    when stderr is a terminal and neither ``--json`` nor ``--no-progress`` was given; else nothing.
    ``total()`` is called only then (it may read records); ``None`` or a failure: no ETA."""
    from .progress import Progress, counting, wanted

    if not wanted(getattr(args, "json", False) or getattr(args, "no_progress", False)):
        return contextlib.nullcontext()
    try:
        size = total()
    except Exception:  # noqa: BLE001 - only the bar's length: the operation itself reports the failure
        size = None
    return counting(Progress(size, desc, True, weight))


def _gc(args: argparse.Namespace) -> int:
    """Delete all but the newest ``--keep`` checkpoints, and never the newest one that verifies:
    candidates are verified (every byte read) newest first until one passes, and it is kept too.
    When none verifies, no committed checkpoint is deleted and the exit status is 1."""
    from .errors import CheckpointError, NoCheckpointError

    verb = "would remove" if args.dry_run else "removed"
    if args.memory:
        return _gc_memory(args, verb)
    if args.exports:
        return _gc_exports(args, verb)
    if args.dir is None:
        raise _UsageError("gc: give a local_dir or URL (or --memory)")
    if args.dcp:
        from .integrations.dcp import prune as prune_dcp

        try:
            gone = prune_dcp(args.dir, max(1, args.keep), _opts(args), dry_run=args.dry_run, verify=True)
        except NoCheckpointError as e:
            print(f"ckpt gc: {e}", file=sys.stderr)
            if args.json:
                print(json.dumps({"dry_run": args.dry_run, "removed": [], "error": str(e)}, indent=1))
            return 1
        if args.json:
            print(json.dumps({"dry_run": args.dry_run, "removed": gone}, indent=1))
        for i in gone if not args.json else ():
            print(f"{verb} {i}")
        return 0
    from .policy import prune

    tier = _tier(args.dir, args.storage_options)
    checked: list[tuple[int, bool]] = []

    def verifies(step: int) -> bool:
        try:
            with _bar(args, lambda: tier.stored_bytes(step), f"verify step {step}"):
                tier.verify(step)  # a remote tier verifies every rank's parts
            ok = True
        except (CheckpointError, OSError) as e:
            print(
                f"ckpt gc: step {step} does not verify, so it does not count as the checkpoint to keep: {e}",
                file=sys.stderr,
            )
            ok = False
        checked.append((step, ok))
        return ok

    # Deleting from a local_dir is writing there: refused (LockedError) while a live Checkpointer owns it.
    owner = tier.acquire_owner() if not args.dry_run else None
    try:
        gone = prune(tier, max(1, args.keep), dry_run=args.dry_run, verified=verifies)
        none_verifies = bool(checked) and not any(ok for _, ok in checked)
        if args.json:
            print(
                json.dumps(
                    {
                        "dry_run": args.dry_run,
                        "removed": gone,
                        "kept_verified": next((s for s, ok in checked if ok), None),
                        "not_verified": [s for s, ok in checked if not ok],
                    },
                    indent=1,
                )
            )
        else:
            for s in gone:
                print(f"{verb} step {s}")
        if none_verifies:
            print(
                f"ckpt gc: no checkpoint under {args.dir} verifies, so no committed checkpoint was deleted "
                "(`ckpt verify` says why)",
                file=sys.stderr,
            )
            return 1
        if checked and not checked[0][1]:
            print(
                f"ckpt gc: kept step {checked[-1][0]}: the newest checkpoint that verifies", file=sys.stderr
            )
    finally:
        if owner is not None:
            owner.release()
    return 0


def _promote(args: argparse.Namespace) -> int:
    from .promotion import promote
    from .fs import resolve
    from .tiers.remote import refuse_overlap

    opts = _opts(args)
    try:  # the two tiers must be two places: a usage mistake, refused before anything is read or written
        store = resolve(args.url, opts)
        refuse_overlap(args.dir, args.url, store.fs, store.root)
    except ValueError as e:
        raise _UsageError(f"promote: {e}") from None
    t0 = time.perf_counter()

    def size() -> int:
        from .tiers import LocalTier, RemoteTier

        if args.to == "remote":
            return LocalTier(args.dir).open(args.step)[1].data_bytes if os.path.isdir(args.dir) else None
        return sum(RemoteTier(args.url, opts).read_commit(args.step).data.values())

    # each byte is checksummed once on its way up; on its way down, once downloaded and once as written
    with _bar(args, size, f"promote step {args.step}", weight=1.0 if args.to == "remote" else 0.5):
        copied = promote(
            args.step,
            args.to,
            local_dir=args.dir,
            url=args.url,
            storage_options=opts,
            compression=args.compression,
        )
    if args.json:
        print(
            json.dumps(
                {"step": args.step, "to": args.to, "copied": copied, "seconds": time.perf_counter() - t0},
                indent=1,
            )
        )
    elif copied:
        print(f"step {args.step} copied to the {args.to} tier in {time.perf_counter() - t0:.2f} s")
    else:
        print(f"step {args.step} is already on the {args.to} tier and verifies: nothing copied")
    return 0


def _export(args: argparse.Namespace) -> int:
    from .export import export

    info = export(
        args.src,
        args.dest,
        format=args.format,
        step=args.step,
        key=args.key,
        storage_options=_opts(args),
        max_shard_size=args.max_shard_size,
        dtype=args.dtype,
        config=args.config,
        force=args.force,
        progress=not (args.json or args.no_progress),
    )
    if args.json:
        print(json.dumps(info.to_dict(), indent=1))
        return 0
    what = f"key {info.key!r} of step {info.step}" if info.key else f"step {info.step}"
    print(
        f"exported {what} of {info.source} to {info.path} ({info.format}): {info.tensors} tensors, "
        f"{_size(info.nbytes)} in {len(info.files)} file(s), {_size(info.read_bytes)} read and verified in "
        f"{info.seconds:.2f} s"
    )
    for f in info.files:
        print(f"  {f}")
    for d in info.dropped:
        print(f"left out: {d}")
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


_EXAMPLES = {
    "demo": """examples:
  ckpt demo                          train a small model, SIGKILL it, resume, compare bit for bit
  ckpt demo --device cuda --steps 60""",
    "ls": """examples:
  ckpt ls /mnt/nvme/ckpt
  ckpt ls /mnt/nvme/ckpt --url s3://bucket/run     both tiers: which holds what, which a restore picks
  ckpt ls s3://bucket/run --storage-options '{"endpoint_url": "http://127.0.0.1:9000"}'
  ckpt ls /mnt/nvme/ckpt --json | jq '.[] | select(.restore) | .step'
  ckpt ls --memory                   the memory tier's shared-memory segments on this node (and the peer
                                     tier's replicas held here): RAM, owner""",
    "inspect": """examples:
  ckpt inspect /mnt/nvme/ckpt                newest step: its tensors, dtypes and shapes
  ckpt inspect s3://bucket/run --step 1200 --rank 3""",
    "verify": """examples:
  ckpt verify /mnt/nvme/ckpt                 read every byte of every step, check its checksum
  ckpt verify s3://bucket/run --step 1200    every stored part of every rank of a job tier
  ckpt verify /mnt/nvme/ckpt --json""",
    "gc": """examples:
  ckpt gc /mnt/nvme/ckpt --keep 2 --dry-run  what would go
  ckpt gc s3://bucket/run --keep 5
  ckpt gc --memory                           free the RAM of segments no live process owns
  ckpt gc --memory /mnt/nvme/ckpt            free that local_dir's segments (refused while it is owned)
  ckpt gc --exports ./exports                remove what exports killed on the way left in ./exports
  ckpt gc /mnt/nvme/ckpt --keep 2 --json     {"dry_run", "removed", "kept_verified", "not_verified"}""",
    "promote": """examples:
  ckpt promote /mnt/nvme/ckpt s3://bucket/run --step 1200 --to remote
  ckpt promote /mnt/nvme/ckpt s3://bucket/run --step 1200 --to local""",
    "export": """examples:
  ckpt export /mnt/nvme/ckpt weights/ --key model                 safetensors (sharded at 5GB, with an index)
  ckpt export s3://bucket/run llama-hf/ --format hf --config ./llama-config/
  ckpt export /mnt/nvme/ckpt model.pt --format torch --key model --dtype bfloat16
  ckpt export /mnt/nvme/ckpt weights/ --step 1200 --max-shard-size 2GB --force""",
}


def _size_arg(text: str) -> int:
    from .export import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("max_shard_size: ")) from None


def _keep_arg(text: str) -> int:
    """``gc --keep``: a whole number of at least 1, as ``Retention`` takes. A smaller one is refused, not
    taken as 1: the newest committed checkpoint is never deleted, so ``--keep 0`` cannot do what it says."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(
            f"{n}: keep at least 1 (the newest committed checkpoint is never deleted)"
        )
    return n


def _dtype_arg(text: str) -> str:
    from .export import _parse_dtype

    try:
        _parse_dtype(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("dtype: ")) from None
    return text


def _parser() -> argparse.ArgumentParser:
    from . import __version__, demo
    from .export import DEFAULT_MAX_SHARD_SIZE, FORMATS

    common = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: a subcommand without --debug must not reset a --debug given before it
    common.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show the full traceback of a failure"
    )
    p = _Parser(
        prog="ckpt",
        description="Tiered asynchronous checkpointing for PyTorch.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  ckpt ls /mnt/nvme/ckpt\n  ckpt verify s3://bucket/run\n"
        "  ckpt export /mnt/nvme/ckpt weights/ --key model\n  ckpt COMMAND --help   (an example for "
        "each command)\n\nExit status: 0 on success, 1 when the operation failed (a corrupt, "
        "incomplete or missing\ncheckpoint, an I/O error; for verify: any step failed its check), 2 "
        "for a usage mistake.\nProgress bars (verify, gc, promote, export) go to stderr when it is a "
        "terminal.",
    )
    p.add_argument("--debug", action="store_true", help="show the full traceback of a failure")
    p.add_argument("--version", action="version", version=f"ckpt (tierckpt) {__version__}")
    names = "{demo,ls,inspect,verify,gc,promote,export}"
    sub = p.add_subparsers(dest="cmd", required=True, metavar=names)

    def command(name: str, helptext: str) -> argparse.ArgumentParser:
        return sub.add_parser(
            name,
            parents=[common],
            help=helptext,
            description=helptext[0].upper() + helptext[1:] + ".",
            epilog=_EXAMPLES[name],
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )

    def no_progress(q: argparse.ArgumentParser) -> None:
        q.add_argument(
            "--no-progress",
            action="store_true",
            help="no progress bar (none is drawn anyway when stderr is not a terminal, or with --json)",
        )

    demo.add_arguments(command("demo", "train, checkpoint, get SIGKILLed, resume; compare bit for bit"))
    for name, fn, helptext in (
        ("ls", _ls, "list committed checkpoints: size, tiers, age, and the one a restore picks"),
        ("inspect", _inspect, "show the tensors of a checkpoint"),
        ("verify", _verify, "read every byte and check its checksum"),
        ("gc", _gc, "delete all but the newest committed checkpoints (keeping the newest that verifies)"),
    ):
        q = command(name, helptext)
        q.add_argument(
            "dir",
            nargs="?" if name in ("ls", "gc") else None,
            help="local tier directory (local_dir), or a remote tier URL (every rank's files of a job tier)",
        )
        q.add_argument("--json", action="store_true", help="machine-readable output")
        q.add_argument(
            "--storage-options",
            type=_json_object,
            default=None,
            help="JSON object passed to fsspec (for a URL)",
        )
        if name in ("inspect", "verify"):
            q.add_argument("--step", type=int, default=None, help="step (default: newest / all)")
        if name in ("ls", "verify", "gc"):
            q.add_argument(
                "--dcp",
                action="store_true",
                help="checkpoints written by dcp.save through ckpt.integrations.dcp (named by checkpoint id)",
            )
        if name == "gc":
            q.add_argument(
                "--exports",
                action="store_true",
                help="remove what exports killed on the way left in dir (the directory they wrote into): "
                "their hidden .NAME.export-PID-... directories, once that process is gone",
            )
        if name in ("ls", "gc"):
            q.add_argument(
                "--memory",
                action="store_true",
                help="the memory tier's shared-memory segments (/dev/shm) on this node: every one, or "
                "those of dir" + (" (freed only when no live process owns them)" if name == "gc" else ""),
            )
        if name == "ls":
            q.add_argument(
                "--url", default=None, help="also the remote tier at this URL (dir is then the local_dir)"
            )
        if name == "verify":
            q.add_argument("--id", default=None, help="with --dcp: one checkpoint id (default: all)")
        if name == "inspect":
            q.add_argument("--rank", type=int, default=0, help="which saved rank's tensors (a job tier)")
        if name == "gc":
            q.add_argument(
                "--keep", type=_keep_arg, default=2, help="newest checkpoints to keep (at least 1)"
            )
            q.add_argument("--dry-run", action="store_true")
        if name in ("verify", "gc"):
            no_progress(q)
        q.set_defaults(fn=fn)
    q = command(
        "promote", "copy a committed checkpoint between the local and remote tiers, verifying every byte"
    )
    q.add_argument("dir", help="local tier directory (local_dir)")
    q.add_argument("url", help="remote tier URL (any fsspec URL)")
    q.add_argument("--step", type=int, required=True)
    q.add_argument("--to", choices=("remote", "local"), required=True)
    q.add_argument("--storage-options", type=_json_object, default=None, help="JSON object passed to fsspec")
    q.add_argument("--compression", choices=("zstd",), default=None)
    q.add_argument("--json", action="store_true", help="machine-readable output")
    no_progress(q)
    q.set_defaults(fn=_promote)
    q = command(
        "export",
        "write a committed checkpoint as safetensors, a Hugging Face model directory or a torch.save file",
    )
    q.add_argument(
        "src",
        help="local tier directory (local_dir), or a remote tier URL (a job tier is consolidated "
        "into whole tensors)",
    )
    q.add_argument(
        "dest", help="output directory (safetensors, hf) or file (torch); it must not exist unless --force"
    )
    q.add_argument(
        "--format",
        choices=FORMATS,
        default="safetensors",
        help="safetensors (default): model.safetensors or shards + model.safetensors.index.json; hf: "
        "config.json + safetensors, for from_pretrained; torch: one torch.save file",
    )
    q.add_argument("--step", type=int, default=None, help="step (default: the one a restore would pick)")
    q.add_argument(
        "--key",
        default=None,
        help="the part of the state to export, e.g. model (default: all of it; "
        "for --format hf the first of model, module, state_dict there)",
    )
    q.add_argument(
        "--max-shard-size",
        type=_size_arg,
        default=DEFAULT_MAX_SHARD_SIZE,
        help=f"largest safetensors file, e.g. 2GB or 4GiB (default {DEFAULT_MAX_SHARD_SIZE})",
    )
    q.add_argument(
        "--dtype",
        type=_dtype_arg,
        default=None,
        help="cast floating-point tensors to this dtype, e.g. bfloat16 (default: keep each tensor's)",
    )
    q.add_argument(
        "--config",
        default=None,
        help="--format hf: the model config: a config.json, a directory holding one, or a model name "
        "(default: the 'hf_config' the state holds)",
    )
    q.add_argument("--force", action="store_true", help="replace dest if it exists")
    q.add_argument("--json", action="store_true", help="machine-readable output")
    q.add_argument(
        "--storage-options", type=_json_object, default=None, help="JSON object passed to fsspec (for a URL)"
    )
    no_progress(q)
    q.set_defaults(fn=_export)
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
    except BrokenPipeError:  # `ckpt ls DIR | head`: the reader left; not worth a message
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
    except Exception as e:  # noqa: BLE001 - a bug: still one line, the traceback on request
        if debug:
            traceback.print_exc()
        print(
            f"ckpt: error: unexpected {type(e).__name__}: {' '.join(str(e).split())} (rerun with --debug "
            "for the traceback, and please report it)",
            file=sys.stderr,
        )
        return 1


class _LogLines(logging.Handler):
    """The library's warnings as ``ckpt: warning: ...`` lines on stderr (one line each)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(
                f"ckpt: {record.levelname.lower()}: {' '.join(record.getMessage().split())}", file=sys.stderr
            )
        except Exception:  # noqa: BLE001 - logging must never fail the command
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
