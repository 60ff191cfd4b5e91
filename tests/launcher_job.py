"""The tiny ddp job of the launcher tests (tests/test_launchers.py): whatever started it (Kubernetes pods, mpirun,
jsrun, Ray Train), ``Trainer(devices="auto")`` on a fixed seed must end with the weights of the same job on ranks
given torchrun's variables (:func:`forked_rank`, forked by tests/helpers.py ``run_distributed``; ranks forked with
an MPI flavour's variables run it too).

    python tests/launcher_job.py OUT.pt ROOT_DIR         # rank 0 saves the final weights to OUT.pt
    python tests/launcher_job.py --ray OUT.pt ROOT_DIR   # the same in Ray Train's TorchTrainer, 2 CPU workers
"""

import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainscale import Trainer, World


def train(root: str) -> tuple[World, dict]:
    """Fit the job; print the world the Trainer found; return that world and the final weights."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    y = (x.sum(1) > 0).long()
    torch.manual_seed(0)  # the model's initial weights (DDP then broadcasts rank 0's)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    trainer = Trainer(accelerator="cpu", devices="auto", strategy="ddp", max_steps=4, seed=0, timeout=60,
                      default_root_dir=root, enable_progress_bar=False, enable_checkpointing=False,
                      enable_telemetry=False, handle_signals=False)
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True),
                optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    world = trainer.runtime.world
    print(f"RANK {world.rank} OF {world.world_size} LAUNCHER {world.launcher} FROM {world.detected_from}", flush=True)
    return world, {k: v.detach().clone() for k, v in model.state_dict().items()}


def save_weights(out: str, root: str) -> None:
    world, weights = train(root)
    if world.rank == 0:
        torch.save(weights, out)


def forked_rank(rank: int, root: str) -> tuple[str, dict]:
    """One rank forked by ``run_distributed(forked_rank, root, world_size=N)``: the variables its world was read
    from (``World.detected_from``) and the final weights."""
    world, weights = train(root)
    return world.detected_from, weights


def _ray_worker(config: dict) -> None:
    save_weights(config["out"], config["root"])


def train_with_ray(out: str, root: str) -> None:
    """Ray Train starts 2 CPU workers and creates their gloo process group before ``train`` runs."""
    import ray

    # Ray's daemons start while this process imports Ray Train. No idle workers started ahead for this driver (Ray
    # starts one per CPU by default): Ray Train's actors and workers get workers of their own anyway.
    ray.init(num_cpus=2, include_dashboard=False, _system_config={"prestart_worker_first_driver": False})
    try:
        from ray.train import RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer

        TorchTrainer(_ray_worker, train_loop_config={"out": out, "root": root},
                     scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                     run_config=RunConfig(storage_path=f"{root}/ray")).fit()
    finally:
        ray.shutdown()


if __name__ == "__main__":
    if sys.argv[1] == "--ray":
        train_with_ray(sys.argv[2], sys.argv[3])
    else:
        save_weights(sys.argv[1], sys.argv[2])
