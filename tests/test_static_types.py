"""The public API as a type checker sees it: mypy, run as a user's CI runs it, accepts a script that uses Trainer,
Runtime, a TrainingModule, a DataModule and a Callback as documented, and reports a misspelt flag, a value of the
wrong type, a value outside a flag's choices and an attribute the Trainer lacks (``self.trainer`` of a
TrainingModule is the Trainer, as Lightning's), each on its line; the modules listed in pyproject.toml's
``[tool.mypy] files`` check clean. One mypy process for all of it, its cache in ``tmp_path`` (cold each run)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10: pytest depends on tomli there
    import tomli as tomllib

pytest.importorskip("mypy", reason="mypy comes with the test extra: pip install -e '.[test]'")

ROOT = Path(__file__).resolve().parents[1]

GOOD = '''\
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainscale import Callback, DataModule, Runtime, Trainer, TrainingModule, World, seed_everything
from trainscale.strategies import DDPStrategy


class Classifier(TrainingModule):
    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.layer(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class Data(DataModule):
    def train_dataloader(self):
        x = torch.randn(32, 4)
        return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8)


class EpochPrinter(Callback):
    def on_train_epoch_end(self, trainer, module):
        print(trainer.current_epoch)


seed_everything(0)
trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", precision="bf16-mixed", max_epochs=2,
                  max_time={"hours": 1}, gradient_clip_val=1.0, gradient_clip_algorithm="value", on_nonfinite="skip",
                  deterministic="warn", limit_train_batches=0.5, profiler="simple", callbacks=[EpochPrinter()],
                  logger=False, default_root_dir="runs")
trainer.fit(Classifier(), datamodule=Data())
Trainer(devices="auto", strategy="fsdp", precision="16-mixed", batch_size="max", max_memory=2**30,
        lr_scaling="sqrt", base_batch_size=256, float32_matmul_precision="high")
Trainer(strategy="pp", parallel={"pp": 2}, pp_schedule="gpipe", pp_microbatches=8)
Trainer(devices=2, strategy=DDPStrategy(find_unused_parameters=True, static_graph=False))
runtime = Runtime("cpu", 2, "ddp_spawn", 1, "32-true", timeout=60.0)
model, optimizer = runtime.setup(nn.Linear(4, 2), lambda p: torch.optim.AdamW(p, lr=1e-3))
print(World().world_size)
'''

# Each line a user might write, and what mypy must say about that line.
BAD = {
    'Trainer(max_epoch=2)': 'Unexpected keyword argument "max_epoch" for "Trainer"; did you mean "max_epochs"?',
    'Trainer(max_epochs="2")': 'Argument "max_epochs" to "Trainer" has incompatible type "str"; expected "int | None"',
    'Trainer(precision="bf16_mixed")': '''Argument "precision" to "Trainer" has incompatible type "Literal['bf16_mixed']"''',
    'Trainer(strategy="dpp")': '''Argument "strategy" to "Trainer" has incompatible type "Literal['dpp']"''',
    'Trainer(devices="2")': '''Argument "devices" to "Trainer" has incompatible type "Literal['2']"''',
    'Trainer(gradient_clip_algorithm="l2")':
        '''Argument "gradient_clip_algorithm" to "Trainer" has incompatible type "Literal['l2']"''',
    'Runtime(precison="bf16-mixed")': 'Unexpected keyword argument "precison" for "Runtime"; did you mean "precision"?',
    'Runtime("cpu", 2, "ddp", 1, "bf16")': '''Argument 5 to "Runtime" has incompatible type "Literal['bf16']"''',
    'TrainingModule().trainer.current_epok': '"Trainer" has no attribute "current_epok"',
}


def test_mypy_accepts_the_documented_api_and_reports_each_bad_flag_on_its_line(tmp_path):
    good, bad = tmp_path / "good_script.py", tmp_path / "bad_script.py"
    good.write_text(GOOD)
    bad.write_text("from trainscale import Runtime, Trainer, TrainingModule\n" + "\n".join(BAD) + "\n")
    checked = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["files"]
    out = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                          "--cache-dir", str(tmp_path / "mypy_cache"), "--no-error-summary", "--hide-error-context",
                          str(good), str(bad), *checked], cwd=ROOT, capture_output=True, text=True, timeout=120)
    errors = [line for line in out.stdout.splitlines() if ": error: " in line]
    where = {(Path(path).name, int(line)): message for path, line, message in
             (re.match(r"(.+?):(\d+): error: (.*)", error).groups() for error in errors)}
    expected = {("bad_script.py", number): text for number, text in enumerate(BAD.values(), start=2)}
    assert set(where) == set(expected), out.stdout + out.stderr  # nothing else: the good script and modules pass
    for key, text in expected.items():
        assert text in where[key], (key, where[key])
    assert out.returncode == 1


def test_the_package_says_it_is_typed():
    """PEP 561: without py.typed, mypy treats an installed trainscale as untyped and sees none of the above."""
    assert (ROOT / "src" / "trainscale" / "py.typed").is_file()
