"""A full disk or too little host memory gives a clear error; training goes on; old checkpoints survive."""

from __future__ import annotations

import errno
import os

import pytest
import torch

import ckpt
from ckpt.tiers import LocalTier


class FullDiskTier(LocalTier):
    """A local tier whose disk fills up halfway through writing a data file."""

    full = False

    def _write_data(self, path, size, chunk, get):
        if not self.full:
            return super()._write_data(path, size, chunk, get)
        with open(path, "wb") as f:
            f.write(bytes(get(0))[: size // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def test_a_full_disk_fails_the_save_clearly_while_training_goes_on(local_dir, caplog):
    tier = FullDiskTier(local_dir)
    w = torch.zeros(10_000)
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=tier), policy=ckpt.Policy(keep=ckpt.Retention(local=1))
    ) as ck:
        ck.save(1, {"w": w}).wait()
        tier.full = True
        w.fill_(2)
        h = ck.save(2, {"w": w})  # returns at once: training is not blocked
        with pytest.raises(OSError) as info:
            h.wait("local")
        assert info.value.errno == errno.ENOSPC
        assert "local_dir" in str(info.value) and "step 2" in str(info.value)
        h.wait("memory")  # its record in RAM may still be being written: the memory tier holds the step whole
        assert h.status == "failed" and not h.errors.get("memory")
        assert "checkpoint of step 2 failed" in caplog.text
        with pytest.raises(OSError):
            ck.wait()
        assert not (local_dir / "step-000000002").exists()
        assert (local_dir / "step-000000001" / "COMMIT").exists()
        tier.full = False  # space freed: the next save works again
        ck.save(3, {"w": w}).wait()
    out = {"w": torch.empty(10_000)}
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir)) as ck:
        assert ck.restore(out) == 3


def test_the_error_reaches_the_caller_at_the_end_of_the_with_block(local_dir):
    tier = FullDiskTier(local_dir)
    tier.full = True
    with pytest.raises(OSError, match="No space left"):
        with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=tier)) as ck:
            ck.save(1, {"w": torch.zeros(100)})


def test_a_local_dir_that_cannot_be_a_directory_is_an_os_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError):
        ckpt.Checkpointer(storage=ckpt.Storage(local_dir=tmp_path / "file" / "sub"))


def test_host_memory_limit_gives_a_clear_error_and_nothing_is_written(local_dir):
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=local_dir, host_memory_limit=1 << 20)) as ck:
        with pytest.raises(ckpt.HostMemoryError, match="host_memory_limit"):
            ck.save(1, {"w": torch.zeros(1 << 20)})
        assert ck.list() == []
        ck.save(2, {"w": torch.zeros(1000)}).wait()
    assert [p.name for p in local_dir.glob("step-*")] == ["step-000000002"]
