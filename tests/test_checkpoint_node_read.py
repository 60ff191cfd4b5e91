"""A ddp checkpoint file is read once per node: 4 real ranks as 2 nodes × 2 (torchrun's variables), each
counting its opens of the file while the Runtime loads it; the node's other rank gets the bytes from its
local rank 0, and a corrupted file fails on every rank (none waits)."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.helpers import run_distributed

pytestmark = pytest.mark.multiprocess


def _resume_counting_opens(rank: int, root: str) -> dict:
    os.environ.update(LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2", GROUP_RANK=str(rank // 2), GROUP_WORLD_SIZE="2")
    from trainscale import Runtime
    from trainscale.runtime.checkpoint_io import CheckpointError

    rt = Runtime(accelerator="cpu", strategy="ddp", timeout=30)  # devices="auto": 2 per node, 2 nodes
    torch.manual_seed(0)
    model, optimizer = rt.setup(nn.Linear(4, 3), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    path = Path(root) / "ckpt.pt"
    rt.save(path, {"model": model, "optimizer": optimizer, "step": 7})
    saved = {k: v.clone() for k, v in model.module.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(rank + 1.0)  # every rank's weights now differ from the checkpoint's
    opened = []
    real_open = io.open

    def counting_open(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and os.fspath(file) in (str(path), f"{path}.sha256"):
            opened.append(Path(file).name)
        return real_open(file, *args, **kwargs)

    io.open = counting_open
    try:
        rest = rt.load(path, {"model": model, "optimizer": optimizer})
    finally:
        io.open = real_open
    restored = all(torch.equal(v, saved[k]) for k, v in model.module.state_dict().items())
    rt.barrier()
    if rank == 0:  # flip one byte: the checksum fails on local rank 0, and its node's rank 1 hears why
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    rt.barrier()
    try:
        rt.load(path, {"model": model, "optimizer": optimizer})
        corrupt = "loaded"
    except CheckpointError as err:
        corrupt = str(err)
    rt.teardown()
    return {"opened": opened, "step": rest["step"], "restored": restored, "corrupt": corrupt}


@pytest.mark.timeout(60)
def test_a_ddp_checkpoint_is_read_once_per_node(tmp_path):
    results = run_distributed(_resume_counting_opens, str(tmp_path), world_size=4, timeout=50)
    # local ranks 0 (ranks 0 and 2) open the file (its digest inside) once; ranks 1 and 3 never
    assert [r["opened"] for r in results] == [["ckpt.pt"], [], ["ckpt.pt"], []]
    assert all(r["restored"] and r["step"] == 7 for r in results)
    assert all("corrupted or truncated" in r["corrupt"] for r in results)
    assert "local rank 0 of this node (rank 0)" in results[1]["corrupt"]
    assert "local rank 0 of this node (rank 2)" in results[3]["corrupt"]
