"""``WandbLogger``: a Weights & Biases run.

Needs ``wandb`` (``pip install 'trainscale[wandb]'``), imported at :meth:`WandbLogger.setup`, not with
this module. https://docs.wandb.ai/ref/python/init
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any, Mapping

from trainscale.loggers.base import check_status, experiment_or_dummy, keep_run_id, require, run_id

STEP_METRIC = "trainer/global_step"  # Lightning's name, so ported dashboards keep their x-axis
RUN_ID_FILE = "wandb_run_id"


class WandbLogger:
    """Metrics, hyperparameters (the run's config) and the run's end state in a W&B run.

    ``wandb.init`` is called at :meth:`setup` with ``dir`` = ``save_dir`` or the run directory (W&B
    writes ``<dir>/wandb/run-...`` or, offline, ``<dir>/wandb/offline-run-...``) and ``name`` = ``name``
    or the run directory's name. Metrics are logged with ``trainer/global_step`` = ``step`` and every
    chart uses it as its x-axis (``define_metric("*", step_metric=...)``, as Lightning's WandbLogger), so
    steps that repeat after a resume are accepted (W&B's own ``step=`` must only increase).
    A resumed run (``setup`` again on the same run directory) continues the same W&B run: its id is
    kept in ``<run dir>/wandb_run_id`` and passed with ``resume="allow"``.

    Offline: ``offline=True`` or the environment variable ``WANDB_MODE=offline`` (W&B's own); upload
    later with ``wandb sync <dir>/wandb/offline-run-...``. :meth:`finalize` ends the run with exit
    code 0 ("success") or 1 ("failed").

    The Trainer calls a logger on rank zero only (see :class:`trainscale.loggers.Logger`).

    Args:
        project: the W&B project; None: W&B's default (``WANDB_PROJECT`` or "uncategorized").
        name: the run's display name; None: the run directory's name (``version_N``).
        save_dir: where W&B writes its local files; None: the run directory.
        offline: write locally only, upload nothing.
        **init_kwargs: passed to ``wandb.init`` (``entity``, ``tags``, ``group``, ``notes``, ``id``, ...);
            an unknown one makes ``wandb.init`` raise TypeError at setup.

    Raises:
        ModuleNotFoundError: wandb is not installed (names the pip command).
    """

    def __init__(self, project: str | None = None, name: str | None = None, save_dir: str | os.PathLike | None = None,
                 offline: bool = False, **init_kwargs: Any) -> None:
        require("WandbLogger", "wandb", "wandb")
        self.project, self.name, self.offline = project, name, offline
        self.save_dir = Path(save_dir) if save_dir is not None else None
        self.init_kwargs = init_kwargs
        self._run = None

    @property
    def experiment(self):
        """The ``wandb.Run`` (for tables, images, artifacts, ...), after setup; on the other ranks a no-op
        ``DummyExperiment`` (``trainscale.loggers.base.experiment_or_dummy``)."""
        return experiment_or_dummy(self._run, "WandbLogger")

    def setup(self, run_dir: str | os.PathLike) -> None:
        import wandb

        run_dir = Path(run_dir)
        save_dir = self.save_dir or run_dir
        save_dir.mkdir(parents=True, exist_ok=True)
        ident = self.init_kwargs.get("id") or run_id(run_dir, RUN_ID_FILE) or secrets.token_hex(4)
        kwargs = {"resume": "allow", **self.init_kwargs, "id": ident}
        if self.offline:
            kwargs["mode"] = "offline"
        self._run = wandb.init(project=self.project, name=self.name or run_dir.name, dir=str(save_dir), **kwargs)
        keep_run_id(run_dir, RUN_ID_FILE, ident)
        self._run.define_metric(STEP_METRIC)
        self._run.define_metric("*", step_metric=STEP_METRIC, step_sync=True)

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        self.experiment.config.update(dict(params), allow_val_change=True)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.experiment.log({**metrics, STEP_METRIC: step})

    def finalize(self, status: str) -> None:
        check_status(status)
        if self._run is not None:
            self._run.finish(exit_code=0 if status == "success" else 1)
            self._run = None
