"""Bad input: a clear exception that names the fix, before any process group can hang."""

import hashlib

import pytest
import torch
from torch.utils.data import DataLoader

from tests import workers
from tests.helpers import run_distributed
from trainscale.callbacks import Callback
from trainscale.runtime.checkpoint_io import CheckpointError
from trainscale.loop.trainer import Trainer


@pytest.mark.parametrize("devices", [0, -2])
def test_devices_zero_or_negative(devices):
    with pytest.raises(ValueError, match=r"devices=-?\d+ must be >= 1"):
        Trainer(accelerator="cpu", devices=devices)


def test_unknown_strategy_lists_valid_ones():
    with pytest.raises(ValueError, match=r"unknown strategy='fsdpp'; choose one of 'auto', 'single', 'ddp'"):
        Trainer(accelerator="cpu", strategy="fsdpp")


def test_more_cuda_devices_than_exist(monkeypatch):
    from trainscale.runtime import devices

    monkeypatch.setattr(devices, "cuda_device_count", lambda: 1)
    with pytest.raises(ValueError, match="devices=2 asks for more CUDA devices than the 1 visible"):
        Trainer(accelerator="cuda", devices=2, strategy="ddp")


def test_cuda_on_a_machine_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        Trainer(accelerator="cuda", devices=2, strategy="ddp")


@pytest.mark.parametrize("kwargs, message", [
    ({"max_epochs": -2}, "max_epochs=-2"), ({"accumulate_grad_batches": 0}, "accumulate_grad_batches=0"),
    ({"gradient_clip_val": -1.0}, "gradient_clip_val"), ({"gradient_clip_algorithm": "l2"}, "'norm' or 'value'"),
    ({"max_steps": -2}, "max_steps=-2"),
])
def test_bad_loop_flags(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Trainer(accelerator="cpu", **kwargs)


# Lightning's words, each beside trainscale's own that name the fix: a search for the error Lightning gives finds it
@pytest.mark.parametrize("kwargs, lightnings, ours", [
    ({"max_epochs": -100}, "`max_epochs` must be a non-negative integer or -1", "-1 or None: no limit"),
    ({"max_steps": -2}, "`max_steps` must be a non-negative integer or -1", "0: no training"),
    ({"gradient_clip_algorithm": "norm2"}, "`gradient_clip_algorithm` norm2 is invalid", "choose 'norm' or 'value'"),
    ({"check_val_every_n_epoch": 1.2}, "`check_val_every_n_epoch` should be an integer, found 1.2", "or None"),
    ({"val_check_interval": 0.5, "check_val_every_n_epoch": None},
     "`val_check_interval` should be an integer or a time-based duration", "must be an int"),
])
def test_bad_flags_are_named_in_lightnings_words_and_ours(kwargs, lightnings, ours):
    with pytest.raises(ValueError) as caught:
        Trainer(accelerator="cpu", **kwargs)
    assert lightnings in str(caught.value) and ours in str(caught.value)


def test_errors_lightning_raises_as_another_type_are_both_types(tmp_path):
    with pytest.raises(TypeError, match="`gradient_clip_val` should be an int or a float") as caught:
        Trainer(accelerator="cpu", gradient_clip_val=(1, 2))
    assert isinstance(caught.value, ValueError) and "gradient_clip_val=1.0" in str(caught.value)
    trainer = Trainer(accelerator="cpu", enable_progress_bar=False, default_root_dir=tmp_path)
    for method in ("validate", "test", "predict"):
        with pytest.raises(TypeError, match=rf"`Trainer.{method}\(\)` requires a `LightningModule`") as caught:
            getattr(trainer, method)()
        assert isinstance(caught.value, ValueError) and f"trainer.{method}(model, loader)" in str(caught.value)
    with pytest.raises(AttributeError, match="only possible if a model is attached") as caught:
        trainer.save_checkpoint(tmp_path / "x.ckpt")
    assert isinstance(caught.value, RuntimeError) and "call trainer.fit(model, ...)" in str(caught.value)
    assert not (tmp_path / "x.ckpt").exists()


def test_val_check_interval_beyond_the_epoch_names_both_fixes(tmp_path):
    trainer = Trainer(accelerator="cpu", enable_progress_bar=False, default_root_dir=tmp_path, limit_train_batches=2,
                      val_check_interval=5)
    with pytest.raises(ValueError, match="must be less than or equal to the number of the training batches .*"
                                         "pass check_val_every_n_epoch=None"):
        trainer.fit(workers.make_model(), DataLoader(workers.tiny_dataset(16), batch_size=4),
                    DataLoader(workers.tiny_dataset(8), batch_size=4), optimizer=workers.sgd)


class _Kept(Callback):
    """A callback with a state of its own to save."""

    def state_dict(self):
        return {"kept": 1}


def test_resuming_without_a_callback_whose_state_was_saved_names_it(tmp_path):
    loader = DataLoader(workers.tiny_dataset(16), batch_size=8)
    first = Trainer(accelerator="cpu", enable_progress_bar=False, default_root_dir=tmp_path, callbacks=[_Kept()])
    first.fit(workers.make_model(), loader, optimizer=workers.sgd)
    path = first.save_checkpoint(tmp_path / "kept.ckpt")
    again = Trainer(accelerator="cpu", enable_progress_bar=False, default_root_dir=tmp_path, max_epochs=2)
    with pytest.warns(UserWarning, match=r"Please add the following callbacks: \['_Kept'\]") as caught:
        again.fit(workers.make_model(), loader, optimizer=workers.sgd, ckpt_path=path)
    assert len([w for w in caught if "Please add the following callbacks" in str(w.message)]) == 1
    import warnings  # with the callback, nothing is missed
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        Trainer(accelerator="cpu", enable_progress_bar=False, default_root_dir=tmp_path, max_epochs=2,
                callbacks=[_Kept()]).fit(workers.make_model(), loader, optimizer=workers.sgd, ckpt_path=path)
    assert not [w for w in seen if "Please add the following callbacks" in str(w.message)]


def test_count_flops_with_compile_is_refused():
    with pytest.raises(ValueError, match="count_flops=True cannot be combined with compile.*pass count_flops=None"):
        Trainer(accelerator="cpu", compile=True, count_flops=True)


def test_missing_checkpoint(tmp_path):
    trainer = Trainer(accelerator="cpu", enable_progress_bar=False, default_root_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist; pass an existing checkpoint file, 'last', or None"):
        trainer.fit(workers.make_model(), DataLoader(workers.tiny_dataset(16), batch_size=4), optimizer=workers.sgd,
                    ckpt_path=tmp_path / "missing.pt")
    # "last" on a first run warns and starts fresh, as Lightning does
    with pytest.warns(UserWarning, match="no run of .* has a checkpoint; starting fresh. No checkpoint will be loaded"):
        summary = trainer.fit(workers.make_model(), DataLoader(workers.tiny_dataset(16), batch_size=4),
                              optimizer=workers.sgd, ckpt_path="last")
    assert summary["steps"] == 4 and summary["resumed_from"] is None


def test_corrupted_checkpoint(tmp_path):
    out = workers.trainer_fit(0, str(tmp_path), 16, 1)
    ckpt_dir = tmp_path / "version_0" / "checkpoints"
    path = ckpt_dir / (ckpt_dir / "last").read_text().strip()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    path.write_bytes(bytes(data))
    trainer = Trainer(accelerator="cpu", enable_progress_bar=False, default_root_dir=tmp_path)
    with pytest.raises(CheckpointError, match="corrupted or truncated.*resume from an earlier checkpoint"):
        trainer.fit(workers.make_model(), DataLoader(workers.tiny_dataset(16), batch_size=4), optimizer=workers.sgd,
                    ckpt_path="last")
    assert out["summary"]["epochs"] == 1


def test_no_optimizer():
    trainer = Trainer(accelerator="cpu", enable_progress_bar=False)
    with pytest.raises(ValueError, match="pass optimizer=lambda params"):
        trainer.fit(workers.make_model(), DataLoader(workers.tiny_dataset(16), batch_size=4))


@pytest.mark.multiprocess
def test_missing_and_corrupted_checkpoint_fail_on_every_rank_without_hanging(tmp_path):
    for rank_result in run_distributed(workers.bad_ckpt_body, str(tmp_path / "missing.pt"), timeout=60):
        assert rank_result.startswith("FileNotFoundError") and "does not exist" in rank_result
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint" * 10)
    # its checksum is right: the bytes themselves cannot be read (a file with no checksum is refused earlier)
    (tmp_path / "garbage.pt.sha256").write_text(hashlib.sha256(b"not a checkpoint" * 10).hexdigest() + "\n")
    for rank_result in run_distributed(workers.bad_ckpt_body, str(garbage), timeout=60):
        assert rank_result.startswith("CheckpointError") and "cannot be read" in rank_result
