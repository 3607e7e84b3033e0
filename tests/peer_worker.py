"""Child side of the peer-tier tests: one gloo rank whose snapshots are replicated into another rank's RAM.

``python peer_worker.py ROOT RANK WORLD MODE``, MASTER_ADDR / MASTER_PORT from the environment.
Each rank checkpoints into ``ROOT/rank-<RANK>`` with ``peers=1`` and keeps its shared memory in
``ROOT/shm-<RANK>`` (its node's RAM: a replaced node loses both): rank r's snapshots go to rank r+1
(mod WORLD), which holds them in its RAM. ``CKPT_TEST_REMOTE=1`` adds a remote tier per rank
(``ROOT/remote-<RANK>``, written every step).

* ``save``: ``w`` = ``100 * rank + s`` at steps 1..4, saved at 2 and 4; prints ``saved`` and the steps of
  the replicas it holds, then exits leaving its RAM as a crash would (``close(keep_memory=True)``).
* ``train``: a deterministic update every step, snapshots every step (the local tier every 1000
  steps), every snapshot waited for; SIGKILLs itself after step ``KILL_AT``.
* ``resume``: restores, prints ``restored S TIER``, trains on to step ``LAST``, prints ``digest D``.
* ``straight``: the same training without any checkpointing: prints ``digest D``.
* ``durable``: saves step 5 and waits for the ``peer`` tier; prints whether the holder has it in RAM.
* ``drain``: SIGTERM to rank 0 at step 3 with ``drain_tier="peer"``; prints ``preempted S DURABLE HELD``.
* ``rollback``: saves step 7 and restores at once (the exchange may still run); prints ``restored``.
* ``staged``: moves images of several sizes both ways with :class:`ckpt.tiers.peer.Exchange` staged
  through ``CKPT_TEST_DEVICE`` buffers (``cpu``: the device path's ring logic over gloo; ``cuda``: over
  NCCL), checking every chunk; prints ``staged OK`` or what differed.
* ``tear``: saves step 2 (the replicas land), then rank 0 is SIGKILLed while rank 1's replica of step 4 is
  arriving (a third of it in); rank 1 prints ``peer STATUS BROKEN SECONDS`` once its exchange failed, and
  kills itself: both print ``torn``.
* ``cadence``: snapshots every step, the peer tier every 3 (``persist_every``); prints ``cadence`` with the
  replicas it holds, the peer tier's counts and figures.
* ``full``: rank 0 cannot write the record of rank 1's replica of step 4 (``ENOSPC``, a full /dev/shm), or with
  ``CKPT_TEST_FAULT=header`` refuses that replica's header as out of bounds; prints ``full`` with each rank's
  peer-tier status of steps 2, 4 and 6.
* ``restore``: prints ``restored S W T`` (step, ``w[0]`` after it, the tier it came from). ``CKPT_TEST_FAULT``
  on rank 1: ``alloc`` (no host memory to receive its replica into), ``manifest`` (the replica's manifest
  fails to parse on arrival).

``CKPT_TEST_DEFAULT_DEVICE``: ``torch.set_default_device`` of the process once its state exists.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import time
from pathlib import Path

import torch

KILL_AT, LAST = 6, 10


def held_by(root: str, holder: int, src: int) -> list[int]:
    """Steps of rank ``src``'s replicas committed in ``holder``'s RAM (read from its segment records)."""
    from ckpt import shm

    groups = shm.segments(
        Path(root) / f"shm-{holder}", shm.replica_prefix(f"{root}/rank-{holder}", src, create=True)
    )
    return sorted(r.step for g in groups for r in g.records)


def update(state: dict, step: int, rank: int) -> None:
    state["w"].mul_(0.999).add_(torch.linspace(0, 1, state["w"].numel()) * (step + rank))
    state["step"] = step


def digest(state: dict) -> str:
    return hashlib.sha256(state["w"].numpy().tobytes()).hexdigest()[:16]


def staged(rank: int, world: int) -> None:
    import dataclasses

    from ckpt.format import Manifest
    from ckpt.integrity import checksum
    from ckpt import device_crc
    from ckpt.tiers import peer
    from ckpt.tiers.peer import Exchange, checked_receive

    dev = torch.device(os.environ.get("CKPT_TEST_DEVICE", "cpu"))
    dist = torch.distributed
    if dev.type == "cuda":
        torch.cuda.set_device(rank)
        data_group = dist.new_group(backend="nccl")
    else:
        data_group = None
    dst, src = (rank + 1) % world, (rank - 1) % world
    ctl = dist.new_group(backend="gloo")
    problems = []
    # pieces of 3 chunks and a bit on one side, 2 on the other: the ring wraps, chunks straddle pieces
    cases = [(1000, 3100, 2000, 2, n, "host") for n in (0, 1, 999, 1000, 7001, 25_000)]
    if dev.type == "cuda":  # pinned host memory: every copy is asynchronous, as the tiers' buffers are;
        # and a receive buffer on the GPU (a restore's): chunks straddle pieces, are longer than a check part
        cases += [(1 << 20, (3 << 20) + 100, 2 << 20, ring, (48 << 20) + 12345, "host") for ring in (2, 3)]
        cases += [
            (c, (3 << 20) + 100, 2 << 20, 2, n, "device")
            for c, n in ((1 << 20, (48 << 20) + 12345), ((40 << 20) + 3, (90 << 20) + 7), (1000, 7001))
        ]
    if dev.type == "cuda":  # once the Triton checks are ready: a replica received into host memory is
        # checked on the GPU as each piece passes its staging buffer (pieces of whole chunks); a tail past the
        # last lane, a copy shorter than one lane, rings of 2 and 3
        cases += [
            (1 << 20, 3 << 20, 2 << 20, ring, n, "host, checked on the way")
            for ring in (2, 3)
            for n in ((48 << 20) + 12345, 1000, 5 << 20)
        ]
    on_the_way = []
    real = peer._checked_on_the_way
    peer._checked_on_the_way = lambda *a: on_the_way.append(a[3].numel()) or real(*a)  # a[3]: into
    for chunk, piece0, piece1, ring, n, where in cases:
        if where == "host, checked on the way" and not device_crc.ready(dev):
            device_crc.warm(dev, chunk)
        wire = Exchange(ctl, piece0 if rank == 0 else piece1, data_group, dev, ring=ring)
        pin = dev.type == "cuda" and n > 1 << 20
        g = torch.Generator().manual_seed(1000 * rank + n)
        out = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        expect = torch.randint(
            0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1000 * src + n)
        )
        sums = [checksum(memoryview(expect.numpy())[i : i + chunk]) for i in range(0, n, chunk)]
        m = Manifest(
            step=1,
            rank=src,
            world_size=world,
            data_bytes=n,
            chunk_bytes=chunk,
            chunks=sums,
            items=[],
            tree={},
        )
        if pin:
            out = out.pin_memory()
        their_piece = piece0 if src == 0 else piece1
        for check in ("right", "wrong"):
            into = torch.zeros(
                n,
                dtype=torch.uint8,
                pin_memory=pin and where.startswith("host"),
                device=dev if where == "device" else "cpu",
            )
            if check == "right":
                bad = checked_receive(wire, out, dst, into, src, their_piece, m)
                if bad or not torch.equal(into.cpu(), expect):
                    problems.append(
                        f"size {n}, ring {ring}, into {where}: bad chunks {bad[:5]}, "
                        f"equal {torch.equal(into.cpu(), expect)}"
                    )
            elif n:  # every chunk must be checked
                wrong = dataclasses.replace(m, chunks=[s ^ 1 for s in sums])
                if checked_receive(wire, out, dst, into, src, their_piece, wrong) != list(range(len(sums))):
                    problems.append(f"size {n}, ring {ring}, into {where}: a wrong checksum was not found")
    if dev.type == "cuda":  # an exchange between host buffers while the training's step is queued on the
        # default stream (seconds of it): it neither waits for the step nor holds a piece until the step is done
        n, chunk = (8 << 20) + 77, 1 << 20
        wire = Exchange(ctl, 2 << 20, data_group, dev, ring=2)
        out = torch.randint(
            0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(rank)
        ).pin_memory()
        expect = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(src))
        m = Manifest(
            step=1,
            rank=src,
            world_size=world,
            data_bytes=n,
            chunk_bytes=chunk,
            items=[],
            tree={},
            chunks=[checksum(memoryview(expect.numpy())[i : i + chunk]) for i in range(0, n, chunk)],
        )
        into = torch.zeros(n, dtype=torch.uint8).pin_memory()
        dist.barrier(group=ctl)
        torch.cuda._sleep(int(6e9))  # ~3 s of a "step" on the default stream
        t0 = time.monotonic()
        bad = checked_receive(wire, out, dst, into, src, 2 << 20, m)
        took = time.monotonic() - t0
        torch.cuda.synchronize()
        if bad or not torch.equal(into, expect) or took > 1.0:
            problems.append(f"beside a queued step: bad chunks {bad[:5]}, {took:.2f} s")
        if n in on_the_way:
            on_the_way.remove(n)
        else:
            problems.append("the copy beside a queued step was not checked on the GPU on the way")
    want = [
        n for *_, n, where in cases if where == "host, checked on the way" for _ in ("right", "wrong") if n
    ]
    if sorted(on_the_way) != sorted(want):  # each such copy, right and wrong, and no other
        problems.append(f"checked on the way: {sorted(on_the_way)}, expected {sorted(want)}")
    print("staged", "OK" if not problems else problems, flush=True)
    dist.destroy_process_group()


def main() -> None:
    root, rank, world, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    os.makedirs(f"{root}/shm-{rank}", exist_ok=True)
    os.environ["CKPT_SHM_DIR"] = f"{root}/shm-{rank}"
    import ckpt

    if os.environ.get("CKPT_PEER_NCCL") == "1" and torch.cuda.is_available():
        torch.cuda.set_device(rank)  # the replicas move over NCCL: one GPU per rank
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    training = mode in ("train", "resume", "straight")
    n = int(os.environ.get("CKPT_TEST_N", "6"))
    state = {"w": torch.full((300_000,), float(rank)) if training else torch.zeros(n), "step": 0}
    if os.environ.get("CKPT_TEST_DEFAULT_DEVICE"):  # what a training script may set for the whole process
        torch.set_default_device(os.environ["CKPT_TEST_DEFAULT_DEVICE"])
    if mode == "straight":
        for step in range(1, LAST + 1):
            update(state, step, rank)
        print("digest", digest(state), flush=True)
        return
    if mode == "staged":
        staged(rank, world)
        return
    remote = os.environ.get("CKPT_TEST_REMOTE") == "1"
    try:
        drain = mode == "drain"
        every = {"local": 1000, "peer": 3} if mode == "cadence" else {"local": 1000} if training else None
        ck = ckpt.Checkpointer(
            storage=ckpt.Storage(
                local_dir=f"{root}/rank-{rank}",
                peers=1,
                url=f"file://{root}/remote-{rank}" if remote else None,
            ),
            policy=ckpt.Policy(
                every_steps=1 if training or every else 2, persist_every=every, if_busy="wait"
            ),
            on_preempt="raise",
            signals=(signal.SIGTERM,) if drain else (),
            drain_tier="peer" if drain else "local",
            drain_deadline=60,
        )
        with ck:
            assert "peer" in ck.tiers
            if mode == "save":
                for step in range(1, 5):
                    ck.wait_staged()
                    while step > 1 and ck.pool.preparing is not None:
                        # the second buffer is still being allocated (maybe_save at step 1 started it): a
                        # save now reuses the only buffer there is rather than wait, and step 2 would leave
                        # this rank's RAM (a slow CI machine got there)
                        time.sleep(0.01)
                    state["w"].fill_(100 * rank + step)
                    state["step"] = step
                    h = ck.maybe_save(step, state)
                    if h is not None:
                        h.wait()
                print("saved", ck.peer.committed_steps(), flush=True)
                ck.close(keep_memory=True)  # its RAM stays as a crash leaves it
            elif mode == "tear":
                state["w"] = torch.arange(n, dtype=torch.float32) + rank
                ck.save(2, state).wait()
                if rank == 0:  # the holder of rank 1's replicas dies while step 4's arrives
                    from ckpt.tiers import peer as peer_mod

                    real = peer_mod.Exchange.data

                    def dying(self, out, to, into, frm, in_piece, landed):
                        pieces = []

                        def count(off, k):
                            pieces.append(k)
                            if into is not None and len(pieces) * 3 >= -(-into.numel() // in_piece):
                                print("torn", flush=True)
                                os.kill(os.getpid(), signal.SIGKILL)
                            landed(off, k)

                        return real(self, out, to, into, frm, in_piece, count)

                    peer_mod.Exchange.data = dying
                state["w"].add_(2)
                try:
                    # rank 1: its holder dies under it; whether gloo notices or not, its exchange fails within
                    # CKPT_PEER_TIMEOUT_S, and the peer tier stops in this process
                    h = ck.save(4, state)
                    t0 = time.monotonic()
                    try:
                        h.wait("peer")
                    except ckpt.CheckpointError:
                        pass
                    print(
                        "peer",
                        h.tier_status("peer"),
                        ck.peer.broken is not None,
                        time.monotonic() - t0,
                        flush=True,
                    )
                finally:
                    print("torn", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
            elif mode == "cadence":
                for step in range(1, 8):
                    ck.wait_staged()
                    state["w"].fill_(step)
                    ck.maybe_save(step, state).wait()
                c, f = ck.tier_counts["peer"], ck.tier_figures()["peer"]
                print(
                    "cadence",
                    ck.peer.committed_steps(),
                    c.persisted,
                    c.not_due,
                    f.committed,
                    f.writes,
                    f.write_gbps is not None,
                    flush=True,
                )
                torch.distributed.barrier()
            elif mode == "full":
                import errno

                from ckpt import shm as shm_mod

                real = shm_mod.write_record

                def full(root_, prefix, slot, step, *a, **k):
                    if rank == 0 and "-p" in prefix and step == 4:
                        raise OSError(errno.ENOSPC, "No space left on device")
                    return real(root_, prefix, slot, step, *a, **k)

                header = os.environ.get("CKPT_TEST_FAULT") == "header"
                if not header:
                    shm_mod.write_record = full
                status = []
                for step in (2, 4, 6):
                    state["w"].fill_(step)
                    limit = shm_mod.MAX_RECORD_BYTES
                    if header and rank == 0 and step == 4:  # rank 1's manifest is "too big" for its holder
                        shm_mod.MAX_RECORD_BYTES = 8
                    h = ck.save(step, state)
                    try:
                        h.wait("peer")
                    except ckpt.CheckpointError:
                        pass
                    status.append(h.tier_status("peer"))
                    shm_mod.MAX_RECORD_BYTES = limit
                print("full", status, ck.peer.committed_steps(), flush=True)
                torch.distributed.barrier()
                try:
                    ck.wait()
                except ckpt.CheckpointError:
                    pass
            elif mode == "train":
                for step in range(1, KILL_AT + 1):
                    ck.wait_staged()
                    update(state, step, rank)
                    ck.maybe_save(step, state).wait()
                print("killing", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            elif mode == "resume":
                step = ck.restore(state)
                print(f"restored {step} {ck.last_restore.tier}", flush=True)
                for s in range(step + 1, LAST + 1):
                    update(state, s, rank)
                print("digest", digest(state), flush=True)
            elif (
                drain
            ):  # SIGTERM reaches rank 0 only; both ranks save step 3 and wait until their holder has it
                try:
                    for step in range(1, 10):
                        ck.wait_staged()  # before the in-place update: the last save may still be copying w
                        state["w"].fill_(100 * rank + step)
                        if step == 3 and rank == 0:
                            os.kill(os.getpid(), signal.SIGTERM)
                        ck.maybe_save(step, state)
                except ckpt.Preempted as e:
                    held = e.step in held_by(root, (rank + 1) % world, rank)
                    print(f"preempted {e.step} {e.durable} {held}", flush=True)
                    torch.distributed.barrier()  # no holder closes (freeing its replicas) before all looked
            elif mode == "durable":  # handle.wait("peer"): the holder has committed the replica by then
                state["w"].fill_(100 * rank + 5)
                ck.save(5, state).wait("peer")
                print("durable", 5 in held_by(root, (rank + 1) % world, rank), flush=True)
                torch.distributed.barrier()  # no holder closes (freeing its replicas) before all looked
            elif mode == "rollback":  # restore while the save's exchange with the peers may still run
                state["w"].fill_(100 * rank + 7)
                ck.save(7, state)
                ck.wait_staged()  # the copy into host memory, not the exchange with the peer
                state["w"].fill_(float("nan"))
                step = ck.restore(state)
                print(f"restored {step} {float(state['w'][0])} {ck.last_restore.tier}", flush=True)
            else:
                fault = os.environ.get("CKPT_TEST_FAULT") if rank == 1 else None
                from ckpt.tiers import peer as peer_mod

                if fault == "alloc":  # a pinned allocation that fails raises RuntimeError

                    def no_memory(nbytes, device=None):
                        raise RuntimeError(f"test: cannot allocate {nbytes} bytes")

                    peer_mod._receive_buffer = no_memory
                elif fault == "manifest":
                    from ckpt.errors import CorruptCheckpointError

                    class Garbled(peer_mod.Manifest):
                        @classmethod
                        def from_bytes(cls, raw, where):
                            raise CorruptCheckpointError(f"{where}: garbled in this test")

                    peer_mod.Manifest = Garbled
                step = ck.restore(state)
                print(f"restored {step} {float(state['w'][0])} {ck.last_restore.tier}", flush=True)
                print("phases", ",".join(sorted(ck.last_restore.phases)), flush=True)
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
