"""Run on a rank forked by ``tests.helpers.run_distributed``: a process that has imported torch but not
trainscale, so what a default fit imports shows in ``sys.modules``. Imports nothing of trainscale at its top."""

import os
import sys
import tempfile


def default_fit_imported_tensorboard_modules(rank: int) -> list:
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)  # a plain ``python`` process, not a launched rank
    assert not [m for m in sys.modules if "tensorboard" in m]  # nothing before the fit
    from torch.utils.data import DataLoader

    from tests import workers
    from trainscale import Trainer

    Trainer(max_epochs=1, enable_progress_bar=False, default_root_dir=tempfile.mkdtemp()).fit(
        workers.make_model(), DataLoader(workers.tiny_dataset(16), batch_size=8), optimizer=workers.sgd)
    return sorted(m for m in sys.modules if "tensorboard" in m)
