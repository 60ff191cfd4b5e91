import os

import pytest


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch):
    """Tests start outside any launcher, whatever the shell that runs pytest has set."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID",
                 *(k for k in os.environ if k.startswith("SLURM_"))):  # pytest may run inside a SLURM job
        monkeypatch.delenv(name, raising=False)
    yield
    import torch.distributed as dist

    assert not (dist.is_available() and dist.is_initialized()), "a test leaked a process group"


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
