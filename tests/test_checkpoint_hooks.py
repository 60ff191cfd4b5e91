"""``on_load_checkpoint`` as Lightning defines it: the hook sees the checkpoint as read, the weights under
``state_dict`` as a state dict, and what it changes there is what the model gets (the way a port renames the
weights of an older layout); ``Runtime.load``'s ``before_restore`` underneath, on one process and on 2 ranks.
Objects of the user's classes that ``on_save_checkpoint`` or a callback's state saves are kept apart, pickled: the
checkpoint still loads weights-only, ``weights_only=False`` gives them back to the hooks, and without it the resume
is refused before anything is restored (a file and a sharded directory on 2 fsdp ranks)."""

import collections

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests import ckpt_workers
from tests.helpers import run_distributed
from trainscale.callbacks import Callback
from trainscale.lightning.module import TrainingModule
from trainscale.loop.trainer import Trainer
from trainscale.runtime.checkpoint_io import CheckpointError
from trainscale.runtime.runtime import Runtime


class Old(TrainingModule):
    """A one-layer model whose layer is called ``old``."""

    def __init__(self):
        super().__init__()
        self.old = nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.forward_layer(batch[0]).pow(2).mean()

    def forward_layer(self, x):
        return self.old(x)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Renamed(Old):
    """The same model after its layer was renamed ``new``: ``on_load_checkpoint`` renames the saved weights."""

    def __init__(self):
        TrainingModule.__init__(self)
        self.new = nn.Linear(2, 1)
        self.seen: dict = {}

    def forward_layer(self, x):
        return self.new(x)

    def on_load_checkpoint(self, checkpoint):
        self.seen = {key: isinstance(value, dict) and all(isinstance(v, torch.Tensor) for v in value.values())
                     for key, value in checkpoint.items()}  # which entries are state dicts
        weights = checkpoint["state_dict"]
        for key in [k for k in weights if k.startswith("old.")]:
            weights["new." + key[len("old."):]] = weights.pop(key)


class Notes(Callback):
    """Notes the weight names the callbacks' ``on_load_checkpoint`` sees (after the module's hook renamed them)."""

    def __init__(self):
        self.names: list[str] = []

    def on_load_checkpoint(self, trainer, pl_module, checkpoint):
        self.names = sorted(checkpoint["state_dict"])


def _loader():
    x = torch.linspace(-1, 1, 16).reshape(8, 2)
    return DataLoader(TensorDataset(x, torch.zeros(8)), batch_size=2)


def _trainer(tmp_path, **kw):
    return Trainer(accelerator="cpu", enable_progress_bar=False, enable_model_summary=False,
                   default_root_dir=tmp_path, num_sanity_val_steps=0, **kw)


@pytest.mark.timeout(60)
def test_a_resumed_fit_loads_the_weights_as_on_load_checkpoint_left_them(tmp_path):
    old = Old()
    _trainer(tmp_path, max_epochs=1).fit(old, _loader())
    saved = old.old.weight.detach().clone()
    renamed, notes = Renamed(), Notes()
    trainer = _trainer(tmp_path, max_epochs=1, callbacks=[notes])
    trainer.fit(renamed, _loader(), ckpt_path="last")  # the epoch is complete: nothing more trains
    assert renamed.seen["state_dict"] and renamed.seen["epoch"] is False
    assert notes.names == ["new.bias", "new.weight"]  # the module's hook ran first, as Lightning's
    assert torch.equal(renamed.new.weight, saved)


@pytest.mark.timeout(60)
def test_without_the_rename_the_resume_is_refused_naming_the_entry(tmp_path):
    _trainer(tmp_path, max_epochs=1).fit(Old(), _loader())

    class Plain(Renamed):
        def on_load_checkpoint(self, checkpoint):
            pass

    with pytest.raises(Exception, match="does not fit"):
        _trainer(tmp_path, max_epochs=1).fit(Plain(), _loader(), ckpt_path="last")


@pytest.mark.timeout(60)
def test_load_from_checkpoint_loads_the_weights_as_on_load_checkpoint_left_them(tmp_path):
    old = Old()
    trainer = _trainer(tmp_path, max_epochs=1)
    trainer.fit(old, _loader())
    loaded = Renamed.load_from_checkpoint(trainer.checkpoint_callback.best_model_path)
    assert loaded.seen["state_dict"]
    assert torch.equal(loaded.new.weight, old.old.weight.detach())


@pytest.mark.timeout(60)
def test_runtime_load_lets_before_restore_change_a_file_checkpoint(tmp_path):
    runtime = Runtime(accelerator="cpu")
    model = nn.Linear(2, 1)
    runtime.save(tmp_path / "ck.pt", {"model": model, "step": 3})
    fresh = nn.Linear(2, 1)

    def halve(entries):
        assert entries["step"] == 3 and set(entries["model"]) == {"weight", "bias"}
        entries["model"]["weight"] = entries["model"]["weight"] / 2

    rest = runtime.load(tmp_path / "ck.pt", {"model": fresh}, before_restore=halve)
    assert rest["step"] == 3
    assert torch.equal(fresh.weight, model.weight.detach() / 2)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_before_restore_is_called_once_per_rank_under_ddp_and_fsdp(tmp_path, strategy):
    results = run_distributed(ckpt_workers.before_restore_body, str(tmp_path), strategy, timeout=55)
    for found in results:
        assert found["step"] == 4 and len(found["seen"]) == 1
        # a file holds the weights; a sharded directory's weights are read in place, its plain entries seen
        assert ("model" in found["seen"][0]) == (strategy == "ddp")


# -- objects of the user's classes that on_save_checkpoint or a callback's state_dict() saves ------------------
class Note:
    """An object of a class of the user's own: ``torch.load(weights_only=True)`` refuses it."""

    def __init__(self, value):
        self.value = value


class Keeps(Old):
    """Adds a ``Note`` to every checkpoint (Lightning's checkpointing guide: a pickable object of one's own) and
    one value a weights-only load reads although it is not of a plain type (a ``Counter``); notes what its
    ``on_load_checkpoint`` sees."""

    def __init__(self, value=1):
        super().__init__()
        self.value, self.seen = value, None

    def on_save_checkpoint(self, checkpoint):
        checkpoint["something_cool"] = Note(self.value)
        checkpoint["counts"] = collections.Counter(a=self.value)

    def on_load_checkpoint(self, checkpoint):
        self.seen = checkpoint.get("something_cool"), checkpoint.get("counts")


class NoteState(Callback):
    """A callback whose state holds a ``Note``, and whose ``on_save_checkpoint`` adds one; ``restored`` is what its
    ``load_state_dict`` got, ``added`` what its ``on_load_checkpoint`` found."""

    def __init__(self, value=None):
        self.value, self.restored, self.added = value, None, None

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        checkpoint["from_callback"] = Note(self.value + 1)

    def on_load_checkpoint(self, trainer, pl_module, checkpoint):
        self.added = checkpoint.get("from_callback")

    def state_dict(self):
        return {"note": Note(self.value)}

    def load_state_dict(self, state_dict):
        self.restored = state_dict["note"]


def _latest(tmp_path):
    return sorted(tmp_path.rglob("*.ckpt"), key=lambda p: p.stat().st_mtime)[-1]


@pytest.mark.timeout(60)
def test_resume_with_weights_only_false_gives_the_hooks_and_callbacks_the_saved_objects(tmp_path):
    _trainer(tmp_path, max_epochs=1, callbacks=[NoteState(7)]).fit(Keeps(5), _loader())
    saved = torch.load(_latest(tmp_path), weights_only=True)  # the file always loads weights-only
    assert "something_cool" not in saved and saved["counts"] == collections.Counter(a=5)  # a Counter stays in place
    kept_apart = sorted(r["path"][0] for r in saved["pickled_entries"])
    assert kept_apart == ["callbacks", "from_callback", "something_cool"]
    module, callback = Keeps(), NoteState()
    _trainer(tmp_path, max_epochs=1, callbacks=[callback]).fit(module, _loader(), ckpt_path="last",
                                                               weights_only=False)
    note, counts = module.seen
    assert isinstance(note, Note) and note.value == 5 and counts == collections.Counter(a=5)
    assert isinstance(callback.restored, Note) and callback.restored.value == 7
    assert isinstance(callback.added, Note) and callback.added.value == 8


@pytest.mark.timeout(60)
@pytest.mark.parametrize("weights_only", [None, True])
def test_without_weights_only_false_the_resume_is_refused_before_anything_is_restored(tmp_path, weights_only):
    _trainer(tmp_path, max_epochs=1, callbacks=[NoteState(7)]).fit(Keeps(5), _loader())
    module, callback = Keeps(), NoteState()
    before = module.old.weight.detach().clone()
    with pytest.raises(CheckpointError) as refused:
        _trainer(tmp_path, max_epochs=2, callbacks=[callback]).fit(module, _loader(), ckpt_path="last",
                                                                   weights_only=weights_only)
    message = str(refused.value)
    assert "'something_cool': tests.test_checkpoint_hooks.Note" in message
    assert "callbacks['NoteState']: tests.test_checkpoint_hooks.Note" in message
    assert "'from_callback': tests.test_checkpoint_hooks.Note" in message
    assert "weights_only=False" in message and "trust" in message and "delete" not in message
    assert module.seen is None and callback.restored is None and callback.added is None  # no hook ran, nothing loaded
    assert torch.equal(module.old.weight.detach(), before)


@pytest.mark.timeout(60)
def test_load_from_checkpoint_unpickles_the_objects_for_on_load_checkpoint_with_weights_only_false(tmp_path):
    trainer = _trainer(tmp_path, max_epochs=1)
    trainer.fit(Keeps(5), _loader())
    path = trainer.checkpoint_callback.best_model_path
    assert Keeps.load_from_checkpoint(path, weights_only=False).seen[0].value == 5
    with pytest.raises(CheckpointError, match="'something_cool': tests.test_checkpoint_hooks.Note"):
        Keeps.load_from_checkpoint(path)
    assert isinstance(Old.load_from_checkpoint(path), Old)  # no on_load_checkpoint: the objects are not needed


@pytest.mark.timeout(60)
def test_an_object_pickle_cannot_write_is_refused_at_the_save_naming_its_key(tmp_path):
    class Lambda(Keeps):
        def on_save_checkpoint(self, checkpoint):
            checkpoint["scorer"] = lambda x: x

    trainer = _trainer(tmp_path, max_epochs=1, enable_checkpointing=False)
    trainer.fit(Lambda(), _loader())
    target = tmp_path / "by_hand.ckpt"
    with pytest.raises(TypeError, match=r"checkpoint entry 'scorer' \(function\) cannot be saved: pickle cannot "
                                        r"write it .*not a lambda"):
        trainer.save_checkpoint(target)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == []  # no file, no temporary file


@pytest.mark.timeout(60)
def test_a_file_with_objects_a_weights_only_load_refuses_is_not_called_corrupted(tmp_path):
    """A file written by other means (Lightning pickles the user's objects into its checkpoints): no advice to
    delete it; a truncated one still is corrupted."""
    from trainscale.runtime import checkpoint_io

    model = Old()
    foreign = tmp_path / "lightning.ckpt"
    torch.save({"state_dict": model.state_dict(), "something_cool": Note(1)}, foreign)
    with pytest.raises(CheckpointError) as refused:
        checkpoint_io.load_file(foreign, verify=False)
    message = str(refused.value)
    assert "refuses, such as tests.test_checkpoint_hooks.Note" in message and "no sign of damage" in message
    assert "weights_only=False" in message and "trust" in message
    assert "corrupted" not in message and "delete" not in message
    with pytest.raises(CheckpointError, match="weights-only load"):
        _trainer(tmp_path, max_epochs=1).fit(Old(), _loader(), ckpt_path=foreign, ckpt_verify=False)
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(foreign.read_bytes()[:-200])
    with pytest.raises(CheckpointError, match="corrupted, truncated"):
        checkpoint_io.load_file(cut, verify=False)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_keep_the_objects_apart_and_refuse_them_on_every_rank(tmp_path, strategy):
    """A checkpoint file (ddp) and a sharded directory's extra file (fsdp): no hang, no partial restore."""
    results = run_distributed(ckpt_workers.pickled_entries_body, str(tmp_path), strategy, timeout=55)
    assert len(results) == 2
    for found in results:
        assert found["extra_loads_weights_only"] and found["kept_apart"] == ["something_cool"]
        assert "'something_cool': tests.ckpt_workers.Cool" in found["refused"]
        assert found["unchanged_after_refusal"]
        assert found["seen"] == 5
