"""Child side of tests/test_peer_hostile.py: one gloo rank of a job with the peer tier, attacked.

``python peer_hostile_worker.py ROOT RANK WORLD MODE``, MASTER_ADDR / MASTER_PORT from the environment.
Rank ``r`` checkpoints into ``ROOT/rank-<r>`` and keeps its shared memory in ``ROOT/shm-<r>`` (its node's RAM).
Environment: ``HOSTILE_PEERS`` (``peers=``, default 1), ``HOSTILE_REMOTE=1`` (a remote tier per rank,
``ROOT/remote-<r>``, written every step), ``HOSTILE_N`` (elements of ``w``), ``HOSTILE_STEPS`` (the steps
saved, default ``2,4``).

The state of step ``s`` on rank ``r`` is :func:`expected` (``w`` float32, ``h`` bfloat16, ``i`` int64, ``b``
bool, all derived from ``(s, r)``): a restore prints ``restored S TIER EXACT`` with ``EXACT`` whether every
tensor is bit-identical to that step's.

* ``save``: saves the steps of ``HOSTILE_STEPS``, each waited for (every tier); prints ``saved`` with the
  replicas this rank holds; leaves its RAM as a crash would.
* ``kill``: like ``save``, but in the exchange of the last step rank ``HOSTILE_VICTIM`` SIGKILLs itself at
  ``HOSTILE_AT``: ``mid`` (a third of the replica it receives landed), ``verified`` (every chunk of the
  replica it holds landed and matched, before its record is written), ``committed`` (the record written,
  before the ack goes back), ``taken`` (its buffer taken for the replica, its record withdrawn, no byte in).
  The victim prints ``dying armed`` as it dies there; every other rank waits for its memory tier's record of
  the step, then for the peer tier (its exchange fails, or ``CKPT_PEER_TIMEOUT_S``), prints ``dying after`` and SIGKILLs itself. ``HOSTILE_RESUME=1``: restores first (prints ``resumed S TIER``), as a
  restarted job whose holders take over the replicas their previous processes left. ``HOSTILE_GROW_AT=S``: from
  step ``S`` on, the state is four times larger (new tensors). ``HOSTILE_ROLLBACK=S``: restores step ``S``
  first (the steps saved after it start a new branch).
* ``restore``: ``HOSTILE_SERVE_DIES=R``: rank R SIGKILLs itself a third into serving a replica. Restores (``HOSTILE_STRICT=0``: ``strict=False`` with a key the checkpoint lacks and without
  ``b``), prints
  ``restored``.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch


def expected(step: int, rank: int, n: int) -> dict:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {
        "w": torch.randn(n, generator=g),
        "h": torch.randn(n // 3 + 1, generator=g).to(torch.bfloat16),
        "i": torch.randint(-(1 << 62), 1 << 62, (n // 5 + 1,), generator=g, dtype=torch.int64),
        "b": torch.randint(0, 2, (n // 7 + 3,), generator=g).bool(),
        "step": step,
    }


def _die(where: str = "armed") -> None:
    print("dying", where, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(rank: int, last: int) -> None:
    """Make this rank SIGKILL itself at HOSTILE_AT in the exchange of step ``last``."""
    from ckpt.tiers import peer as peer_mod

    at = os.environ["HOSTILE_AT"]
    if at == "mid":
        real = peer_mod.Exchange.data

        def dying(self, out, to, into, frm, in_piece, landed, out_ready=None):
            pieces = []

            def count(off, k):
                pieces.append(k)
                if into is not None and into.numel() > 1 and len(pieces) * 3 >= -(-into.numel() // in_piece):
                    _die()
                landed(off, k)

            return real(self, out, to, into, frm, in_piece, count, out_ready)

        peer_mod.Exchange.data = dying
    elif at == "verified":
        real_commit = peer_mod.MemoryTier.commit

        def commit(self, step, *a, **k):
            if step == last and getattr(self, "hostile_peer", False):  # the holder's store of replicas
                _die()
            return real_commit(self, step, *a, **k)

        peer_mod.MemoryTier.commit = commit
    elif at == "committed":
        real_commit = peer_mod.MemoryTier.commit

        def commit(self, step, *a, **k):
            out = real_commit(self, step, *a, **k)
            if step == last and getattr(self, "hostile_peer", False):
                _die()
            return out

        peer_mod.MemoryTier.commit = commit
    elif at == "taken":
        real_take = peer_mod.PeerTier._take

        def take(self, step, *a, **k):
            out = real_take(self, step, *a, **k)
            if step == last:
                _die()
            return out

        peer_mod.PeerTier._take = take
    else:
        raise SystemExit(f"unknown HOSTILE_AT {at}")


def main() -> None:
    root, rank, world, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    os.makedirs(f"{root}/shm-{rank}", exist_ok=True)
    os.environ["CKPT_SHM_DIR"] = f"{root}/shm-{rank}"
    import ckpt

    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    n = int(os.environ.get("HOSTILE_N", "4000"))
    steps = [int(s) for s in os.environ.get("HOSTILE_STEPS", "2,4").split(",")]
    peers = int(os.environ.get("HOSTILE_PEERS", "1"))
    remote = os.environ.get("HOSTILE_REMOTE") == "1"
    state = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in expected(0, rank, n).items()}
    try:
        ck = ckpt.Checkpointer(
            local_dir=f"{root}/rank-{rank}",
            every_steps=1,
            peers=peers,
            url=f"file://{root}/remote-{rank}" if remote else None,
            persist_every={"local": 1000},
            if_busy="wait",
            signals=(),
        )
        with ck:
            if mode in ("save", "kill"):
                victim = mode == "kill" and rank == int(os.environ["HOSTILE_VICTIM"])
                if os.environ.get("HOSTILE_RESUME") == "1":  # a restarted job: its replicas taken over first
                    print("resumed", ck.restore(state), ck.last_restore.tier, flush=True)
                if os.environ.get(
                    "HOSTILE_ROLLBACK"
                ):  # a restarted job going back to an older step: a new branch
                    print(
                        "resumed",
                        ck.restore(state, step=int(os.environ["HOSTILE_ROLLBACK"])),
                        ck.last_restore.tier,
                        flush=True,
                    )
                if victim:
                    ck.peer.store.hostile_peer = True
                for step in steps:
                    if victim and step == steps[-1]:  # every earlier exchange is over (each save waited for)
                        _arm(rank, step)
                    ck.wait_staged()
                    while ck.pool.preparing is not None or ck.peer.pool.preparing is not None:
                        time.sleep(0.01)  # every buffer there: no save reuses the only one
                    grow = int(os.environ.get("HOSTILE_GROW_AT", "0"))
                    for k, v in expected(step, rank, 4 * n if grow and step >= grow else n).items():
                        if torch.is_tensor(v):
                            state[k] = v.clone()
                        else:
                            state[k] = v
                    h = ck.save(step, state)
                    if mode == "kill" and step == steps[-1]:
                        if not victim:  # its own RAM record of the step, which the tests' expectations assume
                            h.wait("memory")
                        try:
                            h.wait("peer")
                        except ckpt.CheckpointError:
                            pass
                        _die("after")
                    h.wait()
                print("saved", ck.peer.committed_steps(), flush=True)
                torch.distributed.barrier()
                ck.close(keep_memory=True)
            elif mode == "restore":
                if os.environ.get("HOSTILE_SERVE_DIES") == str(rank):  # dies a third into serving a replica
                    from ckpt.tiers import peer as peer_mod

                    real = peer_mod.Exchange.data

                    def dying(self, out, to, into, frm, in_piece, landed, out_ready=None):
                        if out is not None and to is not None and out.numel() > 1:
                            real(self, out[: out.numel() // 3], to, None, None, in_piece, landed, out_ready)
                            _die()
                        return real(self, out, to, into, frm, in_piece, landed, out_ready)

                    peer_mod.Exchange.data = dying
                strict = os.environ.get("HOSTILE_STRICT", "1") == "1"
                if not strict:  # a key the checkpoint lacks (left as it is), and one the state lacks
                    state["extra"] = torch.full((5,), 7, dtype=torch.int16)
                    del state["b"]
                step = ck.restore(state, strict=strict)
                want = expected(step, rank, n)
                exact = (
                    all(
                        torch.equal(state[k], v) and state[k].dtype == v.dtype
                        for k, v in want.items()
                        if torch.is_tensor(v) and k in state
                    )
                    and state["step"] == step
                )
                exact = exact and ("b" in state) == strict
                if not strict:
                    exact = exact and torch.equal(state["extra"], torch.full((5,), 7, dtype=torch.int16))
                print(f"restored {step} {ck.last_restore.tier} {exact}", flush=True)
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
