"""The remote tier's clients (ckpt.fs): pyarrow's file systems through fsspec's ArrowFSWrapper (local, and
S3 against moto's server on loopback), the choice of backend by URL, storage_options and environment,
and HDFS: routing, what a missing libhdfs / JVM / hdfs-native is reported as, an unreachable namenode.

A real HDFS cannot run here (no Hadoop release, no namenode); test_remote.py runs its whole suite
(SIGKILL mid-upload, outages, typed errors included) through both S3 clients and both local clients."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt import knobs
from ckpt.fs import ArrowFileSystem, MissingBackendError, hdfs_arrow_missing, http_answers, resolve
from s3server import FaultProxy, free_port, storage_options

pa_fs = pytest.importorskip("pyarrow.fs")

HERE = Path(__file__).parent
CHUNK = 256 << 10


def _state(seed: float, n: int = 300_000) -> dict:
    return {"w": torch.arange(n, dtype=torch.float32).mul_(0.001).add_(seed), "step": int(seed)}


def _target(n: int = 300_000) -> dict:
    return {"w": torch.empty(n), "step": None}


def _same(a: dict, b: dict) -> bool:
    return a["step"] == b["step"] and torch.equal(a["w"], b["w"])


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    for name in ("CKPT_S3_BACKEND", "CKPT_HDFS_BACKEND", "CKPT_FILE_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    with knobs.override(CKPT_CHUNK_BYTES=CHUNK):
        yield


def test_import_ckpt_imports_no_pyarrow():
    code = (
        "import sys, ckpt, ckpt.fs, ckpt.tiers.remote, ckpt.cli\n"
        "assert 'pyarrow' not in sys.modules, sorted(m for m in sys.modules if 'arrow' in m)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# -- which client serves a URL -----------------------------------------------------------------------


@pytest.mark.s3
def test_s3_uses_s3fs_by_default_and_arrow_when_asked(s3_server, monkeypatch):
    import s3fs

    assert isinstance(resolve("s3://bucket/run", storage_options(s3_server)).fs, s3fs.S3FileSystem)
    store = resolve("s3://bucket/run", storage_options(s3_server, backend="arrow"))
    assert (
        store.backend == "arrow"
        and isinstance(store.fs.fs, pa_fs.S3FileSystem)
        and store.root == "bucket/run"
    )
    monkeypatch.setenv("CKPT_S3_BACKEND", "arrow")
    assert resolve("s3://bucket/run", storage_options(s3_server)).backend == "arrow"
    assert (
        resolve("s3://bucket/run", storage_options(s3_server, backend="s3fs")).backend == "s3fs"
    )  # the key wins


def test_file_urls_use_fsspec_by_default_and_arrow_when_asked(tmp_path):
    from fsspec.implementations.local import LocalFileSystem

    assert isinstance(resolve(f"file://{tmp_path}/r").fs, LocalFileSystem)
    store = resolve(f"file://{tmp_path}/r", {"backend": "arrow"})
    assert isinstance(store.fs.fs, pa_fs.LocalFileSystem) and store.root == f"{tmp_path}/r"
    assert store.fs.unstrip_protocol(store.root) == f"file://{tmp_path}/r"  # messages name file:// URLs


@pytest.mark.parametrize(
    "url, options, named",
    [
        ("s3://b/run", {"backend": "hdfs-native"}, "storage_options['backend']"),
        ("file:///tmp/x", {"backend": "s3fs"}, "storage_options['backend']"),
        ("memory://x", {"backend": "arrow"}, "storage_options['backend']"),
        ("simplecache::s3://b/run", {"backend": "arrow"}, "chained"),
    ],
)
def test_a_backend_the_url_cannot_use_is_refused_naming_the_key(url, options, named):
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")) as ei:
        resolve(url, options)
    assert url in str(ei.value)


def test_a_bad_backend_in_the_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv("CKPT_S3_BACKEND", "boto")
    with pytest.raises(ValueError, match="CKPT_S3_BACKEND='boto'"):
        resolve("s3://b/run", {})


def test_s3fs_options_are_translated_for_pyarrow_and_unknown_ones_refused():
    from ckpt.fs import arrow_s3_options

    kw = arrow_s3_options(
        {
            "key": "k",
            "secret": "s",
            "token": "t",
            "endpoint_url": "http://127.0.0.1:9000",
            "client_kwargs": {"region_name": "eu-west-1"},
            "skip_instance_cache": True,
            "config_kwargs": {
                "retries": {"max_attempts": 4, "mode": "standard"},
                "connect_timeout": 2,
                "s3": {"addressing_style": "path"},
            },
        }
    )
    assert (kw["access_key"], kw["secret_key"], kw["session_token"]) == ("k", "s", "t")
    assert (kw["scheme"], kw["endpoint_override"], kw["region"]) == ("http", "127.0.0.1:9000", "eu-west-1")
    assert kw["connect_timeout"] == 2.0 and kw["force_virtual_addressing"] is False
    assert isinstance(kw["retry_strategy"], pa_fs.AwsStandardS3RetryStrategy)
    assert (
        arrow_s3_options({"region": "us-west-2", "allow_delayed_open": False})["allow_delayed_open"] is False
    )
    with pytest.raises(ValueError, match=r"requester_pays.*config_kwargs\['signature_version'\]") as ei:
        arrow_s3_options({"requester_pays": True, "config_kwargs": {"signature_version": "s3v4"}})
    assert "storage_options['backend'] = 's3fs'" in str(ei.value)
    s3fs_store = pa_fs.S3FileSystem(**kw)  # pyarrow takes every argument produced
    assert s3fs_store.region == "eu-west-1"


def test_a_missing_pyarrow_names_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # `import pyarrow` raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.fs", None)
    with pytest.raises(MissingBackendError) as ei:
        ckpt.tiers.RemoteTier(f"file://{tmp_path}/r", {"backend": "arrow"})
    assert ei.value.missing == ("pyarrow",) and ei.value.backend == "arrow"
    assert isinstance(ei.value, ImportError) and "tierckpt[arrow]" in str(ei.value)


# -- ranged reads through the wrapper --------------------------------------------------------------------


@pytest.mark.parametrize(
    "start, end",
    [
        (None, None),
        (0, None),
        (0, 10),
        (0, 1001),
        (0, 5000),
        (7, 300),
        (990, 1000),
        (1000, 1010),
        (-10, None),
        (5, -5),
        (400, 100),
    ],
)
def test_ranged_reads_through_pyarrow_match_slicing(tmp_path, start, end):
    data = (bytes(range(256)) * 4)[:1000]
    (tmp_path / "obj").write_bytes(data)
    fs = ArrowFileSystem(pa_fs.LocalFileSystem(), skip_instance_cache=True)
    assert fs.cat_file(str(tmp_path / "obj"), start=start, end=end) == data[start:end]


def test_a_missing_file_read_through_pyarrow_is_file_not_found(tmp_path):
    fs = ArrowFileSystem(pa_fs.LocalFileSystem(), skip_instance_cache=True)
    for start, end in ((None, None), (0, 10)):
        with pytest.raises(FileNotFoundError):
            fs.cat_file(str(tmp_path / "nothing"), start=start, end=end)


# -- the remote tier through pyarrow: round trips, corruption, outages ---------------------------------


def _arrow_url(kind: str, tmp_path: Path, request) -> tuple[str, dict]:
    if kind == "local":
        return f"file://{tmp_path}/remote", {"backend": "arrow"}
    bucket, port = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/run", storage_options(port, backend="arrow")


@pytest.mark.parametrize("kind", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_save_restore_promote_verify_through_pyarrow(tmp_path, request, kind):
    url, opts = _arrow_url(kind, tmp_path, request)
    with ckpt.Checkpointer(
        storage=ckpt.Storage(url=url, storage_options=opts, local_dir=tmp_path / "a", compression="zstd")
    ) as ck:
        assert ck.remote.store.backend == "arrow"
        ck.save(1, _state(1.0)).wait()
        ck.save(2, _state(2.0)).wait()
        assert [m.rank for m in ck.remote.verify(2)] == [0]
    target = _target()
    with ckpt.Checkpointer(
        storage=ckpt.Storage(url=url, storage_options=opts, local_dir=tmp_path / "b")
    ) as ck:
        assert ck.restore(target) == 2 and ck.last_restore.tier == "remote"
        assert _same(target, _state(2.0))
        assert ck.promote(1, to="local") is True  # a download into the local tier
        assert ck.local.committed_steps() == [2, 1]
    (tmp_path / "c").mkdir()
    with ckpt.Checkpointer(storage=ckpt.Storage(local_dir=tmp_path / "c")) as ck:
        ck.save(3, _state(3.0)).wait()
    assert ckpt.promote(3, "remote", local_dir=tmp_path / "c", url=url, storage_options=opts) is True
    remote = ckpt.tiers.RemoteTier(url, opts)
    assert remote.committed_steps()[0] == 3
    remote.verify(3)
    target = _target()
    with ckpt.Checkpointer(
        storage=ckpt.Storage(url=url, storage_options=opts, local_dir=tmp_path / "d")
    ) as ck:
        assert ck.restore(target) == 3
    assert _same(target, _state(3.0))


@pytest.mark.parametrize("kind", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_a_corrupt_part_is_refused_through_pyarrow_and_restore_falls_back(tmp_path, request, kind):
    url, opts = _arrow_url(kind, tmp_path, request)
    with ckpt.Checkpointer(
        storage=ckpt.Storage(url=url, storage_options=opts, local_dir=tmp_path / "a"),
        policy=ckpt.Policy(keep=ckpt.Retention(remote=None)),
    ) as ck:
        ck.save(1, _state(1.0)).wait()
        ck.save(2, _state(2.0)).wait()
        fs, root = ck.remote.fs, ck.remote.root
    part = f"{root}/step-000000002/rank-00000/part-000001"
    raw = bytearray(fs.cat_file(part))
    raw[100] ^= 0xFF
    fs.pipe_file(part, bytes(raw))
    with ckpt.Checkpointer(
        storage=ckpt.Storage(url=url, storage_options=opts, local_dir=tmp_path / "b")
    ) as ck:
        with pytest.raises(ckpt.CorruptCheckpointError, match="part-000001"):
            ck.remote.verify(2)
        target = _target()
        with pytest.warns(RuntimeWarning, match="part-000001"):
            assert ck.restore(target) == 1
    assert _same(target, _state(1.0))
    assert not (tmp_path / "b" / "step-000000002").exists()


@pytest.mark.s3
def test_an_outage_in_the_middle_of_a_multipart_upload_leaves_the_previous_checkpoint(tmp_path, s3_bucket):
    """16 MiB chunks: pyarrow uploads each part as a multipart upload of its own; every part number from 2
    on fails (an outage after the first 10 MB of each), and the store stays down for our own check too."""
    bucket, port = s3_bucket
    proxy = FaultProxy(port)
    try:
        url = f"s3://{bucket}/run"
        opts = storage_options(
            proxy.port, backend="arrow", config_kwargs={"retries": {"max_attempts": 2, "mode": "standard"}}
        )
        big = {"w": torch.arange(5 << 20, dtype=torch.float32), "step": 1}  # 20 MiB: two chunks
        with knobs.override(CKPT_CHUNK_BYTES=16 << 20):
            with ckpt.Checkpointer(
                storage=ckpt.Storage(url=url, storage_options=opts, local_dir=tmp_path / "a")
            ) as ck:
                ck.save(1, big).wait()
                proxy.faults.fail_parts_from = 2
                proxy.faults.fail_if = lambda method, path: method == "HEAD" and path == "/"  # our own check
                h = ck.save(2, {"w": big["w"] + 1, "step": 2})
                with pytest.raises(ConnectionError, match="previous remote checkpoint is untouched"):
                    h.wait("remote")
                assert proxy.faults.injected >= 1 and h.done("local")
                assert ck.remote.status.available is False
            proxy.faults.fail_parts_from = proxy.faults.fail_if = None
            target = {"w": torch.empty(5 << 20), "step": None}
            with ckpt.Checkpointer(
                storage=ckpt.Storage(
                    url=url, storage_options=storage_options(port, backend="arrow"), local_dir=tmp_path / "b"
                )
            ) as ck:
                assert ck.remote.committed_steps() == [1]
                assert ck.restore(target) == 1 and ck.last_restore.tier == "remote"
        assert target["step"] == 1 and torch.equal(target["w"], big["w"])
    finally:
        proxy.close()


# -- our own reachability check (pyarrow's S3 errors carry no errno) -----------------------------------


def test_the_endpoint_check_says_how_an_endpoint_fails():
    dead = free_port()
    refused = http_answers("http", f"127.0.0.1:{dead}", timeout=2)
    assert isinstance(refused, ConnectionError) and refused.errno == errno.ECONNREFUSED
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        hung = http_answers("http", f"127.0.0.1:{silent.getsockname()[1]}", timeout=1)
    assert isinstance(hung, ConnectionError) and hung.errno == errno.ETIMEDOUT


@pytest.mark.s3
@pytest.mark.parametrize("status, expect", [(503, errno.EBUSY), (500, errno.EREMOTEIO), (403, None)])
def test_the_endpoint_check_counts_5xx_as_down_and_other_answers_as_up(s3_server, status, expect):
    assert http_answers("http", f"127.0.0.1:{s3_server}") is None
    proxy = FaultProxy(s3_server)
    proxy.faults.fail_status, proxy.faults.fail_next = status, 10
    try:
        found = http_answers("http", f"127.0.0.1:{proxy.port}", timeout=5)
        assert (found.errno if found is not None else None) == expect
    finally:
        proxy.close()


@pytest.mark.s3
def test_translate_types_only_errno_less_errors_by_our_own_check(s3_server):
    up = resolve("s3://bucket/run", storage_options(s3_server, backend="arrow"))
    plain = OSError("the store said no")
    assert up.translate(plain) is plain  # answered: as it is
    denied = up.translate(plain, probing=True)
    assert isinstance(denied, PermissionError) and denied.errno == errno.EACCES and denied.__cause__ is plain
    typed = FileNotFoundError(errno.ENOENT, "gone")
    assert up.translate(typed) is typed  # a type of its own: untouched
    down = resolve("s3://bucket/run", storage_options(free_port(), backend="arrow"))
    lost = down.translate(plain)
    assert isinstance(lost, ConnectionError) and lost.errno == errno.ECONNREFUSED
    assert "endpoint_url='http://127.0.0.1:" in str(lost)
    s3fs_store = resolve("s3://bucket/run", storage_options(s3_server))
    assert s3fs_store.translate(plain) is plain  # s3fs's errors are typed already


# -- HDFS ----------------------------------------------------------------------------------------------


def _fake_hadoop(root: Path, java: bool, libhdfs: bool, jars: bool) -> dict[str, str]:
    """An environment pointing at folders that hold (empty) files named as a JDK, libhdfs and Hadoop's jars."""
    env = {"PATH": os.environ.get("PATH", "")}
    if java:
        (root / "jdk" / "lib" / "server").mkdir(parents=True)
        (root / "jdk" / "lib" / "server" / "libjvm.so").write_bytes(b"")
        env["JAVA_HOME"] = str(root / "jdk")
    else:
        (root / "empty-jdk").mkdir()
        env["JAVA_HOME"] = str(root / "empty-jdk")
    if libhdfs:
        (root / "hadoop" / "lib" / "native").mkdir(parents=True)
        (root / "hadoop" / "lib" / "native" / "libhdfs.so").write_bytes(b"")
        env["HADOOP_HOME"] = str(root / "hadoop")
    if jars:
        (root / "jars").mkdir()
        (root / "jars" / "hadoop-common-3.4.1.jar").write_bytes(b"")
        env["CLASSPATH"] = f"{root / 'conf'}:{root / 'jars'}/*"
    return env


@pytest.mark.parametrize(
    "java, libhdfs, jars",
    [
        (False, False, False),
        (True, False, False),
        (True, True, False),
        (False, True, True),
        (True, True, True),
    ],
)
def test_what_pyarrows_hdfs_client_lacks_is_found_by_looking(tmp_path, java, libhdfs, jars):
    env = _fake_hadoop(tmp_path, java, libhdfs, jars)
    expect = tuple(n for n, have in (("java", java), ("libhdfs", libhdfs), ("hadoop-jars", jars)) if not have)
    assert hdfs_arrow_missing(env) == expect


def test_a_hadoop_common_jar_named_directly_on_classpath_counts(tmp_path):
    jar = tmp_path / "hadoop-common-3.3.6.jar"
    jar.write_bytes(b"")
    assert "hadoop-jars" not in hdfs_arrow_missing({"CLASSPATH": f"/nowhere:{jar}"})
    assert "hadoop-jars" in hdfs_arrow_missing(
        {"CLASSPATH": f"{tmp_path / 'hadoop-common-9.jar'}"}
    )  # not there


_OPEN_HDFS = (
    "import sys\n"
    "from ckpt.fs import MissingBackendError\n"
    "import ckpt\n"
    "try:\n"
    "    ckpt.tiers.RemoteTier(sys.argv[1])\n"
    "except MissingBackendError as e:\n"
    "    print(','.join(e.missing)); print(e)\n"
)


@pytest.mark.parametrize("real_java", [False, True])
def test_hdfs_without_libhdfs_is_an_import_error_naming_what_to_install(tmp_path, real_java):
    """In a process of its own (pyarrow loads libjvm once per process); with this machine's real JDK the
    JVM is found and libhdfs is not, as on a host with Java but no Hadoop."""
    jdk = (
        next(
            (p for p in sorted(Path("/usr/lib/jvm").glob("*")) if (p / "lib/server/libjvm.so").is_file()),
            None,
        )
        if Path("/usr/lib/jvm").is_dir()
        else None
    )
    if real_java and jdk is None:
        pytest.skip("no JDK on this machine")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("JAVA_HOME", "HADOOP_HOME", "CLASSPATH", "ARROW_LIBHDFS_DIR", "CKPT_HDFS_BACKEND")
    }
    env["JAVA_HOME"] = str(jdk) if real_java else str(tmp_path)
    env["PYTHONPATH"] = str(HERE.parent)
    out = subprocess.run(
        [sys.executable, "-c", _OPEN_HDFS, "hdfs://namenode.example:8020/ckpt/run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    missing, message = out.stdout.split("\n", 1)
    assert missing == ("libhdfs,hadoop-jars" if real_java else "java,libhdfs,hadoop-jars")
    assert "hdfs://namenode.example:8020/ckpt/run" in message and "libhdfs.so" in message
    assert "pip install hdfs-native" in message and "CLASSPATH" in message
    assert ("JAVA_HOME" in message) is not real_java


def test_hdfs_urls_route_to_pyarrow_by_default_and_hdfs_native_when_asked(monkeypatch):
    hdfs_native = pytest.importorskip("hdfs_native.fsspec")
    store = resolve("hdfs://127.0.0.1:9/ckpt/run", {"backend": "hdfs-native"})
    assert store.backend == "hdfs-native" and isinstance(store.fs, hdfs_native.HdfsFileSystem)
    assert store.root == "/ckpt/run" and store.endpoint == "namenode 127.0.0.1:9"
    monkeypatch.setenv("CKPT_HDFS_BACKEND", "hdfs-native")
    assert resolve("hdfs://127.0.0.1:9/ckpt/run").backend == "hdfs-native"
    monkeypatch.setenv("CKPT_HDFS_BACKEND", "arrow")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # the default client, shown by what it needs
    monkeypatch.setitem(sys.modules, "pyarrow.fs", None)
    with pytest.raises(MissingBackendError) as ei:
        resolve("hdfs://127.0.0.1:9/ckpt/run")
    assert ei.value.backend == "arrow" and ei.value.missing == ("pyarrow",)


def test_a_missing_hdfs_native_names_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "hdfs_native", None)
    monkeypatch.setitem(sys.modules, "hdfs_native.fsspec", None)
    with pytest.raises(MissingBackendError) as ei:
        ckpt.tiers.RemoteTier("hdfs://namenode:8020/ckpt", {"backend": "hdfs-native"})
    assert ei.value.missing == ("hdfs-native",) and "pip install hdfs-native" in str(ei.value)


@pytest.mark.timeout(120)  # a hang detector: the probe is bounded whatever the client does
def test_an_unreachable_namenode_is_a_connection_error_naming_it(tmp_path):
    pytest.importorskip("hdfs_native")
    dead = free_port()
    url, opts = f"hdfs://127.0.0.1:{dead}/ckpt/run", {"backend": "hdfs-native"}
    with knobs.override(CKPT_REMOTE_PROBE_S=2):
        with pytest.raises(ConnectionError) as ei:
            ckpt.tiers.RemoteTier(url, opts)
        assert ei.value.errno == errno.ETIMEDOUT and f"namenode 127.0.0.1:{dead}" in str(ei.value)
        with ckpt.Checkpointer(
            storage=ckpt.Storage(url=url, storage_options=opts, local_dir=tmp_path)
        ) as ck:  # a job goes on locally
            assert ck.remote.status.available is False
            h = ck.save(1, _state(1.0))
            h.wait("local")
            with pytest.raises(ConnectionError, match=f"127.0.0.1:{dead}"):
                h.wait("remote")
