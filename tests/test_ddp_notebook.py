"""strategy="ddp_notebook" (fork) and "ddp_spawn" (spawn, cloudpickle) from code that lives in ``__main__``
without a file, as in a notebook: a model class, a lambda optimizer factory and a lambda loss defined there.

Run as ``python -c CODE`` (``__main__`` has no file, as in a notebook) and as a cell of a real Jupyter
kernel (nbclient + ipykernel, the ``test`` extra). Parity: the weights equal those of one process
trained on the same samples with the double batch, as for ddp."""

import json

import pytest
import torch

from tests.helpers import run_python
from trainscale.runtime.connector import resolve

pytestmark = pytest.mark.multiprocess

# What a user types into a notebook. The big matmul makes the parent run an OpenMP parallel region on 2 threads
# before the fork: a forked child that then runs one on more than one thread hangs in GNU OpenMP (trainscale gives
# forked ranks one thread; the last launch checks it with a matmul of its own).
NOTEBOOK_CODE = """
import copy, json
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
from trainscale.runtime.runtime import Runtime
from trainscale.loop.trainer import Trainer

torch.set_num_threads(2)
(torch.randn(512, 512) @ torch.randn(512, 512)).sum()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


data = TensorDataset(torch.randn(96, 8, generator=torch.Generator().manual_seed(0)),
                     torch.randint(0, 3, (96,), generator=torch.Generator().manual_seed(1)))
make_optimizer = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)
loss_fn = lambda out, y: F.cross_entropy(out, y)


def reference(model, epochs, batch_size):
    # one process over DistributedSampler's order (seed 0 + epoch), with the batch of both ranks together
    optimizer = make_optimizer(model.parameters())
    for epoch in range(epochs):
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(epoch))
        for start in range(0, len(data), batch_size):
            x, y = data[order[start:start + batch_size]]
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()
    return model


def fit(strategy):
    torch.manual_seed(1)
    model = Net()
    start = copy.deepcopy(model)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=2, seed=0, timeout=60,
                      enable_progress_bar=False, default_root_dir="runs")
    trainer.fit(model, DataLoader(data, batch_size=8, shuffle=True), optimizer=make_optimizer, loss_fn=loss_fn)
    expected = reference(start, 2, 16).state_dict()
    trained = model.state_dict()
    return {"max_abs_diff": max((trained[k] - expected[k]).abs().max().item() for k in expected),
            "moved": min((trained[k] - initial[k]).abs().max().item() for k in expected)}


result = {strategy: fit(strategy) for strategy in STRATEGIES}
notebook_runtime = Runtime(accelerator="cpu", devices=2, strategy="ddp_notebook", timeout=60)
result["launch_lambda"] = notebook_runtime.launch(lambda rt: rt.all_reduce(torch.tensor(float(rt.rank + 1))).item())
result["forked_matmul_threads"] = notebook_runtime.launch(
    lambda rt: ((torch.randn(512, 512) @ torch.randn(512, 512)).sum().item(), torch.get_num_threads())[1])
"""


def _check(result: dict, strategies) -> None:
    for strategy in strategies:
        assert result[strategy]["moved"] > 1e-3, strategy  # training changed every tensor...
        assert result[strategy]["max_abs_diff"] < 1e-5, (strategy, result)  # ...as one process with batch 16 does
    assert result["launch_lambda"] == 3.0  # 1 + 2: both forked ranks ran the lambda
    assert result["forked_matmul_threads"] == 1  # with the parent's 2 OpenMP threads, a forked matmul hung


@pytest.mark.timeout(300)
def test_main_without_file_trains_under_ddp_notebook_and_ddp_spawn(tmp_path):
    strategies = ("ddp_notebook", "ddp_spawn")
    code = f"STRATEGIES = {strategies!r}\n{NOTEBOOK_CODE}\nprint('RESULT', json.dumps(result))\n"
    out, _ = run_python(["-c", code], tmp_path, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))
    _check(json.loads(line[len("RESULT "):]), strategies)
    assert not list((tmp_path / "tmp").glob("trainscale-spawn-*"))  # the payload directory is removed


@pytest.mark.timeout(300)
def test_a_jupyter_kernel_cell_trains_under_ddp_notebook(tmp_path, monkeypatch):
    """ddp_notebook is the strategy a notebook runs; ddp_spawn's pickling of ``__main__``'s objects is the same from
    a kernel cell as from ``python -c`` (no file behind ``__main__`` either way), which the test above runs."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    from pathlib import Path

    src = str(Path(__file__).resolve().parents[1] / "src")
    monkeypatch.setenv("PYTHONPATH", src)  # the kernel is a new process
    strategies = ("ddp_notebook",)
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(f"STRATEGIES = {strategies!r}"),
                                               nbformat.v4.new_code_cell(NOTEBOOK_CODE),
                                               nbformat.v4.new_code_cell("print(json.dumps(result))")])
    nbclient.NotebookClient(notebook, timeout=240, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    printed = "".join(o.get("text", "") for o in notebook.cells[-1].outputs if o.get("name") == "stdout")
    _check(json.loads(printed), strategies)


def test_fork_is_refused_once_cuda_is_initialised(monkeypatch):
    from trainscale.runtime import spawn

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match=r"strategy='ddp_notebook' starts its processes with fork, but CUDA was "
                                           r"already initialised.*restart the Python kernel, or use "
                                           r"strategy='ddp_spawn'"):
        spawn.run(print, {}, 2, "fork")


@pytest.mark.parametrize("name, start_method", [("ddp_spawn", "spawn"), ("ddp_notebook", "fork"),
                                                ("ddp_fork", "fork"), ("ddp", None)])
def test_start_method_names_resolve_to_ddp_with_a_start_method(name, start_method):
    config = resolve(strategy=name, devices=2)
    assert (config.strategy, config.start_method, config.world_size) == ("ddp", start_method, 2)
    if start_method is not None:
        with pytest.raises(ValueError, match=rf"strategy='{name}' starts processes on this machine only"):
            resolve(strategy=name, devices=2, num_nodes=2)
