"""Lightning's hooks on the module and on callbacks: called at Lightning's points, in Lightning's order.

The expected lists are Lightning's (``tests/tests_pytorch/models/test_hooks.py``: ``HookedModel._auto_train_batch``,
``_manual_train_batch``, ``_eval_epoch``, ``_predict_batch`` and ``test_trainer_model_hook_system_fit``), keeping the
hooks recorded here and leaving out the others (the batch-transfer, ``configure_*`` and mode hooks, checked in
``tests/test_model_hooks.py``; ``setup``/``teardown``, the data hooks). The sanity check runs as Lightning's (``num_sanity_val_steps=2`` by default:
``Callback.on_sanity_check_start``, a validation epoch of at most 2 batches, ``Callback.on_sanity_check_end``, between
``on_fit_start`` and ``on_train_start``). As in Lightning's test, a call is recorded when it returns, so ``training_step`` comes
after the hooks that run inside it under manual optimization. One documented difference is applied to Lightning's
list explicitly: ``on_before_zero_grad``.
"""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainscale.callbacks import Callback
from trainscale.lightning.module import MODULE_HOOKS, TrainingModule
from trainscale.loop.trainer import Trainer

CALLBACK_HOOKS = [name for name in vars(Callback) if name.startswith("on_")]
BATCH_ARG = {"on_train_batch_start": 1, "on_train_batch_end": 2}  # where batch_idx is among the module hook's args
for _stage in ("validation", "test", "predict"):
    BATCH_ARG[f"on_{_stage}_batch_start"], BATCH_ARG[f"on_{_stage}_batch_end"] = 1, 2


def _entry(name, args, prefix=""):
    return (prefix + name, args[BATCH_ARG[name]]) if name in BATCH_ARG else prefix + name


class HookedCallback(Callback):
    def __init__(self, called):
        self.called = called


def _record_callback(name):
    def hook(self, trainer, module, *args):
        self.called.append(_entry(name, args, "Callback."))
    return hook


for _name in CALLBACK_HOOKS:
    if _name != "on_exception":
        setattr(HookedCallback, _name, _record_callback(_name))


def _record_module(name):
    def hook(self, *args):
        self.called.append(_entry(name, args))
    return hook


class HookedModel(TrainingModule):
    def __init__(self, called, automatic=True):
        super().__init__()
        self.called = called
        self.automatic_optimization = automatic
        self.layer = nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch[0]).pow(2).mean()
        if not self.automatic_optimization:  # Lightning's test_trainer_model_hook_system_fit, manual branch
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step(lambda: self.called.append("closure"))
        self.called.append(("training_step", batch_idx))
        return loss

    def validation_step(self, batch, batch_idx):
        self.called.append(("validation_step", batch_idx))
        return {"x": self.layer(batch[0]).mean()}

    def test_step(self, batch, batch_idx):
        self.called.append(("test_step", batch_idx))
        return {"y": self.layer(batch[0]).mean()}

    def predict_step(self, batch, batch_idx):
        self.called.append(("predict_step", batch_idx))
        return self.layer(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


for _name in MODULE_HOOKS:
    setattr(HookedModel, _name, _record_module(_name))


def both(name, i=None):
    """Lightning's pair: the callbacks' hook, then the module's."""
    return [f"Callback.{name}", name] if i is None else [(f"Callback.{name}", i), (name, i)]


def auto_train_batch(i):
    # Lightning: training_step, on_before_zero_grad, (zero_grad), on_before_backward, (backward),
    # on_after_backward, on_before_optimizer_step, (clip, step), on_train_batch_end.
    lightning = [*both("on_train_batch_start", i), ("training_step", i), *both("on_before_zero_grad"),
                 *both("on_before_backward"), *both("on_after_backward"), *both("on_before_optimizer_step"),
                 *both("on_train_batch_end", i)]
    # The one difference (docs/lightning.md): trainscale zeroes the gradients at the same micro-batch, but before
    # its training_step rather than after it, so that the last step's gradients are not held through the forward;
    # on_before_zero_grad sees the same state as in Lightning, once per optimizer step as in Lightning.
    zero = lightning.index("Callback.on_before_zero_grad")
    moved = lightning[zero:zero + 2]
    rest = lightning[:zero] + lightning[zero + 2:]
    forward = rest.index(("training_step", i))
    return rest[:forward] + moved + rest[forward:]


def manual_train_batch(i):
    return [*both("on_train_batch_start", i), *both("on_before_backward"), *both("on_after_backward"), "closure",
            *both("on_before_optimizer_step"), ("training_step", i), *both("on_train_batch_end", i)]


def eval_epoch(stage, step, batches):
    per_batch = [e for i in range(batches) for e in
                 (*both(f"on_{stage}_batch_start", i), (step, i), *both(f"on_{stage}_batch_end", i))]
    return [*both(f"on_{stage}_start"), *both(f"on_{stage}_epoch_start"), *per_batch, *both(f"on_{stage}_epoch_end"),
            *both(f"on_{stage}_end")]


def fit_hooks(train_batch, batches, val_batches, sanity_batches=2):
    # test_trainer_model_hook_system_fit: the sanity check (callbacks only have its own hooks) before on_train_start
    sanity = ["Callback.on_sanity_check_start", *eval_epoch("validation", "validation_step", sanity_batches),
              "Callback.on_sanity_check_end"] if sanity_batches else []
    return [*both("on_fit_start"), *sanity, *both("on_train_start"), *both("on_train_epoch_start"),
            *[e for i in range(batches) for e in train_batch(i)],
            *eval_epoch("validation", "validation_step", val_batches),
            *both("on_train_epoch_end"), *both("on_save_checkpoint"), *both("on_train_end"), *both("on_fit_end")]


def _loader(n=4):
    return DataLoader(TensorDataset(torch.randn(n, 2), torch.zeros(n)), batch_size=2)


def _trainer(tmp_path, called, **kw):
    return Trainer(accelerator="cpu", enable_progress_bar=False, default_root_dir=tmp_path,
                   callbacks=[HookedCallback(called)], **{"max_epochs": 1, **kw})


@pytest.mark.timeout(60)
@pytest.mark.parametrize("automatic", [True, False])
def test_fit_calls_every_hook_in_lightnings_order(tmp_path, automatic):
    called = []
    model = HookedModel(called, automatic)
    _trainer(tmp_path, called).fit(model, _loader(), _loader())
    assert called == fit_hooks(auto_train_batch if automatic else manual_train_batch, 2, 2)


@pytest.mark.timeout(60)
def test_accumulation_calls_the_step_hooks_once_per_optimizer_step(tmp_path):
    called = []
    _trainer(tmp_path, called, accumulate_grad_batches=2).fit(HookedModel(called), _loader(4))
    steps = [e for e in called if e in ("on_before_optimizer_step", "on_before_zero_grad")]
    assert steps == ["on_before_zero_grad", "on_before_optimizer_step"]  # 2 micro-batches, 1 step: zeroed at the first
    assert called.count("on_before_backward") == called.count("on_after_backward") == 2
    assert [e for e in called if isinstance(e, tuple) and e[0] == "on_train_batch_end"] == [
        ("on_train_batch_end", 0), ("on_train_batch_end", 1)]


@pytest.mark.timeout(60)
def test_resume_calls_the_modules_on_load_checkpoint_before_the_callbacks(tmp_path):
    _trainer(tmp_path, []).fit(HookedModel([]), _loader())
    called = []
    _trainer(tmp_path, called, max_epochs=2).fit(HookedModel(called), _loader(), ckpt_path="last")
    # test_trainer_model_hook_system_fit_no_val_and_resume_max_epochs: on_load_checkpoint, then the callback's,
    # then on_fit_start ...
    assert called[:4] == ["on_load_checkpoint", "Callback.on_load_checkpoint", "Callback.on_fit_start",
                          "on_fit_start"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("verb", "stage", "step"), [("validate", "validation", "validation_step"),
                                                     ("test", "test", "test_step")])
def test_evaluation_calls_its_hooks_in_lightnings_order(tmp_path, verb, stage, step):
    called = []
    getattr(_trainer(tmp_path, called), verb)(HookedModel(called), _loader())
    assert called == eval_epoch(stage, step, 2)  # test_trainer_model_hook_system_eval


@pytest.mark.timeout(60)
def test_predict_calls_its_hooks_in_lightnings_order(tmp_path):
    called = []
    _trainer(tmp_path, called).predict(HookedModel(called), _loader())
    per_batch = [e for i in range(2) for e in
                 (*both("on_predict_batch_start", i), ("predict_step", i), *both("on_predict_batch_end", i))]
    assert called == [*both("on_predict_start"), *both("on_predict_epoch_start"), *per_batch,
                      *both("on_predict_epoch_end"), *both("on_predict_end")]  # test_trainer_model_hook_system_predict


@pytest.mark.timeout(60)
def test_what_the_module_logs_in_on_train_epoch_end_reaches_the_record_and_early_stopping(tmp_path):
    from trainscale.callbacks import EarlyStopping

    class LogsAtEpochEnd(HookedModel):
        def on_train_epoch_end(self):
            self.log("epoch_score", 1.0)  # never improves after the first epoch

    stop = EarlyStopping("epoch_score", patience=1)
    trainer = _trainer(tmp_path, [], max_epochs=5)
    trainer.callbacks.append(stop)
    trainer.fit(LogsAtEpochEnd([]), _loader())
    assert [r["epoch_score"] for r in trainer.history] == [1.0, 1.0]
    assert stop.stopped_epoch == 1
