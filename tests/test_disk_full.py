"""Saving onto a full disk, stale temporaries, filesystems that cannot fsync a directory, sharded checkpoints
with a missing or damaged shard file (runtime/checkpoint_io.py, checkpointing/run_dirs.py, the fsdp strategy's
save and load)."""

from __future__ import annotations

import errno
import os
import stat

import pytest
import torch
from torch.utils.data import DataLoader

from tests import workers
from tests.helpers import run_distributed
from trainscale.runtime import checkpoint_io
from trainscale.runtime.checkpoint_io import CheckpointError
from trainscale.checkpointing import run_dirs as ckpt


def _disk_full_at(kind: str, save_number: int = 1):
    """A ``_write_event`` that raises ENOSPC in the ``save_number``-th checkpoint write, while the file holds part
    of its bytes (``kind`` "ckpt") or all but its digest ("digest"), as a real full disk does mid-write."""
    seen = {"ckpt": 0}

    def event(stage, path):
        if path.name in ("job_id", "script", "resumed_from", "last") or path.name.endswith(".sha256"):
            return  # the run directory's own small files, a sharded checkpoint's manifest
        if stage == "partial":
            seen["ckpt"] += 1
        if seen["ckpt"] == save_number and stage == ("partial" if kind == "ckpt" else "digest"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return event


def _fit(root, **flags):
    from trainscale.loop.trainer import Trainer

    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=2, seed=0, default_root_dir=root,
                      enable_progress_bar=False, **flags)
    trainer.fit(workers.make_model(0), DataLoader(workers.tiny_dataset(16), batch_size=8), optimizer=workers.sgd)
    return trainer


@pytest.mark.parametrize("kind", ["ckpt", "digest"])
def test_disk_full_during_a_save_names_the_cause_and_place_and_keeps_last(tmp_path, monkeypatch, kind):
    monkeypatch.setattr(checkpoint_io, "_write_event", _disk_full_at(kind, save_number=2))  # the epoch-2 save
    with pytest.raises(CheckpointError, match=r"no space left on device while writing '.*epoch=1-step="
                                              r".*MiB free on the disk holding .*last' still names the previous"):
        _fit(tmp_path)
    ckpt_dir = next(tmp_path.glob("version_*/checkpoints"))
    assert sorted(p.name for p in ckpt_dir.iterdir()) == [
        "epoch=0-step=2.ckpt", "last"]  # no temporary file
    last = ckpt.find_last(tmp_path)
    assert last.name == "epoch=0-step=2.ckpt" and checkpoint_io.load_file(last)["train_state"]["global_step"] == 2


def test_other_write_errors_are_not_called_disk_full(tmp_path, monkeypatch):
    def event(stage, path):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(checkpoint_io, "_write_event", event)
    with pytest.raises(OSError, match="Input/output error"):
        checkpoint_io.save_file({"w": torch.ones(3)}, tmp_path / "c.pt")
    assert list(tmp_path.iterdir()) == []


def test_a_stale_temporary_directory_of_a_killed_sharded_save_does_not_break_later_saves(tmp_path):
    ckpt_dir = tmp_path / "checkpoints"
    stale = ckpt_dir / f".{ckpt.checkpoint_name(1, 6)}.tmp"  # what a killed fsdp save leaves
    (stale / "sub").mkdir(parents=True)
    (stale / "__0_0.distcp").write_bytes(b"x")
    (ckpt_dir / ".epoch=1-step=4.ckpt.abcd.tmp").write_bytes(b"x")  # a killed file save's
    path = ckpt_dir / ckpt.checkpoint_name(2, 12)
    checkpoint_io.save_file({"w": torch.ones(3)}, path)
    ckpt.mark_last(path, ckpt_dir)
    assert sorted(p.name for p in ckpt_dir.iterdir()) == [path.name, "last"]


def test_directory_fsync_einval_of_network_filesystems_is_tolerated(tmp_path, monkeypatch):
    real_fsync = os.fsync

    def fsync(fd, code=errno.EINVAL):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(code, os.strerror(code))  # what fsync(2) of a directory gives on some NFS/CIFS mounts
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    checkpoint_io.save_file({"w": torch.ones(3)}, tmp_path / "c.pt")
    assert torch.equal(checkpoint_io.load_file(tmp_path / "c.pt")["w"], torch.ones(3))
    monkeypatch.setattr(os, "fsync", lambda fd: fsync(fd, errno.EIO))  # a real I/O error still raises
    with pytest.raises(OSError, match="Input/output error"):
        checkpoint_io.save_file({"w": torch.ones(3)}, tmp_path / "d.pt")


def _fsdp_disk_full_body(rank: int, root: str) -> dict:
    from trainscale.runtime.runtime import Runtime

    rt = Runtime(accelerator="cpu", strategy="fsdp", devices="auto", timeout=60)
    model, _ = rt.setup(workers.make_model(0))
    rt.save(f"{root}/good", {"model": model})
    if rank == 0:  # rank 0's extra file meets a full disk; every rank must raise, none may wait
        checkpoint_io._write_event = _disk_full_at("ckpt")
    try:
        rt.save(f"{root}/full", {"model": model})
        error = None
    except CheckpointError as err:
        error = str(err)
    rt.barrier()
    listing = sorted(os.listdir(root))
    rt.teardown()
    return {"error": error, "listing": listing}


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_fsdp_disk_full_raises_on_every_rank_and_removes_the_temporary_directory(tmp_path):
    ranks = run_distributed(_fsdp_disk_full_body, str(tmp_path), timeout=120)
    for out in ranks:
        assert out["error"] is not None and "no space left on device" in out["error"], out
        assert out["listing"] == ["good"]  # no ".full.tmp" left, the earlier checkpoint kept


def _shards_full_on(rank_to_fail: int, rank: int):
    """A ``_write_event`` that raises ENOSPC on ``rank_to_fail`` as DCP starts writing its shards (in the
    background writer thread of an asynchronous save)."""
    def event(stage, path):
        if stage == "writing-shards" and rank == rank_to_fail:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return event


def _caught(call) -> str | None:
    """The message of the CheckpointError that ``call`` raised (None if it returned); any other exception,
    torch's CheckpointException (a BaseException) included, propagates and fails the test."""
    try:
        call()
    except CheckpointError as err:
        return str(err)
    return None


def _dcp_failures_body(rank: int, root: str) -> dict:
    import shutil

    from trainscale.runtime.runtime import Runtime

    rt = Runtime(accelerator="cpu", strategy="fsdp", devices="auto", timeout=60)
    model, _ = rt.setup(workers.make_model(0))
    rt.save(f"{root}/good", {"model": model})
    out = {}
    checkpoint_io._write_event = _shards_full_on(1, rank)  # rank 1's shard write meets a full disk
    out["sync"] = _caught(lambda: rt.save(f"{root}/sync", {"model": model}))
    rt.barrier()
    checkpoint_io._write_event = _shards_full_on(0, rank)  # rank 0's, in the background writer thread
    rt.save(f"{root}/async", {"model": model}, asynchronous=True)
    out["async"] = _caught(rt.wait_for_save)
    checkpoint_io._write_event = lambda stage, path: None
    rt.barrier()
    out["listing"] = sorted(os.listdir(root))
    rt.barrier()
    if rank == 0:
        shutil.copytree(f"{root}/good", f"{root}/missing")
        os.remove(f"{root}/missing/__1_0.distcp")
        shutil.copytree(f"{root}/good", f"{root}/truncated")
        data = open(f"{root}/truncated/__0_0.distcp", "rb").read()
        open(f"{root}/truncated/__0_0.distcp", "wb").write(data[: len(data) // 2])
    rt.barrier()
    out["missing"] = _caught(lambda: rt.load(f"{root}/missing", {"model": model}))
    out["truncated"] = _caught(lambda: rt.load(f"{root}/truncated", {"model": model}, verify=False))
    out.update(_flipped_bits(rank, root, rt, model))
    rt.teardown()
    return out


def _flipped_bits(rank: int, root: str, rt, model) -> dict:
    """Loads of copies of ``root/good`` with one bit flipped in a weight of ``__1_0.distcp`` (read by rank 1
    only), or in ``.metadata``, or without the manifest; verified, and the first unverified."""
    import shutil

    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    if rank == 0:
        for name in ("flipped", "flipped_metadata", "no_manifest"):
            shutil.copytree(f"{root}/good", f"{root}/{name}")
        shard = f"{root}/flipped/__1_0.distcp"
        data = bytearray(open(shard, "rb").read())
        data[len(data) // 2] ^= 0x10  # inside the tensor bytes: torch.load reads it without complaint
        open(shard, "wb").write(bytes(data))
        meta = bytearray(open(f"{root}/flipped_metadata/.metadata", "rb").read())
        meta[-20] ^= 0x01
        open(f"{root}/flipped_metadata/.metadata", "wb").write(bytes(meta))
        os.remove(f"{root}/no_manifest/shards.sha256")
    rt.barrier()
    before = {k: v.full_tensor().clone() for k, v in get_model_state_dict(model).items()}
    out = {name: _caught(lambda: rt.load(f"{root}/{name}", {"model": model}))
           for name in ("good", "flipped", "flipped_metadata", "no_manifest")}
    rt.load(f"{root}/flipped", {"model": model}, verify=False)  # what every load did before the manifest
    after = {k: v.full_tensor() for k, v in get_model_state_dict(model).items()}
    out["unverified_changed"] = sum(int((before[k] != after[k]).sum()) for k in before)
    out["manifest"] = open(f"{root}/good/shards.sha256").read()
    rt.barrier()
    return out


@pytest.fixture(scope="module")
def dcp_damage(tmp_path_factory):
    return run_distributed(_dcp_failures_body, str(tmp_path_factory.mktemp("dcp_damage")), timeout=50)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_sharded_save_and_load_failures_are_clear_errors_on_every_rank(dcp_damage):
    """torch's CheckpointException derives from BaseException: a full disk during a shard write (synchronous or
    in the background) and a missing or truncated shard file must still be clear CheckpointErrors."""
    for out in dcp_damage:
        for save in ("sync", "async"):
            assert out[save] is not None and "no space left on device while writing" in out[save], out
            assert f"/{save}'" in out[save], out
        assert out["listing"] == ["good"], out  # no temporary directory left, nothing published
        assert out["missing"] is not None and "missing its shard file '__1_0.distcp'" in out["missing"], out
        assert "copy the whole checkpoint directory" in out["missing"]
        assert out["truncated"] is not None and "'__0_0.distcp'" in out["truncated"], out
        assert "cannot be read" in out["truncated"] and "earlier checkpoint" in out["truncated"]


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_flipped_bit_in_a_sharded_checkpoint_is_refused_naming_the_file(dcp_damage):
    """Every DCP checkpoint carries the SHA-256 of each of its files (shards.sha256, `sha256sum -c` format); a load
    verifies .metadata and the shards each rank reads, and refuses a mismatch (on every rank, naming the file) or a
    checkpoint without the manifest unless verify=False."""
    for out in dcp_damage:
        names = sorted(line.split("  ")[1] for line in out["manifest"].splitlines())
        assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "trainscale_extra.pt"], out["manifest"]
        assert out["good"] is None
        assert out["flipped"] is not None and "'__1_0.distcp' is corrupted" in out["flipped"], out
        assert "'.metadata' is corrupted" in out["flipped_metadata"], out
        assert "no checksum manifest 'shards.sha256'" in out["no_manifest"] and "verify=False" in out["no_manifest"]
        assert out["unverified_changed"] == 1  # unverified, the flipped bit loads silently into one weight


def _one_process_dcp_checkpoint(path):
    import torch.distributed.checkpoint as dcp

    from trainscale.runtime.strategies import dcp_checkpoint

    dcp.save({"model": {"w": torch.arange(64.0)}}, storage_writer=dcp_checkpoint._shard_writer(path), no_dist=True)
    return next(path.glob("*.distcp"))


@pytest.mark.parametrize("verify", [True, False])
def test_a_flipped_bit_in_a_shard_read_whole_is_a_checkpoint_error_not_torchs_base_exception(tmp_path, verify):
    """torch's CheckpointException derives from BaseException: `except Exception` (and `except CheckpointError`)
    would miss it, as the whole-model read of `load_from_checkpoint` and `trainscale export` let it through."""
    from trainscale.runtime.strategies import dcp_checkpoint

    shard = _one_process_dcp_checkpoint(tmp_path / "ckpt")
    data = bytearray(shard.read_bytes())
    shard.write_bytes(bytes(data[: len(data) // 2]))  # truncated: unreadable whether or not the bytes are checked
    with pytest.raises(CheckpointError, match="ckpt"):
        dcp_checkpoint.read_whole(tmp_path / "ckpt", "model", verify=verify)


def test_a_short_write_of_torchs_zip_writer_in_a_sharded_save_is_named_a_full_disk(tmp_path):
    """A full disk under `dcp.save` surfaces as torch's "unexpected pos 64 vs 0" (its zip writer's check) inside a
    CheckpointException; the message names the disk, its free space and the fixes, as a full disk elsewhere does."""
    from torch.distributed.checkpoint.api import CheckpointException

    from trainscale.runtime.strategies import dcp_checkpoint

    err = CheckpointException("save", {0: RuntimeError("[enforce fail at inline_container.cc:778] . unexpected pos "
                                                         "64 vs 0")})
    clear = dcp_checkpoint._clear_error(err, tmp_path / "epoch=1", "the write failed")
    assert isinstance(clear, CheckpointError)
    assert "no space left on device while writing" in str(clear) and "unexpected pos 64 vs 0" in str(clear)
    assert "MiB free" in str(clear) and "default_root_dir" in str(clear)


def test_a_filesystem_that_refuses_chmod_still_gets_the_checkpoint(tmp_path, monkeypatch):
    def chmod(path, mode, code=errno.EPERM):
        raise PermissionError(code, os.strerror(code))  # what chmod(2) gives on a CIFS mount or a FUSE bucket

    monkeypatch.setattr(os, "chmod", chmod)
    checkpoint_io.save_file({"w": torch.ones(3)}, tmp_path / "c.pt")
    assert torch.equal(checkpoint_io.load_file(tmp_path / "c.pt")["w"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt"]  # no temporary file left
    monkeypatch.setattr(os, "chmod", lambda path, mode: chmod(path, mode, errno.EIO))  # a real I/O error raises
    with pytest.raises(OSError, match="Input/output error"):
        checkpoint_io.save_file({"w": torch.ones(3)}, tmp_path / "d.pt")
