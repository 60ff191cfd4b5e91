"""``WandbLogger``: a Weights & Biases run.

Needs ``wandb`` (``pip install 'trainscale[wandb]'``), imported at :meth:`WandbLogger.setup`, not with
this module (and, to look up credentials, when an online logger is made without ``WANDB_API_KEY``: about 1 s). https://docs.wandb.ai/ref/python/init
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any, Mapping

from trainscale.loggers.base import check_status, experiment_or_dummy, keep_run_id, require, run_id

STEP_METRIC = "trainer/global_step"  # Lightning's name, so ported dashboards keep their x-axis
RUN_ID_FILE = "wandb_run_id"
_LOCAL_MODES = ("offline", "dryrun", "disabled")


def check_login(offline: bool, init_kwargs: dict) -> None:
    """An online run needs W&B credentials: ``WANDB_API_KEY``, a netrc entry for the W&B host (``wandb login``) or
    ones W&B's settings hold, looked up by W&B's own ``authenticate_session(prompt=False)``. Without them
    ``wandb.init`` asks on the terminal (rank zero only: the other ranks wait) or fails at rank zero's setup.
    Checked when the logger is made, on every rank. Offline, disabled and anonymous runs need none.

    Raises:
        ValueError: one line naming the fixes.
    """
    mode = "offline" if offline else init_kwargs.get("mode") or os.environ.get("WANDB_MODE", "online")
    if mode in _LOCAL_MODES or init_kwargs.get("anonymous") in ("allow", "must") or os.environ.get("WANDB_API_KEY"):
        return
    try:
        from wandb.sdk.lib.wbauth import authenticate_session
    except ImportError:  # another wandb version: wandb.init reports it itself
        return
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
    if authenticate_session(host=host, source="WandbLogger", prompt=False, update_session=False) is None:
        raise ValueError(f"WandbLogger: no W&B credentials for {host} (WANDB_API_KEY is not set and no netrc entry): "
                         "run `wandb login` once, or set WANDB_API_KEY, or log locally with WandbLogger(offline=True) "
                         "(or WANDB_MODE=offline) and upload later with `wandb sync`")


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
        ValueError: an online run without W&B credentials (:func:`check_login`).
    """

    def __init__(self, project: str | None = None, name: str | None = None, save_dir: str | os.PathLike | None = None,
                 offline: bool = False, **init_kwargs: Any) -> None:
        require("WandbLogger", "wandb", "wandb")
        check_login(offline, init_kwargs)
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
