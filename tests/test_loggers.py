"""Experiment loggers (trainscale.loggers), each written and read back with its own library, in one process."""

import csv
import importlib.util
import json
import math
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

from tests import workers
from trainscale.loggers import (CSVLogger, Logger, MLFlowLogger, TensorBoardLogger, WandbLogger, record_metrics,
                                resolve_loggers)
from trainscale.loop.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]

# A step record as telemetry/processor.py writes it at world size 2 (fields as in docs/telemetry.md).
STEP_RECORD = {
    "kind": "step", "rank": "all", "time": 1.7e9, "epoch": 1, "step": 8, "train_loss": 0.5,
    "step_time_s": 0.04, "phase_s": {"data": 0.01, "forward": 0.02}, "comm_s": None, "mfu": None,
    "peak_memory_bytes": [100, 200], "peak_memory_kind": "rss", "gpu_utilization": [55.0, math.nan],
    "slowest_rank": 1, "straggler_ranks": [1], "rank_phase_s": {"data": [0.01, 0.02]}, "tokens_per_s": math.inf,
}


def test_record_metrics_flattens_numbers_and_drops_the_rest():
    assert record_metrics(STEP_RECORD) == {
        "epoch": 1, "step/train_loss": 0.5, "step/step_time_s": 0.04,
        "step/phase_s/data": 0.01, "step/phase_s/forward": 0.02,
        "step/peak_memory_bytes/rank0": 100, "step/peak_memory_bytes/rank1": 200,
        "step/gpu_utilization/rank0": 55.0, "step/slowest_rank": 1,
        "step/rank_phase_s/data/rank0": 0.01, "step/rank_phase_s/data/rank1": 0.02,
    }
    epoch = record_metrics({"kind": "epoch", "epoch": 0, "step": 4, "train_loss": 0.7, "val_accuracy": 0.9})
    assert epoch == {"epoch": 0, "epoch/train_loss": 0.7, "epoch/val_accuracy": 0.9}


def test_record_metrics_of_every_record_a_trainer_writes(tmp_path):
    trainer = Trainer(accelerator="cpu", max_epochs=2, log_every_n_steps=2, enable_progress_bar=False,
                      enable_checkpointing=False, default_root_dir=tmp_path)
    trainer.fit(workers.make_model(), DataLoader(workers.tiny_dataset(32), batch_size=8),
                DataLoader(workers.tiny_dataset(16, seed=1), batch_size=8), optimizer=workers.sgd)
    records = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    metrics = [record_metrics(r) for r in records]
    assert {r["kind"] for r in records} == {"step", "epoch"}
    for m in metrics:
        assert m and all(type(v) in (int, float) and math.isfinite(v) for v in m.values())
        assert all("/" in k for k in m if k != "epoch")
    steps = [m for r, m in zip(records, metrics) if r["kind"] == "step"]
    assert all({"step/train_loss", "step/phase_s/data", "step/samples_per_s"} <= m.keys() for m in steps)
    assert all("epoch/val_loss" in m for r, m in zip(records, metrics) if r["kind"] == "epoch")


def test_importing_loggers_imports_no_logging_library_and_no_higher_layer():
    code = ("import sys; import trainscale.loggers as L; L.resolve_loggers(None); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('wandb', 'mlflow', 'tensorboard', 'torch') "
            "or m.startswith(('trainscale.loop', 'trainscale.lightning', 'trainscale.bench', 'trainscale.cli'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


class _Recorder:
    """A logger of this test's own: the protocol is structural."""

    def setup(self, run_dir): ...

    def log_hyperparams(self, params): ...

    def log_metrics(self, metrics, step): ...

    def finalize(self, status): ...


def test_resolve_loggers_accepts_the_forms_trainer_logger_takes():
    assert [type(x) for x in resolve_loggers(None)] == [CSVLogger]
    assert [type(x) for x in resolve_loggers(True)] == [CSVLogger]
    assert resolve_loggers(False) == []
    one, two = CSVLogger(), _Recorder()
    assert resolve_loggers(one) == [one]
    assert resolve_loggers([one, two]) == [one, two] == resolve_loggers((one, two))
    assert isinstance(two, Logger)


def test_tensorboard_flag_adds_one_tensorboard_logger():
    pytest.importorskip("tensorboard")
    assert [type(x) for x in resolve_loggers(None, tensorboard=True)] == [CSVLogger, TensorBoardLogger]
    assert [type(x) for x in resolve_loggers(False, tensorboard=True)] == [TensorBoardLogger]
    own = TensorBoardLogger()
    assert resolve_loggers(own, tensorboard=True) == [own]  # the user's, not a second one


class _Counting(_Recorder):
    def __init__(self):
        self.calls = []

    def setup(self, run_dir):
        self.calls.append("setup")

    def log_hyperparams(self, params):
        self.calls.append("hparams")

    def log_metrics(self, metrics, step):
        self.calls.append((step, dict(metrics)))

    def finalize(self, status):
        self.calls.append(status)


def test_metrics_processor_writes_each_record_once_per_destination(tmp_path):
    from trainscale.loop.records import MetricsProcessor

    lg = _Counting()
    out = MetricsProcessor(None, None, tmp_path, [lg], {"lr": 0.1})
    records = [{"kind": "step", "rank": "all", "step": 2, "epoch": 0, "train_loss": 0.5},
               {"kind": "epoch", "rank": "all", "step": 2, "epoch": 0, "train_loss": 0.4}]
    for record in records:
        out.write(record)
    out.close("failed")
    out.close("success")  # once closed, closing again does nothing
    assert [json.loads(line) for line in open(tmp_path / "metrics.jsonl")] == records
    assert lg.calls == ["setup", "hparams", (2, {"epoch": 0, "step/train_loss": 0.5}),
                        (2, {"epoch": 0, "epoch/train_loss": 0.4}), "failed"]
    other_rank = _Counting()
    MetricsProcessor(None, None, None, [other_rank], {}).write(records[0])  # a rank that does not write
    assert other_rank.calls == []


@pytest.mark.parametrize("bad", ["wandb", CSVLogger, 3, [CSVLogger(), "csv"], {"csv": True}])
def test_resolve_loggers_refuses_what_is_not_a_logger(bad):
    with pytest.raises(TypeError, match=r"is not a logger: pass an instance such as trainscale\.loggers\.CSVLogger"):
        resolve_loggers(bad)


def test_resolve_loggers_refuses_the_same_logger_twice():
    one = CSVLogger()
    with pytest.raises(ValueError, match="same logger object twice"):
        resolve_loggers([one, one])


@pytest.mark.parametrize(("module", "make", "extra"), [
    ("wandb", lambda: WandbLogger(), "wandb"),
    ("mlflow", lambda: MLFlowLogger(), "mlflow"),
    ("sqlalchemy", lambda: MLFlowLogger(), "mlflow"),
    ("tensorboard", lambda: TensorBoardLogger(), "tensorboard"),
])
def test_a_logger_without_its_package_names_the_install(monkeypatch, module, make, extra):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setitem(sys.modules, module, None)  # find_spec then answers "not installed"
    with pytest.raises(ModuleNotFoundError, match=rf"needs {module}: pip install 'trainscale\[{extra}\]'"):
        make()


def test_logging_before_setup_and_unknown_status_are_clear_errors(tmp_path):
    logger = CSVLogger()
    with pytest.raises(RuntimeError, match=r"CSVLogger.setup\(run_dir\) must be called before logging"):
        logger.log_metrics({"a": 1.0}, step=1)
    logger.setup(tmp_path)
    with pytest.raises(ValueError, match="one of 'success', 'failed'"):
        logger.finalize("ok")


def test_a_read_only_or_file_save_dir_is_refused_when_the_logger_is_made(tmp_path, monkeypatch):
    import os

    from trainscale.loggers import base

    makers = [CSVLogger] + ([TensorBoardLogger] if importlib.util.find_spec("tensorboard") else [])
    real_access = os.access
    # the permission as the OS answers it for this user (faked: root may write to a read-only directory)
    monkeypatch.setattr(base.os, "access", lambda path, mode: str(path) != str(tmp_path))
    for maker in makers:
        with pytest.raises(ValueError, match=rf"{maker.__name__}\(save_dir='.*logs'\) cannot be written .*read-only "
                                             r"for this user\); pass a directory you can write, or save_dir=None"):
            maker(save_dir=tmp_path / "logs")
    monkeypatch.setattr(base.os, "access", real_access)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"CSVLogger\(save_dir='.*file/logs'\): '.*file' is a file; pass a directory"):
        CSVLogger(save_dir=tmp_path / "file" / "logs")
    assert CSVLogger(save_dir=tmp_path / "new" / "logs").save_dir == str(tmp_path / "new" / "logs")  # made at setup


@pytest.mark.parametrize("uri", ["s3://bucket/mlruns", "ftp://host/x", "mlflow-artifacts://host/a"])
def test_an_mlflow_tracking_uri_of_an_unsupported_scheme_is_refused_when_the_logger_is_made(uri):
    if importlib.util.find_spec("mlflow") is None:
        pytest.skip("mlflow is not installed: pip install 'trainscale[mlflow]'")
    with pytest.raises(ValueError, match=rf"MLFlowLogger\(tracking_uri='{uri}'\): MLflow has no tracking store for "
                                         r"'[\w-]+://'; use a tracking server \(http://HOST:5000\)"):
        MLFlowLogger(tracking_uri=uri)
    for good in ("sqlite:///x/mlflow.db", "postgresql+psycopg2://u@h/db", "http://h:5000", "databricks", "/tmp/mlruns"):
        from trainscale.loggers.mlflow_logger import check_tracking_uri

        check_tracking_uri(good)


def test_an_online_wandb_logger_without_credentials_is_refused_when_it_is_made(tmp_path, monkeypatch, request):
    wandb = pytest.importorskip("wandb")
    request.addfinalizer(wandb.teardown)  # W&B's settings singleton read this test's environment
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))  # no entry: none is written there
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    with pytest.raises(ValueError, match=r"WandbLogger: no W&B credentials for https://api.wandb.ai .*run `wandb "
                                         r"login` once, or set WANDB_API_KEY, or .*WandbLogger\(offline=True\)"):
        WandbLogger(project="p")
    WandbLogger(project="p", offline=True)  # offline, or with a key: nothing to check
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    WandbLogger(project="p")
    monkeypatch.delenv("WANDB_API_KEY")
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "y" * 40 + "\n")
    (tmp_path / "netrc").chmod(0o600)
    WandbLogger(project="p")  # `wandb login` wrote the key to the netrc file


# CSVLogger


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_csv_logger_one_row_per_call_columns_the_union_of_keys(tmp_path):
    logger = CSVLogger(flush_secs=0)
    logger.setup(tmp_path)
    logger.log_metrics({"step/train_loss": 0.5, "epoch": 0}, step=2)
    logger.log_metrics({"epoch/val_loss": 0.4, "epoch": 0}, step=2)  # a new name: the header widens
    logger.log_metrics({"step/train_loss": 0.25}, step=4)
    logger.finalize("success")
    assert _header(tmp_path / "metrics.csv") == ["step", "step/train_loss", "epoch", "epoch/val_loss"]
    assert _rows(tmp_path / "metrics.csv") == [
        {"step": "2", "step/train_loss": "0.5", "epoch": "0", "epoch/val_loss": ""},
        {"step": "2", "step/train_loss": "", "epoch": "0", "epoch/val_loss": "0.4"},
        {"step": "4", "step/train_loss": "0.25", "epoch": "", "epoch/val_loss": ""},
    ]
    assert not list(tmp_path.glob(".*.tmp"))


def _header(path: Path) -> list[str]:
    return path.read_text().splitlines()[0].split(",")


def test_csv_logger_buffers_rows_for_flush_secs_and_writes_them_at_finalize(tmp_path):
    logger = CSVLogger(flush_secs=3600)
    logger.setup(tmp_path)
    for step in (1, 2, 3):
        logger.log_metrics({"loss": 1.0 / step}, step=step)
    assert len(_rows(tmp_path / "metrics.csv")) == 1  # the first row at once, the others wait
    logger.finalize("failed")
    assert [r["step"] for r in _rows(tmp_path / "metrics.csv")] == ["1", "2", "3"]


def test_csv_logger_resumed_run_appends_and_keeps_hyperparameters(tmp_path):
    first = CSVLogger(flush_secs=0)
    first.setup(tmp_path)
    first.log_hyperparams({"lr": 0.1, "model": {"width": 8}, "device": object()})
    first.log_metrics({"loss": 1.0}, step=1)
    first.finalize("failed")
    second = CSVLogger(flush_secs=0)  # the resumed run: same run directory, a new logger object
    second.setup(tmp_path)
    second.log_hyperparams({"max_epochs": 3})
    second.log_metrics({"loss": 0.5, "acc": 0.9}, step=2)
    second.finalize("success")
    assert _rows(tmp_path / "metrics.csv") == [{"step": "1", "loss": "1.0", "acc": ""},
                                               {"step": "2", "loss": "0.5", "acc": "0.9"}]
    hparams = json.loads((tmp_path / "hparams.json").read_text())
    assert hparams["lr"] == 0.1 and hparams["model"] == {"width": 8} and hparams["max_epochs"] == 3
    assert hparams["device"].startswith("<object object")


def test_csv_logger_save_dir_wins_over_the_run_dir(tmp_path):
    logger = CSVLogger(save_dir=tmp_path / "mine", flush_secs=0)
    logger.setup(tmp_path / "run")
    logger.log_metrics({"loss": 1.0}, step=1)
    logger.finalize("success")
    assert (tmp_path / "mine" / "lightning_logs" / "version_0" / "metrics.csv").is_file()
    assert not (tmp_path / "run" / "metrics.csv").exists()


# TensorBoardLogger


def test_tensorboard_logger_scalars_and_hparams_read_back(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed: pip install 'trainscale[tensorboard]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    logger = TensorBoardLogger()
    logger.setup(tmp_path)
    logger.log_hyperparams({"lr": 0.1, "optim": {"name": "sgd"}, "devices": [0, 1]})
    for step in (2, 4):
        logger.log_metrics(record_metrics({**STEP_RECORD, "step": step, "train_loss": 1.0 / step}), step=step)
    logger.finalize("success")
    logger.finalize("success")  # a second call does nothing
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("step/train_loss")] == [(2, 0.5), (4, 0.25)]
    assert [e.value for e in events.Scalars("step/peak_memory_bytes/rank1")] == [200, 200]
    start = HParamsPluginData.FromString(events.PluginTagToContent("hparams")["_hparams_/session_start_info"])
    values = start.session_start_info.hparams
    assert values["lr"].number_value == 0.1 and values["optim/name"].string_value == "sgd"
    assert values["devices"].string_value == "[0, 1]"


def test_tensorboard_logger_keeps_every_hyperparameter_in_hparams_yaml_as_lightnings(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed: pip install 'trainscale[tensorboard]'")
    import enum
    from argparse import Namespace

    import torch
    import yaml

    class Mode(str, enum.Enum):
        FAST = "fast-value"

    logger = TensorBoardLogger()
    logger.setup(tmp_path)
    logger.log_hyperparams(Namespace(width=4, mode=Mode.FAST))  # a Namespace, as Lightning takes
    with pytest.warns(UserWarning, match="Skipping 'dtype' parameter because it is not possible to safely dump"):
        logger.log_hyperparams({"optim": {"name": "sgd", "lr": 0.1}, "dtype": torch.float32})
    logger.finalize("success")
    path = Path(logger.log_dir) / TensorBoardLogger.NAME_HPARAMS_FILE
    assert path == tmp_path / "tensorboard" / "hparams.yaml"
    assert yaml.safe_load(path.read_text()) == {"width": 4, "mode": "FAST", "optim": {"name": "sgd", "lr": 0.1}}
    assert logger.hparams["dtype"] is torch.float32  # kept in memory; only the file leaves it out


def test_tensorboard_logger_save_flushes_its_writer_and_writes_a_missing_hparams_yaml(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed: pip install 'trainscale[tensorboard]'")
    import yaml

    TensorBoardLogger().save()  # before a run, without a save_dir: nothing to write, and no error
    logger = TensorBoardLogger(tmp_path, name="exp")
    logger.log_hyperparams({"width": 8})
    flushed = []
    monkeypatch.setattr(logger.experiment, "flush", lambda: flushed.append(True))
    hparams_file = Path(logger.log_dir) / TensorBoardLogger.NAME_HPARAMS_FILE
    hparams_file.unlink()
    logger.save()
    assert flushed == [True]
    assert yaml.safe_load(hparams_file.read_text()) == {"width": 8}
    logger.finalize("success")


def test_hparams_yaml_functions_write_and_read_as_lightnings(tmp_path):
    from argparse import Namespace

    import torch

    from trainscale.loggers import load_hparams_from_yaml, save_hparams_to_yaml

    path = tmp_path / "hparams.yaml"
    save_hparams_to_yaml(path, Namespace(lr=0.01, layers=[4, 2], nested={"a": "b"}))
    assert load_hparams_from_yaml(path) == {"lr": 0.01, "layers": [4, 2], "nested": {"a": "b"}}
    with pytest.warns(UserWarning, match="Skipping 'dtype' parameter because it is not possible to safely dump"):
        save_hparams_to_yaml(path, {"dtype": torch.float32, "lr": 0.1})
    assert load_hparams_from_yaml(path) == {"lr": 0.1}
    with pytest.warns(RuntimeWarning, match="Missing Tags: .*absent.yaml"):
        assert load_hparams_from_yaml(tmp_path / "absent.yaml") == {}


def test_tags_csv_functions_write_and_read_lightnings_older_meta_tags(tmp_path):
    from argparse import Namespace

    from trainscale.loggers import load_hparams_from_tags_csv, save_hparams_to_tags_csv

    path = tmp_path / "meta_tags.csv"
    save_hparams_to_tags_csv(path, Namespace(lr=0.01, layers=[4, 2], name="mlp, wide", debug=False, seed=None))
    assert path.read_text().splitlines()[:2] == ["key,value", "lr,0.01"]
    assert load_hparams_from_tags_csv(path) == {"lr": 0.01, "layers": [4, 2], "name": "mlp, wide", "debug": False,
                                                "seed": ""}  # csv writes None as an empty field, as Lightning's
    with pytest.raises(RuntimeError, match="Missing folder: .*absent"):
        save_hparams_to_tags_csv(tmp_path / "absent" / "meta_tags.csv", {"lr": 0.1})
    with pytest.warns(RuntimeWarning, match="Missing Tags: .*absent.csv"):
        assert load_hparams_from_tags_csv(tmp_path / "absent.csv") == {}


# WandbLogger (offline) and its run file


def _wandb_records(run_dir: Path) -> list:
    """The protobuf records of every offline W&B run file under ``run_dir``, in order.

    A ``.wandb`` file is a 7-byte header (":W&B", magic, version) and then LevelDB's log format
    (https://github.com/google/leveldb/blob/main/doc/log_format.md): 32 KiB blocks of chunks, each
    ``crc32 (4) | length (2, LE) | type (1) | data``; type 1 is a whole record, 2/3/4 its first/middle/last
    part; a block's tail shorter than a chunk header is zero padding.
    """
    from wandb.proto.wandb_internal_pb2 import Record

    records = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        raw, pos, data = path.read_bytes(), 7, b""
        assert raw[:4] == b":W&B"
        while pos + 7 <= len(raw):
            if 32768 - pos % 32768 < 7:
                pos += 32768 - pos % 32768
                continue
            _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
            chunk, pos = raw[pos + 7:pos + 7 + length], pos + 7 + length
            data = chunk if kind in (1, 2) else data + chunk
            if kind in (1, 4):
                records.append(Record.FromString(data))
    return records


def _history(records) -> list[dict]:
    rows = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]
    return [{k: v for k, v in row.items() if not k.startswith("_")} for row in rows]


def _finished(logger: WandbLogger, status: str) -> None:
    """``finalize``, then wait for W&B's service process to end: ``run.finish()`` may return before that
    process has written the last records to the run file (seen with wandb 0.31 offline)."""
    import wandb

    logger.finalize(status)
    wandb.teardown()


@pytest.fixture
def wandb_offline(monkeypatch, tmp_path):
    pytest.importorskip("wandb", reason="wandb is not installed: pip install 'trainscale[wandb]'")
    for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": tmp_path / "config",
                        "WANDB_CACHE_DIR": tmp_path / "cache", "WANDB_DATA_DIR": tmp_path / "data"}.items():
        monkeypatch.setenv(name, str(value))


def test_wandb_logger_offline_run_read_back(tmp_path, wandb_offline):
    run_dir = tmp_path / "version_0"
    run_dir.mkdir()
    logger = WandbLogger(project="trainscale-test")
    logger.setup(run_dir)
    logger.log_hyperparams({"lr": 0.1, "optim": {"name": "sgd"}})
    logger.log_metrics({"step/train_loss": 0.5, "epoch": 0}, step=2)
    logger.log_metrics({"step/train_loss": 0.25, "epoch": 0}, step=4)
    logger.log_metrics({"epoch/val_loss": 0.3, "epoch": 0}, step=4)  # the same step again: accepted
    _finished(logger, "success")
    records = _wandb_records(run_dir)
    assert _history(records) == [
        {"step/train_loss": 0.5, "epoch": 0, "trainer/global_step": 2},
        {"step/train_loss": 0.25, "epoch": 0, "trainer/global_step": 4},
        {"epoch/val_loss": 0.3, "epoch": 0, "trainer/global_step": 4},
    ]
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.display_name == "version_0" and run.project == "trainscale-test"
    assert run.run_id == (run_dir / "wandb_run_id").read_text().strip()
    config = {u.key: json.loads(u.value_json) for r in records if r.WhichOneof("record_type") == "config"
              for u in r.config.update}
    assert config["lr"] == 0.1 and config["optim"] == {"name": "sgd"}
    exits = [r.exit.exit_code for r in records if r.WhichOneof("record_type") == "exit"]
    assert exits == [0]


def test_wandb_logger_resumed_run_continues_the_same_run(tmp_path, wandb_offline):
    records = []
    for status, step in (("failed", 1), ("success", 2)):
        # W&B's files in a folder per attempt: offline, W&B names a run's folder by the second it started and
        # its id, so two attempts within one second would share one folder.
        logger = WandbLogger(save_dir=tmp_path / f"attempt{step}")
        logger.setup(tmp_path)
        logger.log_metrics({"loss": 1.0 / step}, step=step)
        _finished(logger, status)
        records += _wandb_records(tmp_path / f"attempt{step}")
    assert {r.run.run_id for r in records if r.WhichOneof("record_type") == "run"} == {
        (tmp_path / "wandb_run_id").read_text().strip()}
    assert [r.exit.exit_code for r in records if r.WhichOneof("record_type") == "exit"] == [1, 0]
    assert [row["trainer/global_step"] for row in _history(records)] == [1, 2]


# MLFlowLogger (local SQLite store)


@pytest.fixture
def mlflow_local(monkeypatch, tmp_path):
    pytest.importorskip("mlflow", reason="mlflow is not installed: pip install 'trainscale[mlflow]'")
    pytest.importorskip("sqlalchemy", reason="SQLAlchemy is not installed: pip install 'trainscale[mlflow]'")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)  # nothing may land in the working directory


def test_mlflow_logger_run_in_the_default_sqlite_store_read_back(tmp_path, mlflow_local):
    from mlflow import MlflowClient

    run_dir = tmp_path / "runs" / "version_0"
    run_dir.mkdir(parents=True)
    logger = MLFlowLogger()
    logger.setup(run_dir)
    assert logger.tracking_uri == f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"
    logger.log_hyperparams({"lr": 0.1, "optim": {"name": "sgd"}, "note": "x" * 7000})
    for step in (2, 4):
        logger.log_metrics(record_metrics({**STEP_RECORD, "step": step, "train_loss": 1.0 / step}), step=step)
    logger.finalize("success")

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    run = client.get_run(logger.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "version_0"
    assert client.get_experiment(run.info.experiment_id).name == "trainscale"
    assert [(m.step, m.value) for m in client.get_metric_history(logger.run_id, "step/train_loss")] == [
        (2, 0.5), (4, 0.25)]
    assert run.data.metrics["step/gpu_utilization/rank0"] == 55.0
    assert run.data.params["lr"] == "0.1" and run.data.params["optim/name"] == "sgd"
    assert len(run.data.params["note"]) == 6000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]  # no ./mlruns or ./mlflow.db


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory):
    """One sqlite store for the tests below, each in its own experiment: a new store's schema migration
    costs seconds of CPU, and the default store's creation is the test above's subject."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'store.db'}"


def test_mlflow_logger_asynchronous_writes_are_all_in_the_store_after_finalize(tmp_path, mlflow_local, shared_store):
    from mlflow import MlflowClient

    logger = MLFlowLogger(experiment_name="asynchronous", tracking_uri=shared_store, synchronous=False)
    logger.setup(tmp_path / "runs" / "version_0")
    for step in range(1, 21):
        logger.log_metrics({"loss": 1.0 / step, "acc": step / 20}, step=step)
    logger.finalize("success")
    client = MlflowClient(tracking_uri=logger.tracking_uri)
    assert [m.step for m in client.get_metric_history(logger.run_id, "acc")] == list(range(1, 21))
    assert client.get_run(logger.run_id).info.status == "FINISHED"


def test_mlflow_logger_resumed_run_continues_and_failure_is_recorded(tmp_path, mlflow_local, shared_store):
    from mlflow import MlflowClient

    ids = []
    for status, step in (("failed", 1), ("failed", 2)):
        logger = MLFlowLogger(experiment_name="resume", tracking_uri=shared_store)
        logger.setup(tmp_path / "version_0")
        logger.log_metrics({"loss": 1.0 / step}, step=step)
        ids.append(logger.run_id)
        logger.finalize(status)
    assert ids[0] == ids[1]
    client = MlflowClient(tracking_uri=shared_store)
    assert client.get_run(ids[0]).info.status == "FAILED"
    assert [m.step for m in client.get_metric_history(ids[0], "loss")] == [1, 2]


# docs/loggers.md's Python blocks run in tests/test_docs_examples.py (every document's blocks)


def test_loggers_pickle_before_setup(tmp_path, monkeypatch):
    """ddp_spawn pickles the Trainer, loggers included, to its ranks; a logger holds no open resource until setup."""
    import pickle

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")  # an online WandbLogger needs credentials when it is made
    makers = [CSVLogger, _Recorder]
    for module, maker in (("tensorboard", TensorBoardLogger), ("wandb", WandbLogger), ("mlflow", MLFlowLogger)):
        if importlib.util.find_spec(module) is not None:
            makers.append(maker)
    for maker in makers:
        assert type(pickle.loads(pickle.dumps(maker()))) is maker


@pytest.mark.timeout(60)
def test_an_mlflow_server_out_of_reach_is_dropped_with_a_warning_and_training_goes_on(tmp_path):
    pytest.importorskip("mlflow")
    import time

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from trainscale import Trainer
    from trainscale.loggers import MLFlowLogger

    x = torch.randn(16, 4)
    loader = DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8)
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=1, default_root_dir=tmp_path, enable_progress_bar=False,
                      logger=MLFlowLogger(tracking_uri="http://127.0.0.1:9"))  # port 9 (discard): nothing listens
    started = time.monotonic()
    with pytest.warns(RuntimeWarning, match="no MLflow tracking server answers at http://127.0.0.1:9.*trains without "
                                            "MLFlowLogger"):
        summary = trainer.fit(torch.nn.Linear(4, 2), loader, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    assert summary["steps"] == 2 and time.monotonic() - started < 30


def test_experiment_is_a_no_op_on_other_ranks_and_an_error_on_rank_zero_before_setup(monkeypatch, tmp_path):
    """Lightning's rank_zero_experiment: the Trainer sets loggers up on rank zero only, so a hook's
    ``self.logger.experiment.add_image(...)`` must do nothing on the other ranks."""
    pytest.importorskip("tensorboard")
    logger = TensorBoardLogger()
    monkeypatch.setenv("RANK", "1")
    assert logger.experiment.add_image("x", None, 0) is None and logger.experiment["any"].log() is None
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RuntimeError, match=r"setup\(run_dir\) must be called"):
        logger.experiment
    logger.setup(tmp_path)
    assert type(logger.experiment).__name__ == "SummaryWriter"
    logger.finalize("success")


# Lightning's directory layout: save_dir/name/version_N (trainscale.loggers.log_dirs)


def _fit(root: Path, logger, max_epochs: int = 1, **flags) -> Trainer:
    """A 4-step fit of a linear model with ``logger``, every step recorded; the run directories under ``root``."""
    import torch
    from torch.utils.data import TensorDataset

    torch.manual_seed(0)
    x = torch.randn(32, 4)
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=max_epochs, default_root_dir=root, log_every_n_steps=1,
                      enable_progress_bar=False, enable_model_summary=False, logger=logger)
    trainer.fit(torch.nn.Linear(4, 2), DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8),
                optimizer=lambda params: torch.optim.SGD(params, lr=0.1), **flags)
    return trainer


@pytest.mark.timeout(60)
def test_a_csv_logger_with_a_save_dir_writes_save_dir_name_version_and_the_next_fit_the_next_version(tmp_path):
    trainers = [_fit(tmp_path / "runs", CSVLogger(tmp_path / "logs", name="exp")) for _ in range(2)]
    for n, trainer in enumerate(trainers):
        logger = trainer.logger
        assert (logger.name, logger.version) == ("exp", n)
        assert (logger.save_dir, logger.root_dir) == (str(tmp_path / "logs"), str(tmp_path / "logs" / "exp"))
        assert trainer.log_dir == logger.log_dir == str(tmp_path / "logs" / "exp" / f"version_{n}")
        assert [r["step"] for r in _rows(Path(logger.log_dir) / "metrics.csv")][:2] == ["1", "2"]
        # the run directory and its checkpoints stay where they were
        assert trainer.run_dir == tmp_path / "runs" / f"version_{n}"
        assert Path(trainer.checkpoint_callback.best_model_path).parent == trainer.run_dir / "checkpoints"
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("metrics.csv")) == [
        "logs/exp/version_0/metrics.csv", "logs/exp/version_1/metrics.csv"]


def test_the_next_version_is_one_more_than_the_largest_version_directory(tmp_path):
    for name in ("version_0", "version_7", "version_x", "other"):
        (tmp_path / "exp" / name).mkdir(parents=True)
    (tmp_path / "exp" / "version_9").write_text("")  # a file, not a version directory
    assert CSVLogger(tmp_path, name="exp").version == 8
    assert CSVLogger(tmp_path, name="absent").version == 0
    logger = CSVLogger(tmp_path, name="exp")
    assert logger.version == 8
    (tmp_path / "exp" / "version_8").mkdir()
    assert logger.version == 8  # chosen at the first read and kept, as Lightning's


@pytest.mark.parametrize(("name", "version", "where"), [
    (None, None, "version_0"), ("", 3, "version_3"), ("exp", 3, "exp/version_3"), ("exp", "my_run", "exp/my_run")])
def test_name_and_version_name_the_log_directory_as_lightnings(tmp_path, name, version, where):
    logger = CSVLogger(tmp_path, name=name, version=version, flush_secs=0)
    assert logger.log_dir == os.path.join(str(tmp_path), where)
    logger.setup(tmp_path / "runs" / "version_0")
    logger.log_metrics({"loss": 1.0}, step=1)
    logger.finalize("success")
    assert [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("metrics.csv")] == [f"{where}/metrics.csv"]


def test_a_tensorboard_logger_with_a_save_dir_writes_its_events_in_the_version_and_sub_dir(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed: pip install 'trainscale[tensorboard]'")
    logger = TensorBoardLogger(tmp_path / "tb_logs", name="my_model", version=3, sub_dir="train", max_queue=5)
    assert logger.log_dir == str(tmp_path / "tb_logs" / "my_model" / "version_3" / "train")
    assert (logger.name, logger.version, logger.root_dir) == ("my_model", 3, str(tmp_path / "tb_logs" / "my_model"))
    logger.setup(tmp_path / "run")
    logger.log_metrics({"loss": 1.0}, step=1)
    logger.finalize("success")
    assert [p.parent for p in tmp_path.rglob("events.out.tfevents.*")] == [Path(logger.log_dir)]
    assert TensorBoardLogger(save_dir=tmp_path, default_hp_metric=False).log_dir == str(
        tmp_path / "lightning_logs" / "version_0")


def test_without_a_save_dir_the_loggers_write_into_the_run_directory_which_is_their_version(tmp_path):
    logger = CSVLogger()
    assert (logger.version, logger.log_dir, logger.save_dir) == (None, None, None)  # no run yet
    trainer = _fit(tmp_path, logger)
    assert (logger.name, logger.version) == ("", 0)
    assert trainer.log_dir == logger.log_dir == str(trainer.run_dir) == str(tmp_path / "version_0")
    assert (logger.save_dir, logger.root_dir) == (str(tmp_path), str(tmp_path))
    assert (trainer.run_dir / "metrics.csv").is_file()
    # Lightning's spelling of the same place: save_dir the directory of the run directories, no name
    trainer = _fit(tmp_path, CSVLogger(tmp_path, name=""))
    assert trainer.log_dir == str(trainer.run_dir) == str(tmp_path / "version_1")
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("metrics.csv")) == [
        "version_0/metrics.csv", "version_1/metrics.csv"]
    with pytest.raises(ValueError, match=r"CSVLogger\(name='exp', version=None\) without a save_dir: .*CSVLogger\("
                                         r"'logs', name=..., version=...\) writes logs/<name>/version_<N>"):
        CSVLogger(name="exp")
    with pytest.raises(ValueError, match=r"CSVLogger\(name='lightning_logs', version=2\) without a save_dir"):
        CSVLogger(version=2)


@pytest.mark.timeout(60)
def test_trainer_log_dir_without_a_logger_is_default_root_dir(tmp_path):
    assert Trainer(accelerator="cpu", logger=False, default_root_dir=tmp_path).log_dir == str(tmp_path)
    trainer = _fit(tmp_path, False)  # Lightning's; the run's records still go to the run directory
    assert trainer.log_dir == str(tmp_path) and trainer.run_dir == tmp_path / "version_0"


def test_prefix_goes_before_every_metric_name_joined_by_a_dash(tmp_path):
    logger = CSVLogger(prefix="train", flush_secs=0)
    logger.setup(tmp_path)
    logger.log_metrics({"loss": 0.5}, step=1)
    logger.finalize("success")
    assert _rows(tmp_path / "metrics.csv") == [{"step": "1", "train-loss": "0.5"}]
    if importlib.util.find_spec("tensorboard") is None:
        return
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = TensorBoardLogger(prefix="train")
    tb.setup(tmp_path)
    tb.log_metrics({"loss": 0.5}, step=1)
    tb.finalize("success")
    events = EventAccumulator(tb.log_dir)
    events.Reload()
    assert events.Tags()["scalars"] == ["train-loss"]


def test_csv_rows_wait_at_most_flush_logs_every_n_steps(tmp_path):
    logger = CSVLogger(flush_logs_every_n_steps=4, flush_secs=3600)
    logger.setup(tmp_path)
    written = []
    for step in range(1, 10):
        logger.log_metrics({"loss": 1.0 / step}, step=step)
        written.append(len(_rows(tmp_path / "metrics.csv")))
    assert written == [1, 1, 1, 1, 5, 5, 5, 5, 9]  # the first row at once, then every 4 steps
    with pytest.raises(ValueError, match=r"flush_logs_every_n_steps=0\): give a number of steps >= 1"):
        CSVLogger(flush_logs_every_n_steps=0)


def test_a_version_directory_of_another_run_is_refused_and_left_as_it_was(tmp_path):
    first = CSVLogger(tmp_path, name="exp", version=0, flush_secs=0)
    first.setup(tmp_path / "run0")
    first.log_metrics({"loss": 1.0}, step=1)
    first.finalize("success")
    metrics = tmp_path / "exp" / "version_0" / "metrics.csv"
    before = metrics.read_bytes()
    with pytest.raises(FileExistsError, match=r"CSVLogger\(version=0\): .*exp/version_0 holds files of another run "
                                              r"\(metrics.csv\); .*pass version=None for the next free version "
                                              r"\(version_1\), another version, or move that directory away"):
        CSVLogger(tmp_path, name="exp", version=0).setup(tmp_path / "run1")
    assert metrics.read_bytes() == before
    # this run again (resumed, with a new logger object) and this logger object in a later run continue there
    resumed = CSVLogger(tmp_path, name="exp", version=0, flush_secs=0)
    resumed.setup(tmp_path / "run0")
    resumed.log_metrics({"loss": 0.5}, step=2)
    resumed.finalize("success")
    first.setup(tmp_path / "run2")
    first.log_metrics({"loss": 0.25}, step=3)
    first.finalize("success")
    assert [r["step"] for r in _rows(metrics)] == ["1", "2", "3"]


def test_a_tensorboard_logger_refuses_another_runs_version_directory_too(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed: pip install 'trainscale[tensorboard]'")
    (tmp_path / "tb" / "version_2").mkdir(parents=True)
    (tmp_path / "tb" / "version_2" / "hparams.yaml").write_text("lr: 0.1\n")
    with pytest.raises(FileExistsError, match=r"version_2 holds files of another run \(hparams.yaml\)"):
        TensorBoardLogger(tmp_path, name="tb", version=2).setup(tmp_path / "run")
    assert (tmp_path / "tb" / "version_2" / "hparams.yaml").read_text() == "lr: 0.1\n"


def test_a_logger_with_a_save_dir_logs_alone_on_rank_zero_as_lightnings(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    logger = CSVLogger(tmp_path, name="exp", version="2020-02-05-162402", flush_secs=0)
    logger.log_hyperparams({"a": 1})  # no setup: Lightning's loggers start at their first use
    logger.log_metrics({"loss": 0.5})
    logger.log_metrics({"loss": 0.25})
    logger.finalize("success")
    assert os.listdir(tmp_path / "exp") == ["2020-02-05-162402"]
    assert _rows(tmp_path / "exp" / "2020-02-05-162402" / "metrics.csv") == [
        {"step": "0", "loss": "0.5"}, {"step": "1", "loss": "0.25"}]  # no step: the rows logged before
    assert json.loads((tmp_path / "exp" / "2020-02-05-162402" / "hparams.json").read_text()) == {"a": 1}
    monkeypatch.setenv("RANK", "1")  # another rank logs nothing, as Lightning's rank_zero_only
    other = CSVLogger(tmp_path, name="other")
    other.log_hyperparams({"a": 1})
    other.log_metrics({"loss": 1.0}, step=1)
    other.finalize("success")
    assert not (tmp_path / "other").exists()
    if importlib.util.find_spec("tensorboard") is None:
        return
    monkeypatch.setenv("RANK", "0")
    tb = TensorBoardLogger(tmp_path, name="tb")
    tb.log_metrics({"loss": 1.0}, step=1)
    writer = tb.experiment
    tb.setup(tmp_path / "run")  # set up later by a run: the same version, the same writer
    assert tb.experiment is writer and tb.log_dir == str(tmp_path / "tb" / "version_0")
    tb.finalize("success")
    assert len(list((tmp_path / "tb" / "version_0").glob("events.out.tfevents.*"))) == 1


@pytest.mark.timeout(60)
def test_a_run_resumed_in_place_continues_in_its_logger_version(tmp_path):
    first = _fit(tmp_path / "runs", CSVLogger(tmp_path / "logs"))
    _fit(tmp_path / "other_runs", CSVLogger(tmp_path / "logs"))  # another run takes version_1
    resumed = _fit(tmp_path / "runs", CSVLogger(tmp_path / "logs"), max_epochs=2, ckpt_path="last")
    assert resumed.run_dir == first.run_dir and resumed.logger.version == 0
    steps = [int(r["step"]) for r in _rows(Path(resumed.log_dir) / "metrics.csv") if r["step/train_loss"]]
    assert steps == list(range(1, 9))  # 4 steps of the first epoch, then 4 of the resumed second


@pytest.mark.timeout(90)
def test_two_ranks_write_one_metrics_csv_in_rank_zeros_version(tmp_path):
    from tests.helpers import run_distributed

    seen = run_distributed(workers.csv_logger_body, str(tmp_path), timeout=80)
    expected = str(tmp_path / "logs" / "exp" / "version_0")
    assert [s["log_dir"] for s in seen] == [s["logger_log_dir"] for s in seen] == [expected, expected]
    assert [s["version"] for s in seen] == [0, 0]
    assert [s["default_log_dir"] for s in seen] == [str(tmp_path / "runs" / "version_1")] * 2
    assert all(re.search(r"exp/version_0 holds files of another run \(metrics.csv\)", s.get("refusal", ""))
               for s in seen)  # on both ranks, none left waiting at a collective
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("metrics.csv")) == [
        "logs/exp/version_0/metrics.csv", "runs/version_1/metrics.csv"]
    assert _rows(tmp_path / "logs" / "exp" / "version_0" / "metrics.csv")


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_spawned_fit_hands_rank_zeros_version_back_and_a_second_fit_continues_there(tmp_path):
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_epochs=1, timeout=60, log_every_n_steps=1,
                      default_root_dir=tmp_path / "runs", enable_progress_bar=False, enable_checkpointing=False,
                      logger=CSVLogger(tmp_path / "logs", name="exp"))
    expected = str(tmp_path / "logs" / "exp" / "version_0")
    for _ in range(2):  # the same logger in a second fit: its own directory, continued (Lightning's too)
        trainer.fit(workers.make_model(0), DataLoader(workers.tiny_dataset(32), batch_size=8), optimizer=workers.sgd)
        assert trainer.log_dir == trainer.logger.log_dir == expected and trainer.logger.version == 0
    assert [r["step"] for r in _rows(Path(expected) / "metrics.csv") if r["step/train_loss"]] == ["1", "2"] * 2


def test_tensorboard_default_hp_metric_is_lightnings_placeholder(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed: pip install 'trainscale[tensorboard]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    for default_hp_metric in (True, False):
        logger = TensorBoardLogger(tmp_path, name=str(default_hp_metric), default_hp_metric=default_hp_metric)
        logger.setup(tmp_path / "run")
        logger.log_hyperparams({"lr": 0.1})
        logger.finalize("success")
        events = EventAccumulator(logger.log_dir)
        events.Reload()
        content = _plugin_content(events)
        if default_hp_metric:
            assert [(e.step, e.value) for e in events.Scalars("hp_metric")] == [(0, -1.0)]
            info = HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
            assert [m.name.tag for m in info.metric_infos] == ["hp_metric"]
        else:  # as Lightning: no metric given, nothing for the HParams tab (hparams.yaml keeps them)
            assert "hp_metric" not in events.Tags()["scalars"] and not content
        assert (Path(logger.log_dir) / "hparams.yaml").read_text() == "lr: 0.1\n"


def _plugin_content(events) -> dict:
    """The HParams plugin's summaries of a loaded ``EventAccumulator``; {} when there is none."""
    try:
        return events.PluginTagToContent("hparams")
    except KeyError:
        return {}


def test_tensorboard_log_graph_and_unknown_writer_arguments_are_refused_naming_the_alternative():
    pytest.importorskip("tensorboard", reason="tensorboard is not installed: pip install 'trainscale[tensorboard]'")
    with pytest.raises(ValueError, match=r"log_graph=True\): .*trainer.logger.experiment.add_graph\(model, "
                                         r"example_input\)"):
        TensorBoardLogger(log_graph=True)
    with pytest.raises(TypeError, match=r"TensorBoardLogger\(\.\.\., flush_every=\.\.\.\): not an argument"):
        TensorBoardLogger(flush_every=3)
    assert TensorBoardLogger(filename_suffix=".x").writer_kwargs == {"filename_suffix": ".x"}


@pytest.mark.parametrize("log_model", [True, "all"])
def test_log_model_other_than_false_is_refused_naming_the_upload_call(log_model, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    if importlib.util.find_spec("mlflow") is not None:
        with pytest.raises(ValueError, match=rf"MLFlowLogger\(log_model={log_model!r}\): trainscale does not upload "
                                             r"checkpoints .*logger.experiment.log_artifact\(logger.run_id, "):
            MLFlowLogger(log_model=log_model)
        MLFlowLogger(log_model=False)
    if importlib.util.find_spec("wandb") is not None:
        with pytest.raises(ValueError, match=rf"WandbLogger\(log_model={log_model!r}\): trainscale does not upload "
                                             r"checkpoints .*logger.experiment.log_model\("):
            WandbLogger(offline=True, log_model=log_model)


def test_wandb_logger_takes_lightnings_version_prefix_and_anonymous(tmp_path, wandb_offline):
    logger = WandbLogger(project="p", version="abc123", prefix="train", anonymous=True, checkpoint_name="m")
    assert (logger.name, logger.version, logger.init_kwargs["anonymous"]) == ("p", "abc123", "allow")
    logger.setup(tmp_path)
    logger.log_metrics({"loss": 0.5}, step=1)
    _finished(logger, "success")
    records = _wandb_records(tmp_path)
    assert {r.run.run_id for r in records if r.WhichOneof("record_type") == "run"} == {"abc123"}
    assert _history(records) == [{"train-loss": 0.5, "trainer/global_step": 1}]
    with pytest.raises(ValueError, match=r"WandbLogger\(version='a', id='b'\): both name the run id; pass one"):
        WandbLogger(version="a", id="b", offline=True)


def test_mlflow_logger_takes_lightnings_prefix_run_id_and_artifact_location(tmp_path, mlflow_local, shared_store):
    from mlflow import MlflowClient

    first = MLFlowLogger(experiment_name="lightning_names", tracking_uri=shared_store, prefix="train",
                         artifact_location=(tmp_path / "artifacts").as_uri())
    first.setup(tmp_path / "runs" / "version_0")
    first.log_metrics({"loss": 1.0}, step=1)
    first.finalize("success")
    again = MLFlowLogger(experiment_name="ignored", tracking_uri=shared_store, run_id=first.run_id)
    again.setup(tmp_path / "runs" / "version_1")  # another run directory: the run given wins
    again.log_metrics({"loss": 0.5}, step=2)
    again.finalize("success")
    assert (again.name, again.version) == (first.experiment_id, first.run_id)
    client = MlflowClient(tracking_uri=shared_store)
    assert [m.step for m in client.get_metric_history(first.run_id, "loss")] == [2]
    assert [m.step for m in client.get_metric_history(first.run_id, "train-loss")] == [1]
    assert client.get_experiment(first.experiment_id).artifact_location == (tmp_path / "artifacts").as_uri()
