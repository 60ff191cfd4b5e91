"""Every Trainer and Runtime flag given a wrong type, a negative, zero, NaN and an unknown string: a clear error
naming the flag when the Trainer is made (before any process or file), or a value the flag means something by."""

from __future__ import annotations

import dataclasses
import traceback

import pytest

from trainscale.loop.config import TrainerConfig
from trainscale.loop.trainer import Trainer
from trainscale.runtime.connector import RuntimeFlags

BAD = {"a list": [1], "a negative": -1, "zero": 0, "NaN": float("nan"), "an unknown string": "bogus"}
# The values among BAD that a flag takes, and what they mean (Lightning's meaning where the flag is Lightning's).
ACCEPTED = {
    ("seed", "zero"): "the seed 0 (the default)",
    ("max_epochs", "zero"): "no training (Lightning's max_epochs=0)",
    ("max_steps", "zero"): "no training (Lightning's max_steps=0)",
    ("min_epochs", "zero"): "no minimum of epochs (Lightning's)",
    ("min_steps", "zero"): "no minimum of steps (Lightning's)",
    ("default_root_dir", "an unknown string"): "a relative directory named 'bogus'",
    ("max_nonfinite_skips", "zero"): "raise at the first non-finite step, skip none",
    ("straggler_margin", "zero"): "any rank slower than the median is named a straggler",
    ("lr_warmup_steps", "zero"): "no warm-up",
    ("num_sanity_val_steps", "a negative"): "-1: every validation batch (Lightning's)",
    ("num_sanity_val_steps", "zero"): "no sanity check",
    ("fast_dev_run", "zero"): "off (Lightning's)",
    ("overfit_batches", "zero"): "off (Lightning's)",
    ("deterministic", "zero"): "False (Lightning's flag takes a bool)",
    ("max_epochs", "a negative"): "-1: no limit (Lightning's)",
    ("max_steps", "a negative"): "-1: no limit (Lightning's)",
    ("limit_val_batches", "zero"): "no validation (Lightning's)",
    ("limit_train_batches", "zero"): "no training (Lightning's)",
    ("limit_test_batches", "zero"): "test() runs its setup and teardown hooks only (Lightning's)",
    ("limit_predict_batches", "zero"): "predict() runs its setup and teardown hooks only (Lightning's)",
    ("reload_dataloaders_every_n_epochs", "zero"): "never (the default)",
}
FLAGS = [f.name for f in dataclasses.fields(TrainerConfig)] + [f.name for f in dataclasses.fields(RuntimeFlags)]


@pytest.mark.parametrize("flag", FLAGS)
def test_each_bad_value_of_a_flag_is_refused_naming_it_or_means_something(flag):
    for kind, value in BAD.items():
        flags = {"accelerator": "cpu", flag: value} if flag != "accelerator" else {flag: value}
        try:
            Trainer(enable_progress_bar=False, **flags) if flag != "enable_progress_bar" else Trainer(**flags)
        except (ValueError, TypeError) as err:
            raised_in = traceback.extract_tb(err.__traceback__)[-1].filename
            assert flag in str(err), f"{flag}={value!r} ({kind}): the error does not name the flag: {err}"
            assert "/trainscale/" in raised_in, f"{flag}={value!r} ({kind}) raised inside {raised_in}: {err}"
            assert (flag, kind) not in ACCEPTED, f"{flag}={value!r} is listed as accepted but raised: {err}"
        else:
            assert (flag, kind) in ACCEPTED, f"{flag}={value!r} ({kind}) was accepted silently"
