import hashlib
import os
import zipfile

import pytest
import torch

from trainscale.runtime import checkpoint_io
from trainscale.runtime.checkpoint_io import CheckpointError


def test_round_trip_with_checksum(tmp_path):
    path = tmp_path / "a" / "ckpt.pt"
    checkpoint_io.save_file({"w": torch.arange(5.0), "epoch": 3}, path)
    assert os.listdir(path.parent) == ["ckpt.pt"]  # the digest is inside: one file, as a listing expects
    recorded, actual = checkpoint_io.embedded_digest(path.read_bytes())
    assert recorded == actual and len(recorded) == 64
    assert torch.load(path, weights_only=True)["epoch"] == 3  # plain torch reads it (the digest is a zip comment)
    assert zipfile.ZipFile(path).comment.startswith(b"trainscale-sha256:")
    out = checkpoint_io.load_file(path)
    assert out["epoch"] == 3 and torch.equal(out["w"], torch.arange(5.0))
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")], "temporary file left behind"


def test_an_entry_torch_cannot_pickle_is_named_and_nothing_is_written(tmp_path):
    """Was pickle's AttributeError from deep in torch.save, naming no entry."""
    from torch import nn

    from trainscale import Runtime

    rt = Runtime(accelerator="cpu", devices=1)
    model, _ = rt.setup(nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"checkpoint entry 'score' cannot be saved \(Can't pickle local object"):
        rt.save(tmp_path / "ckpt.pt", {"model": model, "step": 3, "score": lambda: 1.0})
    assert list(tmp_path.iterdir()) == []  # no file, no checksum, no temporary file
    with pytest.raises(TypeError, match="setup takes the model as a torch.nn.Module, got str"):
        rt.setup("model")


def test_missing_file_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="ckpt_path='last'"):
        checkpoint_io.load_file(tmp_path / "nope.pt")


def test_truncated_file_is_detected(tmp_path):
    path = tmp_path / "ckpt.pt"
    checkpoint_io.save_file({"w": torch.randn(1000)}, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="records no SHA-256 .* corrupted or truncated"):
        checkpoint_io.load_file(path)
    path.write_bytes(data[:-100] + data[-99:])  # a byte lost before the digest: the digest no longer matches
    with pytest.raises(CheckpointError, match="records no SHA-256|corrupted or truncated"):
        checkpoint_io.load_file(path)


def test_a_file_with_the_former_checksum_file_beside_it_still_verifies(tmp_path):
    """Checkpoints written before the digest moved inside have ``<name>.sha256`` beside them."""
    path = tmp_path / "old.pt"
    torch.save({"w": torch.ones(2)}, path)
    (tmp_path / "old.pt.sha256").write_text(hashlib.sha256(path.read_bytes()).hexdigest() + "\n")
    assert torch.equal(checkpoint_io.load_file(path)["w"], torch.ones(2))
    path.write_bytes(path.read_bytes()[:-1] + b"\x01")
    with pytest.raises(CheckpointError, match="corrupted or truncated"):
        checkpoint_io.load_file(path)


def test_garbage_without_checksum_is_a_clear_error(tmp_path):
    path = tmp_path / "ckpt.pt"
    path.write_bytes(os.urandom(300))
    with pytest.raises(CheckpointError, match="cannot be read"):
        checkpoint_io.load_file(path, verify=False)


def test_weights_only_refuses_arbitrary_objects(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"obj": _Evil()}, path)
    with pytest.raises(CheckpointError, match=r"holds objects that a weights-only load .* refuses, such as "
                                              r"tests\.test_checkpoint_io\._Evil"):
        checkpoint_io.load_file(path, verify=False)


def test_a_checkpoint_without_its_digest_is_refused_unless_verify_false(tmp_path):
    from trainscale.runtime.runtime import Runtime

    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.fill_(1.0)
    rt = Runtime(accelerator="cpu", devices=1)
    rt.save(tmp_path / "c.pt", {"model": model})
    data = bytearray((tmp_path / "c.pt").read_bytes())
    data[data.index(torch.ones(6).numpy().tobytes()) + 2] ^= 0x40  # a flipped bit: weight[0, 0] 1.0 -> 1.5
    for load in (lambda: checkpoint_io.load_file(tmp_path / "c.pt"),
                 lambda: rt.load(tmp_path / "c.pt", {"model": torch.nn.Linear(3, 2)})):
        (tmp_path / "c.pt").write_bytes(bytes(data))
        with pytest.raises(CheckpointError, match="is corrupted or truncated"):
            load()
        (tmp_path / "c.pt").write_bytes(bytes(data[:-82]))  # the digest cut off (a copy that stopped short)
        with pytest.raises(CheckpointError, match="records no SHA-256.*verify=False"):
            load()
    restored = torch.nn.Linear(3, 2)
    rt.load(tmp_path / "c.pt", {"model": restored}, verify=False)  # the explicit opt-out loads it as it is
    assert restored.weight[0, 0].item() == 1.5 and restored.weight.flatten()[1:].eq(1.0).all()


class _Evil:
    pass


def test_replicated_restores_in_place(tmp_path):
    from trainscale.runtime.world import World

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    checkpoint_io.save_replicated(tmp_path / "c.pt", {"model": model, "opt": opt, "step": 7}, World(), lambda m: m)
    model2 = torch.nn.Linear(3, 2)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    rest = checkpoint_io.load_replicated(tmp_path / "c.pt", {"model": model2, "opt": opt2}, lambda m: m)
    assert rest == {"step": 7}
    assert torch.equal(model.weight, model2.weight)
    assert opt2.state_dict()["state"][0]["momentum_buffer"] is not None
    with pytest.raises(CheckpointError, match="does not fit"):
        checkpoint_io.load_replicated(tmp_path / "c.pt", {"model": torch.nn.Linear(4, 2)}, lambda m: m)


def test_bytes_that_are_not_a_zip_archive_get_their_digest_beside_them(tmp_path, monkeypatch):
    """torch's legacy format (or a replaced torch.save) has no archive comment to hold the digest."""
    monkeypatch.setattr(torch, "save", lambda obj, f: f.write(b"legacy bytes"))
    path = tmp_path / "old.pt"
    checkpoint_io.save_file({"w": 1}, path)
    assert sorted(os.listdir(tmp_path)) == ["old.pt", "old.pt.sha256"]
    assert checkpoint_io.read_checked(path) == b"legacy bytes"
    path.write_bytes(b"legacy bytez")
    with pytest.raises(CheckpointError, match="corrupted or truncated"):
        checkpoint_io.read_checked(path)
