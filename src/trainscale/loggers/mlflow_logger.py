"""``MLFlowLogger``: an MLflow run, by default in a local SQLite store.

Needs ``mlflow-skinny`` with SQLAlchemy and Alembic for database stores (``pip install
'trainscale[mlflow]'``; the full ``mlflow`` package works too), imported at :meth:`MLFlowLogger.setup`,
not with this module. https://mlflow.org/docs/latest/api_reference/python_api/mlflow.client.html
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any, Mapping

from trainscale.loggers.base import check_status, experiment_or_dummy, flatten, keep_run_id, require, run_id
from trainscale.loggers.log_dirs import add_prefix

RUN_ID_FILE = "mlflow_run_id"
_BATCH = 1000  # MLflow's limit of metrics in one log_batch call (MAX_METRICS_PER_BATCH)
_PARAM_BATCH = 100  # and of params (MAX_PARAMS_TAGS_PER_BATCH)
_PARAM_VALUE_LENGTH = 6000  # MLflow 3's MAX_PARAM_VAL_LENGTH: longer values are refused
CONNECT_TIMEOUT_S = 5.0
# MLflow's REST client settings (environment variables it reads), set when the user has not: a tracking server
# that stops answering fails a call within about a minute instead of retrying 7 times with backoff.
_HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}


# The schemes of MLflow's own tracking stores (mlflow/tracking/_tracking_service/utils.py,
# _register_tracking_stores); a plug-in adds its own through the "mlflow.tracking_store" entry points.
_STORE_SCHEMES = ("", "file", "http", "https", "databricks", "databricks-uc", "uc", "sqlite", "postgresql", "mysql",
                  "mssql")


def check_tracking_uri(uri: str) -> None:
    """``uri`` names a kind of store MLflow can track to: one of ``_STORE_SCHEMES`` (a database scheme with its
    driver, ``postgresql+psycopg2://``, included), a plain path, or a plug-in's scheme. Checked when the logger is
    made, on every rank: MLflow itself would refuse it at rank zero's first record.

    Raises:
        ValueError: naming the scheme and the stores to use instead.
    """
    import importlib.metadata
    from urllib.parse import urlsplit

    scheme = urlsplit(uri).scheme.lower()
    scheme = "" if len(scheme) == 1 else scheme.split("+")[0]  # C:\\ is a Windows path
    plugins = {entry.name for entry in importlib.metadata.entry_points(group="mlflow.tracking_store")}
    if scheme not in _STORE_SCHEMES and scheme not in plugins:
        raise ValueError(f"MLFlowLogger(tracking_uri={uri!r}): MLflow has no tracking store for '{scheme}://'; use a "
                         "tracking server (http://HOST:5000), a database (sqlite:///path/mlflow.db, postgresql://, "
                         "mysql://, mssql://), databricks, or None for the default SQLite store. Artifact stores "
                         "(s3://, gs://, ...) are the server's --artifacts-destination, not a tracking URI")


def _check_reachable(uri: str) -> None:
    """Open (and close) a TCP connection to an ``http(s)://`` tracking server, within ``CONNECT_TIMEOUT_S``.

    Raises:
        ConnectionError: nothing accepts it, naming the URI and the fixes.
    """
    from urllib.parse import urlsplit

    parts = urlsplit(uri)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as err:
        raise ConnectionError(f"MLFlowLogger: no MLflow tracking server answers at {uri} ({err}); start it, check "
                              "the address, or drop the logger") from None


class MLFlowLogger:
    """Metrics, parameters and the end state of one MLflow run, through ``mlflow.MlflowClient``.

    The store: ``tracking_uri``; else the environment variable ``MLFLOW_TRACKING_URI`` (MLflow's own);
    else ``sqlite:///<save_dir>/mlflow.db``, ``save_dir`` being by default the directory that holds the
    run directories (``runs/``, the parent of ``runs/version_N``), so that one store lists every run
    and ``mlflow ui --backend-store-uri sqlite:///runs/mlflow.db`` compares them. A local SQLite store
    is the default because MLflow 3 refuses the old ``file:`` stores (``./mlruns``) unless the
    environment variable ``MLFLOW_ALLOW_FILE_STORE=true`` is set; set it yourself to use one. Artifacts
    of an experiment this logger creates in the default store go to ``<save_dir>/mlartifacts``.

    At :meth:`setup` the experiment ``experiment_name`` is found or created and a run named ``run_name``
    (default: the run directory's name) is started; a resumed run (``setup`` again on the same run
    directory) continues the same MLflow run, its id kept in ``<run dir>/mlflow_run_id``. Metrics go in
    one ``log_batch`` per call, at ``step``, timestamped now: ~17 ms for 40 metrics in the SQLite store
    here, spent in the training loop on rank zero at each record; ``synchronous=False`` hands the writes
    to MLflow's background thread (MLflow's asynchronous logging, experimental there), and
    :meth:`finalize` waits for them and raises what they raised. Parameters are flattened
    (``{"optim": {"lr": 0.1}}`` -> ``optim/lr``) and written as strings cut to 6,000 characters;
    MLflow refuses a parameter logged twice with different values. :meth:`finalize` ends the run
    FINISHED ("success") or FAILED ("failed").

    The Trainer calls a logger on rank zero only (see :class:`trainscale.loggers.Logger`).

    Args:
        experiment_name: the MLflow experiment.
        run_name: the run's name; None: the run directory's name (``version_N``).
        tracking_uri: the store, e.g. ``sqlite:///path/mlflow.db`` or ``http://host:5000``.
        save_dir: the directory of the default SQLite store (see above).
        tags: tags of the new run.
        synchronous: False: metrics are written by MLflow's background thread (Lightning's option).
        log_model: only False: trainscale does not upload checkpoints as MLflow artifacts (another value is refused,
            naming the call to make instead).
        prefix: put before every metric name, joined by "-" (Lightning's ``LOGGER_JOIN_CHAR``).
        artifact_location: where an experiment this logger creates keeps its artifacts (MLflow's argument of
            ``create_experiment``); None: the default above, or the store's own.
        run_id: continue this MLflow run (in its own experiment) instead of starting one (Lightning's argument).

    Lightning's properties: ``name`` is the experiment id, ``version`` the run id (None before setup).

    Raises:
        ModuleNotFoundError: mlflow, or SQLAlchemy/Alembic for a database store, is not installed.
        ValueError: a ``tracking_uri`` whose scheme MLflow cannot track to (:func:`check_tracking_uri`);
            ``log_model`` other than False.
    """

    def __init__(self, experiment_name: str = "trainscale", run_name: str | None = None,
                 tracking_uri: str | None = None, save_dir: str | os.PathLike | None = None,
                 tags: Mapping[str, str] | None = None, synchronous: bool = True, log_model: bool | str = False,
                 prefix: str = "", artifact_location: str | None = None, run_id: str | None = None) -> None:
        if log_model is not False:
            raise ValueError(f"MLFlowLogger(log_model={log_model!r}): trainscale does not upload checkpoints to MLflow; "
                             "pass log_model=False and upload one yourself after fit: logger.experiment.log_artifact("
                             "logger.run_id, trainer.checkpoint_callback.best_model_path) (an MlflowClient method)")
        self._uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if self._uri is not None:
            check_tracking_uri(self._uri)
        database = self._uri is None or self._uri.split(":", 1)[0].split("+")[0] in (
            "sqlite", "postgresql", "mysql", "mssql")
        require("MLFlowLogger", "mlflow", "mlflow", *(("sqlalchemy", "alembic") if database else ()))
        self.experiment_name, self.run_name = experiment_name, run_name
        self.save_dir = Path(save_dir) if save_dir is not None else None
        self.tags = dict(tags or {})
        self.synchronous = synchronous
        self._pending: list = []  # RunOperations of asynchronous log_batch calls, waited for at finalize
        self.tracking_uri: str | None = None  # the store in use, after setup
        self.prefix, self.artifact_location, self._given_run_id = prefix, artifact_location, run_id
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self._client = None

    name = property(lambda self: self.experiment_id, doc="The experiment id (Lightning's ``MLFlowLogger.name``).")
    version = property(lambda self: self.run_id, doc="The run id (Lightning's ``MLFlowLogger.version``).")

    @property
    def experiment(self):
        """The ``mlflow.MlflowClient`` (for artifacts, models, ...; use with :attr:`run_id`), after setup; on the
        other ranks a no-op ``DummyExperiment`` (``trainscale.loggers.base.experiment_or_dummy``)."""
        return experiment_or_dummy(self._client, "MLFlowLogger")

    def setup(self, run_dir: str | os.PathLike) -> None:
        """Find or create the experiment and start (or continue) the run.

        Raises:
            ConnectionError: an ``http(s)://`` server that does not accept a connection within
                ``CONNECT_TIMEOUT_S`` (the Trainer then warns and trains without this logger).
        """
        if self._uri is not None and self._uri.split(":", 1)[0] in ("http", "https"):
            _check_reachable(self._uri)
            for name, value in _HTTP_DEFAULTS.items():  # MLflow's own: 7 retries with backoff took minutes
                os.environ.setdefault(name, value)
        from mlflow import MlflowClient

        run_dir = Path(run_dir).resolve()
        uri, artifacts = self._uri, None
        if uri is None:
            store = self.save_dir or run_dir.parent
            store.mkdir(parents=True, exist_ok=True)
            uri, artifacts = f"sqlite:///{store.resolve() / 'mlflow.db'}", (store.resolve() / "mlartifacts").as_uri()
        client = MlflowClient(tracking_uri=uri)
        if self._given_run_id is not None:  # Lightning's run_id: that run, in its own experiment
            self.experiment_id = client.get_run(self._given_run_id).info.experiment_id
        else:
            experiment = client.get_experiment_by_name(self.experiment_name)
            self.experiment_id = (experiment.experiment_id if experiment is not None else client.create_experiment(
                self.experiment_name, artifact_location=self.artifact_location or artifacts))
        self.run_id = self._resumed(client, self._given_run_id or run_id(run_dir, RUN_ID_FILE)) or client.create_run(
            self.experiment_id, run_name=self.run_name or run_dir.name, tags=self.tags).info.run_id
        keep_run_id(run_dir, RUN_ID_FILE, self.run_id)
        self.tracking_uri, self._client = uri, client

    def _resumed(self, client, ident: str | None) -> str | None:
        """``ident`` set RUNNING again if it is a run of this store's experiment, else None."""
        from mlflow.exceptions import MlflowException

        if ident is None:
            return None
        try:
            run = client.get_run(ident)
        except MlflowException:  # another store, or the run was deleted
            return None
        if run.info.experiment_id != self.experiment_id:
            return None
        client.update_run(ident, status="RUNNING")
        return ident

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        client = self.experiment
        items = [Param(k, str(v)[:_PARAM_VALUE_LENGTH]) for k, v in flatten(dict(params), sep="/").items()]
        for i in range(0, len(items), _PARAM_BATCH):
            client.log_batch(self.run_id, params=items[i:i + _PARAM_BATCH])

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        client = self.experiment
        now_ms = int(time.time() * 1000)
        items = [Metric(k, float(v), now_ms, step) for k, v in add_prefix(metrics, self.prefix).items()]
        for i in range(0, len(items), _BATCH):
            operation = client.log_batch(self.run_id, metrics=items[i:i + _BATCH], synchronous=self.synchronous)
            if operation is not None:
                self._pending.append(operation)

    def finalize(self, status: str) -> None:
        check_status(status)
        if self._client is not None:
            for operation in self._pending:
                operation.wait()  # raises what a background write raised
            self._pending = []
            self._client.set_terminated(self.run_id, "FINISHED" if status == "success" else "FAILED")
            self._client = None
