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
from trainscale.loggers.log_dirs import add_prefix

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

    Lightning's arguments: ``version`` or ``id`` (the W&B run id: a run of that id is continued), ``anonymous=True``
    (W&B's ``anonymous="allow"``), ``dir`` (W&B's local files, when there is no ``save_dir``), ``prefix`` (before
    every metric name, joined by "-"), ``log_model=False`` (uploading checkpoints is not done here: any other value
    is refused, naming what to call instead) and ``checkpoint_name`` (which only ``log_model`` uses). Lightning's
    properties: ``name`` is the project, ``version`` the run id.

    Args:
        project: the W&B project; None: W&B's default (``WANDB_PROJECT`` or "uncategorized").
        name: the run's display name; None: the run directory's name (``version_N``).
        save_dir: where W&B writes its local files; None: ``dir``, else the run directory.
        offline: write locally only, upload nothing.
        version: the run id (Lightning's name; ``id`` is the same).
        dir: where W&B writes its local files when ``save_dir`` is None.
        id: the run id; None: the resumed run's, else a new one.
        anonymous: True: W&B's ``anonymous="allow"`` (an anonymous run without an account).
        log_model: only False (see above).
        prefix: put before every metric name, joined by "-" (Lightning's ``LOGGER_JOIN_CHAR``).
        checkpoint_name: the model artifact's name with ``log_model``; accepted, unused.
        **init_kwargs: passed to ``wandb.init`` (``entity``, ``tags``, ``group``, ``notes``, ...);
            an unknown one makes ``wandb.init`` raise TypeError at setup.

    Raises:
        ModuleNotFoundError: wandb is not installed (names the pip command).
        ValueError: ``log_model`` other than False; ``version`` and ``id`` both given and different; an online run
            without W&B credentials (:func:`check_login`).
    """

    def __init__(self, project: str | None = None, name: str | None = None, save_dir: str | os.PathLike | None = None,
                 offline: bool = False, *, version: str | None = None, dir: str | os.PathLike | None = None,
                 id: str | None = None, anonymous: bool | None = None, log_model: bool | str = False,
                 prefix: str = "", checkpoint_name: str | None = None, **init_kwargs: Any) -> None:
        require("WandbLogger", "wandb", "wandb")
        if log_model is not False:
            raise ValueError(f"WandbLogger(log_model={log_model!r}): trainscale does not upload checkpoints to W&B; "
                             "pass log_model=False and upload one yourself after fit: logger.experiment.log_model("
                             "trainer.checkpoint_callback.best_model_path) (a wandb.Run method)")
        if version is not None and id is not None and version != id:
            raise ValueError(f"WandbLogger(version={version!r}, id={id!r}): both name the run id; pass one")
        if version or id:
            init_kwargs["id"] = version or id
        if anonymous:
            init_kwargs["anonymous"] = "allow"
        check_login(offline, init_kwargs)
        self.project, self.run_name, self.offline, self.prefix = project, name, offline, prefix
        given = save_dir if save_dir is not None else dir
        self.save_dir = Path(given) if given is not None else None
        self.checkpoint_name = checkpoint_name
        self.init_kwargs = init_kwargs
        self._run = None

    @property
    def name(self) -> str | None:
        """The W&B project (Lightning's ``WandbLogger.name``; the run's display name is :attr:`run_name`)."""
        return self.project

    @property
    def version(self) -> str | None:
        """The W&B run id (Lightning's ``WandbLogger.version``): the run's once set up, else the one given."""
        return self._run.id if self._run is not None else self.init_kwargs.get("id")

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
        self._run = wandb.init(project=self.project, name=self.run_name or run_dir.name, dir=str(save_dir), **kwargs)
        keep_run_id(run_dir, RUN_ID_FILE, ident)
        self._run.define_metric(STEP_METRIC)
        self._run.define_metric("*", step_metric=STEP_METRIC, step_sync=True)

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        self.experiment.config.update(dict(params), allow_val_change=True)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.experiment.log({**add_prefix(metrics, self.prefix), STEP_METRIC: step})

    def finalize(self, status: str) -> None:
        check_status(status)
        if self._run is not None:
            self._run.finish(exit_code=0 if status == "success" else 1)
            self._run = None
