"""Metrics users can chart: one flat record per save and per restore, and one log line per save.

A record is a plain ``dict`` of ``str -> int | float`` with stable names, ready for
``SummaryWriter.add_scalar``, ``wandb.log`` or a Lightning logger's ``log_metrics``:

Save records (``ckpt/save/...``), made once the save finished on every tier:

=========================  ======  ==================================================================
key                        unit    what
=========================  ======  ==================================================================
``ckpt/save/step``         step    the step saved
``ckpt/save/bytes``        bytes   size of the snapshot (the state's tensors and records)
``ckpt/save/stall_ms``     ms      how long ``save()`` held the training loop
``ckpt/save/wait_ms``      ms      part of the stall spent waiting for a free host buffer
``ckpt/save/stage_ms``     ms      the device-to-host copy, overlapped with training (if it completed)
``ckpt/save/stage_gbps``   GB/s    ``bytes / stage`` (if it completed)
``ckpt/save/<tier>_s``     s       time to persist on ``<tier>``, for each tier the save reached
                                   among those the Checkpointer persists to (``local``, ``peer``,
                                   ``remote``, a tier of one's own: ``ck.tiers``)
``ckpt/save/<tier>_gbps``  GB/s    ``bytes / <tier>_s`` (state bytes per second, before compression)
``ckpt/save/skipped``      0 or 1  1: ``if_busy="skip"`` skipped this save (no tier times then)
``ckpt/save/failed``       0 or 1  1: at least one tier failed (the error is logged and raised by
                                   ``wait()`` / ``close()``)
=========================  ======  ==================================================================

Restore records (``ckpt/restore/...``), made when ``restore()`` loaded a checkpoint:
``ckpt/restore/step``, ``ckpt/restore/bytes``, ``ckpt/restore/seconds`` (s),
``ckpt/restore/gbps`` (GB/s), ``ckpt/restore/skipped`` (checkpoints passed over as corrupt,
torn or unloadable) and ``ckpt/restore/from_<tier>`` = 1 for the tier it came from
(``memory``, ``local``, ``remote``).

GB are 10^9 bytes. Records are made, the per-save INFO line is logged and the ``on_metrics``
callback is called on the thread that drives the Checkpointer (its ``maybe_save``, ``save``,
``wait``, ``restore``, ``metrics`` and ``close`` calls), never on the background persist thread:
so a logger that is not thread-safe (Lightning's, W&B's) may be called from the callback. A
record therefore appears at the first such call after its save finished, typically the next
step's ``maybe_save``.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any, Callable

__all__ = ["Metrics", "save_record", "restore_record", "save_line"]

log = logging.getLogger(__name__)

Record = dict[str, "int | float"]


def save_record(handle: Any) -> Record:
    """The record of a finished save (a :class:`~ckpt.SaveHandle`)."""
    stats = handle.stats
    r: Record = {
        "ckpt/save/step": int(stats.step),
        "ckpt/save/bytes": int(stats.nbytes),
        "ckpt/save/stall_ms": stats.stall_s * 1e3,
        "ckpt/save/wait_ms": stats.wait_s * 1e3,
    }
    if stats.stage_s is not None and handle.status != "skipped":
        r["ckpt/save/stage_ms"] = stats.stage_s * 1e3
        if stats.stage_s > 0:
            r["ckpt/save/stage_gbps"] = stats.nbytes / stats.stage_s / 1e9
    for tier in handle.tiers:  # the Checkpointer's tiers; those the pipeline wrote to have a persist time
        s = stats.persist_s.get(tier)
        if s is not None and tier not in handle.errors:
            r[f"ckpt/save/{tier}_s"] = s
            if s > 0:
                r[f"ckpt/save/{tier}_gbps"] = stats.nbytes / s / 1e9
    r["ckpt/save/skipped"] = int(handle.status == "skipped")
    r["ckpt/save/failed"] = int(bool(handle.errors))
    return r


def restore_record(info: Any) -> Record:
    """The record of a restore (a :class:`~ckpt.RestoreInfo`)."""
    r: Record = {
        "ckpt/restore/step": int(info.step),
        "ckpt/restore/bytes": int(info.nbytes),
        "ckpt/restore/seconds": float(info.seconds),
    }
    if info.seconds > 0:
        r["ckpt/restore/gbps"] = info.nbytes / info.seconds / 1e9
    r["ckpt/restore/skipped"] = len(info.skipped)
    r[f"ckpt/restore/from_{info.tier}"] = 1
    return r


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def save_line(handle: Any) -> str:
    """One line for the log: ``saved step 120: 7.40 GB, stall 15.2 ms, staged 0.14 s (52.9 GB/s);
    local 4.93 s (1.50 GB/s), remote 12.10 s (0.61 GB/s)``: each tier of the save, nearest first, that
    persisted it (with its time) or failed (``FAILED``)."""
    stats = handle.stats
    head = (
        f"{'saved' if not handle.errors else 'save of'} step {stats.step}: {_size(stats.nbytes)}, "
        f"stall {stats.stall_s * 1e3:.1f} ms"
    )
    if stats.stage_s is not None and stats.stage_s > 0:
        head += f", staged {stats.stage_s:.2f} s ({stats.nbytes / stats.stage_s / 1e9:.1f} GB/s)"
    parts = []
    for tier in handle.tiers:
        if tier in handle.errors:
            parts.append(f"{tier} FAILED")
            continue
        s = stats.persist_s.get(tier)
        if s is not None:
            parts.append(f"{tier} {s:.2f} s" + (f" ({stats.nbytes / s / 1e9:.2f} GB/s)" if s > 0 else ""))
    return head + ("; " + ", ".join(parts) if parts else "")


class Metrics:
    """The records of one Checkpointer: saves are tracked when issued and recorded once finished.

    ``on_metrics`` is called with each record; an exception it raises is logged with its
    traceback and does not affect checkpointing. Records also accumulate (the newest
    ``maxlen``) until :meth:`take` returns them.
    """

    def __init__(self, on_metrics: Callable[[Record], Any] | None = None, maxlen: int = 1000) -> None:
        if on_metrics is not None and not callable(on_metrics):
            raise TypeError(f"on_metrics must be a callable taking one record (a dict), got {on_metrics!r}")
        self.on_metrics = on_metrics
        self._pending: list[Any] = []
        self._records: collections.deque[Record] = collections.deque(maxlen=maxlen)
        self._lock = threading.Lock()  # a Checkpointer driven from two threads records each save once

    def track(self, handle: Any) -> None:
        """A save was issued: its record is made once it finished on every tier."""
        with self._lock:
            self._pending.append(handle)
        self.poll()

    def restored(self, info: Any) -> None:
        self._emit("restore", restore_record(info))

    def poll(self) -> None:
        """Record the saves that finished since the last call, in the order they were issued."""
        if not self._pending:
            return
        with self._lock:
            done = [h for h in self._pending if h.done()]
            finished = {id(h) for h in done}
            self._pending = [h for h in self._pending if id(h) not in finished]
        for h in done:
            if h.status != "skipped":  # a skipped save was logged (WARNING) when it was skipped
                log.info("%s", save_line(h))
            self._emit("save", save_record(h))

    def take(self) -> list[Record]:
        """The records made since the last call, oldest first."""
        self.poll()
        with self._lock:
            out = list(self._records)
            self._records.clear()
        return out

    def _emit(self, kind: str, record: Record) -> None:
        with self._lock:
            self._records.append(record)
        if self.on_metrics is not None:
            try:
                self.on_metrics(dict(record))
            except Exception:  # noqa: BLE001 - a logging problem must not stop training or a save
                log.exception(
                    "on_metrics raised on the %s record of step %s; checkpointing goes on",
                    kind,
                    record.get(f"ckpt/{kind}/step"),
                )
