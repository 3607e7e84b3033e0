"""The worker torchrun starts in tests/test_torchrun_recovery.py: the recipe of docs/guides/launchers.md as it is,
with a failure injected from outside it.

``python -m torch.distributed.run ... elastic_worker.py RECIPE OUT [KILL_STEP]``

Runs the script RECIPE (``runpy``, as ``__main__``). With KILL_STEP, on torchrun's first attempt
(``TORCHELASTIC_RESTART_COUNT`` 0) rank 1 SIGKILLs itself right after ``maybe_save(KILL_STEP)``, once that
snapshot is committed to its memory tier (the step it expects the restarted job to resume from), and writes
``OUT/killed-at`` first. Each rank that finishes writes ``OUT/rank-R.json``: the attempt, the step and tier
its restore came from (``null``: none) and the sha256 of its model's parameters.
"""

from __future__ import annotations

import hashlib
import json
import os
import runpy
import signal
import sys

import ckpt


def main(argv: list[str]) -> None:
    recipe, out = argv[0], argv[1]
    kill_at = int(argv[2]) if len(argv) > 2 else None
    attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
    if kill_at is not None and attempt == 0 and rank == 1:
        real = ckpt.Checkpointer.maybe_save

        def maybe_save(self, step, state, **kw):
            handle = real(self, step, state, **kw)
            if step == kill_at:
                handle.wait("memory")
                with open(os.path.join(out, "killed-at"), "w") as f:
                    f.write(str(step))
                os.kill(os.getpid(), signal.SIGKILL)
            return handle

        ckpt.Checkpointer.maybe_save = maybe_save
    sys.argv = [recipe]
    done = runpy.run_path(recipe, run_name="__main__")
    digest = hashlib.sha256()
    for p in done["model"].module.parameters():
        digest.update(p.detach().numpy().tobytes())
    info = done["ck"].last_restore
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump(
            {
                "attempt": attempt,
                "restored": None if info is None else [info.step, info.tier],
                "digest": digest.hexdigest(),
            },
            f,
        )


if __name__ == "__main__":
    main(sys.argv[1:])
