"""What a location means, the same to the ``Checkpointer``, :func:`ckpt.export`, the DCP adapter and every
``ckpt`` command (``ckpt.fs.is_url``, ``ckpt.tiers.locate.open_tier``, ``ckpt.fs.resolve``):

* a ``file://`` URL of a local tier's directory is that local tier, for ``export`` as for ``ls``;
* ``storage_options["backend"]`` chooses the client wherever a URL is opened (an unknown one is refused
  everywhere, never passed to fsspec as an option it ignores);
* a mistyped URL (``s3:/bucket/run``) or an unknown scheme is refused, never a relative local directory;
  a path is a local tier and never a remote one."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckpt
from ckpt.cli import main
from ckpt.integrations.dcp import TierStorageReader, TierStorageWriter, list_checkpoints

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _saved(local_dir):
    with ckpt.Checkpointer(
        storage=ckpt.Storage(local_dir=local_dir), policy=ckpt.Policy(keep=ckpt.Retention(local=None))
    ) as ck:
        ck.save(3, {"model": {"w": torch.arange(12.0)}, "note": "x"}).wait()


def _weights(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


# -- a file:// URL of a local_dir is that local tier --------------------------------------------------


def test_export_of_a_file_url_of_a_local_dir_exports_that_local_tier(tmp_path, capsys):
    pytest.importorskip("safetensors")
    _saved(tmp_path / "ck")
    url = f"file://{tmp_path}/ck"
    assert main(["ls", url, "--json"]) == 0
    assert [r["step"] for r in json.loads(capsys.readouterr().out)] == [3]
    assert main(["export", url, str(tmp_path / "out"), "--key", "model"]) == 0
    assert torch.equal(_weights(tmp_path / "out")["w"], torch.arange(12.0))
    info = ckpt.export(url, tmp_path / "out2", key="model")
    assert info.step == 3 and torch.equal(_weights(tmp_path / "out2")["w"], torch.arange(12.0))


def test_export_to_a_dest_inside_a_file_url_of_a_local_dir_is_refused(tmp_path):
    _saved(tmp_path / "ck")
    with pytest.raises(ValueError):
        ckpt.export(f"file://{tmp_path}/ck", tmp_path / "ck" / "step-000000003" / "out")


# -- storage_options["backend"] means the same everywhere ---------------------------------------------

_BOGUS = json.dumps({"backend": "no-such-backend"})
_ARROW = json.dumps({"backend": "arrow"})


@pytest.mark.parametrize("cmd", [["ls"], ["inspect"], ["verify"], ["gc", "--dry-run"]])
@pytest.mark.parametrize("tier", ["local", "remote"])
def test_every_command_applies_the_backend_choice(tmp_path, capsys, cmd, tier):
    _saved(tmp_path / "ck")
    url = f"file://{tmp_path}/ck"
    if tier == "remote":
        url = f"file://{tmp_path}/r"
        ckpt.promote(3, "remote", local_dir=tmp_path / "ck", url=url)
    assert main([*cmd, url, "--storage-options", _BOGUS]) == 1  # refused, whichever tier the URL is
    assert "no-such-backend" in capsys.readouterr().err
    pytest.importorskip("pyarrow")
    assert main([*cmd, url, "--storage-options", _ARROW]) == 0


def test_export_applies_the_backend_choice(tmp_path):
    pytest.importorskip("safetensors")
    _saved(tmp_path / "ck")
    ckpt.promote(3, "remote", local_dir=tmp_path / "ck", url=f"file://{tmp_path}/r")
    for src in (f"file://{tmp_path}/ck", f"file://{tmp_path}/r"):
        with pytest.raises(ValueError):
            ckpt.export(src, tmp_path / "bad", key="model", storage_options={"backend": "no-such-backend"})
        assert not os.path.lexists(tmp_path / "bad")
    pytest.importorskip("pyarrow")
    ckpt.export(f"file://{tmp_path}/r", tmp_path / "out", key="model", storage_options={"backend": "arrow"})
    assert torch.equal(_weights(tmp_path / "out")["w"], torch.arange(12.0))


def test_the_dcp_adapter_applies_the_backend_choice(tmp_path):
    url = f"file://{tmp_path}/r"
    state = {"w": torch.arange(6.0)}
    with pytest.raises(ValueError):
        TierStorageWriter(url=url, storage_options={"backend": "no-such-backend"})
    with pytest.raises(ValueError):
        list_checkpoints(url, {"backend": "no-such-backend"})
    pytest.importorskip("pyarrow")
    opts = {"backend": "arrow"}
    dcp.save(state, storage_writer=TierStorageWriter(url=url, storage_options=opts), checkpoint_id="c1")
    into = {"w": torch.zeros(6)}
    dcp.load(into, storage_reader=TierStorageReader(url=url, storage_options=opts), checkpoint_id="c1")
    assert torch.equal(into["w"], state["w"]) and [r["id"] for r in list_checkpoints(url, opts)] == ["c1"]


# -- URL typos, unknown schemes, paths ------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    ["s3:/bucket/run", "s3:bucket/run", "file:/abs/dir", "s4://bucket/run", "simplecache::s4://bucket/run"],
)
def test_a_mistyped_url_or_an_unknown_scheme_is_refused_and_creates_nothing(tmp_path, monkeypatch, url):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError):
        ckpt.Checkpointer(storage=ckpt.Storage(url=url, local_dir=tmp_path / "ck"))
    with pytest.raises(ValueError):
        ckpt.promote(1, "remote", local_dir=tmp_path / "ck", url=url)
    with pytest.raises(ValueError):
        TierStorageWriter(url=url)
    with pytest.raises(ValueError):
        ckpt.export(url, tmp_path / "out")
    assert main(["ls", url]) == 2  # a usage mistake
    assert main(["verify", url]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) in ([], ["ck"])  # no ./s3:, ./s4:


def test_a_path_as_url_is_refused_pointing_at_file_urls(tmp_path):
    with pytest.raises(ValueError) as e:
        ckpt.Checkpointer(storage=ckpt.Storage(url=str(tmp_path / "remote"), local_dir=tmp_path / "ck"))
    assert f"file://{tmp_path}/remote" in str(e.value)
    assert not os.path.lexists(tmp_path / "remote")


def test_the_file_url_the_error_names_works_for_the_checkpointer_and_the_cli(tmp_path, capsys):
    url = f"file://{tmp_path}/remote"
    with ckpt.Checkpointer(storage=ckpt.Storage(url=url, local_dir=tmp_path / "ck")) as ck:
        ck.save(1, {"w": torch.ones(3)}).wait()
    assert main(["verify", url]) == 0  # the remote tier, as the Checkpointer wrote it
    assert main(["verify", str(tmp_path / "ck")]) == 0  # a path: the local tier


def test_a_local_dir_named_like_a_scheme_is_reached_as_a_relative_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _saved("./s3:")
    assert main(["verify", "./s3:"]) == 0
