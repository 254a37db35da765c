"""The fault layer itself (tests/faults.py) does what the torture tests rely on: unsynced writes
and directory changes can be lost, synced ones cannot, a failed fsync loses its data for good, and
the faults fire at the operation they were set for."""

from __future__ import annotations

import errno

import pytest

from faults import Crash, FaultyIO
from kvstore import fileio
from kvstore.fileio import io, write_durable


def write(path, data: bytes, *, sync: bool = True, offset: int = 0) -> None:
    fd = io.open(path, create=True)
    io.pwrite(fd, data, offset)
    if sync:
        io.fsync(fd)
    io.close(fd)


@pytest.mark.parametrize("mode,expected", [("keep", b"new!"), ("drop", b"old!")])
def test_an_unsynced_write_is_kept_or_dropped(tmp_path, mode, expected):
    (tmp_path / "f").write_bytes(b"old!")
    fs = FaultyIO()
    with fileio.use(fs):
        write(tmp_path / "f", b"new!", sync=False)
    fs.power_loss(data=mode, dirs="keep")
    assert (tmp_path / "f").read_bytes() == expected


def test_a_garbled_write_replaces_whole_sectors_and_nothing_else(tmp_path):
    durable = bytes(range(256)) * 8  # 2048 bytes, 4 sectors
    (tmp_path / "f").write_bytes(durable)
    fs = FaultyIO(seed=3)
    with fileio.use(fs):
        write(tmp_path / "f", b"x" * 100, sync=False, offset=600)
    fs.power_loss(data="garble", dirs="keep")
    after = (tmp_path / "f").read_bytes()
    assert after[:512] == durable[:512] and after[1024:] == durable[1024:]
    assert after[512:1024] != durable[512:1024] and b"x" * 100 not in after


def test_a_synced_write_survives_and_an_unsynced_create_is_undone(tmp_path):
    fs = FaultyIO()
    with fileio.use(fs):
        io.mkdir(tmp_path / "d")
        write(tmp_path / "d" / "a", b"synced")
        io.fsync_dir(tmp_path / "d")
        write(tmp_path / "d" / "b", b"synced, but its name is not")
        io.fsync_dir(tmp_path)
    fs.power_loss(data="drop", dirs="undo")
    assert (tmp_path / "d" / "a").read_bytes() == b"synced"
    assert not (tmp_path / "d" / "b").exists()


def test_an_unsynced_mkdir_takes_its_contents_with_it(tmp_path):
    fs = FaultyIO()
    with fileio.use(fs):
        io.mkdir(tmp_path / "d")
        write(tmp_path / "d" / "a", b"x")
        io.fsync_dir(tmp_path / "d")
    fs.power_loss(data="keep", dirs="undo")
    assert not (tmp_path / "d").exists()


def test_an_unsynced_rename_brings_back_the_file_it_replaced(tmp_path):
    (tmp_path / "target").write_bytes(b"before")
    fs = FaultyIO()
    with fileio.use(fs):
        write_durable(tmp_path / "target", b"after")  # fsyncs the directory: durable
        assert (tmp_path / "target").read_bytes() == b"after"
        write(tmp_path / "tmp", b"third")
        io.rename(tmp_path / "tmp", tmp_path / "target")
    fs.power_loss(data="keep", dirs="undo")
    assert (tmp_path / "target").read_bytes() == b"after"
    assert not (tmp_path / "tmp").exists()  # its create is undone too


def test_an_unsynced_unlink_is_undone_with_the_file_bytes(tmp_path):
    (tmp_path / "f").write_bytes(b"keep me")
    fs = FaultyIO()
    with fileio.use(fs):
        io.unlink(tmp_path / "f")
    fs.power_loss(dirs="undo")
    assert (tmp_path / "f").read_bytes() == b"keep me"


def test_a_failed_fsync_loses_the_data_even_if_a_later_fsync_succeeds(tmp_path):
    (tmp_path / "f").write_bytes(b"old!")
    fs = FaultyIO()
    with fileio.use(fs):
        fd = io.open(tmp_path / "f")
        io.pwrite(fd, b"new!", 0)
        fs.fail(len(fs.log), errno.EIO)
        with pytest.raises(OSError) as e:
            io.fsync(fd)
        assert e.value.errno == errno.EIO
        io.fsync(fd)  # "succeeds": the dirty pages were dropped, nothing is written
        assert (tmp_path / "f").read_bytes() == b"new!"  # the page cache still shows it
        io.close(fd)
    fs.power_loss(data="keep", dirs="keep")
    assert (tmp_path / "f").read_bytes() == b"old!"


def test_a_crash_at_a_sync_stops_every_later_call(tmp_path):
    fs = FaultyIO().crash_at_sync(1)
    with fileio.use(fs):
        write(tmp_path / "a", b"1")
        with pytest.raises(Crash):
            write(tmp_path / "b", b"2")
        with pytest.raises(Crash):
            io.exists(tmp_path / "a")
    fs.power_loss(data="keep", dirs="keep")
    with fileio.use(fs):
        assert io.exists(tmp_path / "a")


def test_sticky_enospc_fails_only_what_needs_space_until_healed(tmp_path):
    (tmp_path / "f").write_bytes(b"x")
    fs = FaultyIO().fail(0, errno.ENOSPC, sticky=True)
    with fileio.use(fs):
        for _ in range(2):
            with pytest.raises(OSError, match="No space"):
                io.open(tmp_path / "g", create=True)
        assert io.read_file(tmp_path / "f") == b"x"
        io.unlink(tmp_path / "f")
        fs.heal()
        write(tmp_path / "g", b"y")
    assert fs.log[0] == ("create", str(tmp_path / "g"))


def test_hooks_run_before_their_operation(tmp_path):
    seen = []
    fs = FaultyIO().hook(1, lambda: seen.append(io.exists(tmp_path / "a")))
    with fileio.use(fs):
        write(tmp_path / "a", b"1")  # ops: create(0), pwrite(1), ...
    assert seen == [True]
