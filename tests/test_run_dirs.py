"""Run directories and checkpoint names (train/checkpoint.py): rotation order, old names."""

from __future__ import annotations

from trainscale.train import checkpoint as ckpt


def _save(ckpt_dir, name, keep_last):
    path = ckpt_dir / name
    path.write_bytes(b"x")
    (ckpt_dir / f"{name}.sha256").write_text("0" * 64)
    ckpt.mark_last(path, keep_last=keep_last)
    return path


def test_keep_last_keeps_the_newest_checkpoints_past_step_999999(tmp_path):
    ckpt_dir = tmp_path / "checkpoints"
    ckpt_dir.mkdir()
    for step in (999_998, 999_999, 1_000_000, 1_000_001):
        _save(ckpt_dir, ckpt.checkpoint_name(3, step), keep_last=2)
    kept = sorted(p.name for p in ckpt_dir.glob("*.pt"))
    assert kept == [ckpt.checkpoint_name(3, 1_000_000), ckpt.checkpoint_name(3, 1_000_001)]
    assert (ckpt_dir / "last").read_text().strip() == ckpt.checkpoint_name(3, 1_000_001)


def test_keep_last_orders_old_six_digit_names_by_epoch_and_step(tmp_path):
    # names written before the wider padding, in one run with new ones (a resumed old run)
    ckpt_dir = tmp_path / "checkpoints"
    ckpt_dir.mkdir()
    for name in ("epoch=0009-step=999999.pt", "epoch=0010-step=1000000.pt"):
        (ckpt_dir / name).write_bytes(b"x")
    _save(ckpt_dir, ckpt.checkpoint_name(10, 1_000_001), keep_last=2)
    assert sorted(p.name for p in ckpt_dir.glob("*.pt")) == ["epoch=000010-step=0001000001.pt",
                                                            "epoch=0010-step=1000000.pt"]


def test_checkpoint_names_sort_as_text_in_training_order():
    pairs = [(0, 5), (1, 999_999), (1, 1_000_000), (2, 10**9), (12_000, 10**9 + 1)]
    names = [ckpt.checkpoint_name(epoch, step) for epoch, step in pairs]
    assert sorted(names) == names
    assert [ckpt.checkpoint_order(name) for name in names] == pairs
    assert ckpt.checkpoint_order("notes.txt") is None and ckpt.checkpoint_order("last") is None
