import os

import pytest


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch):
    """Tests start outside any launcher, whatever the shell that runs pytest has set."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID",
                 *(k for k in os.environ if k.startswith("SLURM_"))):  # pytest may run inside a SLURM job
        monkeypatch.delenv(name, raising=False)
    for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):  # trainscale.seed_everything sets them, as Lightning's does:
        monkeypatch.setenv(name, "")  # recorded first, so that the value from before the test comes back after it
        monkeypatch.delenv(name)
    yield
    import torch.distributed as dist

    assert not (dist.is_available() and dist.is_initialized()), "a test leaked a process group"


# The heaviest files first (about their order of seconds in a full run here): xdist hands whole files to its two
# workers (--dist loadfile, --no-loadscope-reorder), so when the last file starts, the other worker may have nothing
# left to do; small files last keep that idle tail short. Any file not named keeps pytest's order after these.
HEAVY_FIRST = ("test_docs_examples.py", "test_launchers.py", "test_benchmarks.py", "test_pipeline.py",
               "test_bench_sweep.py", "test_gpu_check.py", "test_fault_tolerance.py", "test_plan.py",
               "test_training_module.py", "test_cli.py", "test_ddp_spawn.py", "test_run_cli.py",
               "test_model_parallel.py", "test_huggingface.py", "test_check.py", "test_ddp_notebook.py",
               "test_plan_layouts.py", "test_checkpoint_layouts.py", "test_plan_memory.py", "test_model_transforms.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's tests keep their order
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
