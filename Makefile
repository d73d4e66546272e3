# Two commands set everything up on a fresh clone: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip --disable-pip-version-check -q
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: venv install install-test demo test lint typecheck pytest check bench clean sysdeps

# Shared by every target: the virtual environment at the repo root.
venv: $(BIN)/python
$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The project, editable, with its runtime dependencies only.
install: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml | venv
	$(PIP) install -e .
	@touch $@

# Plus the test extra: torch (CPU build, pinned), mmengine, msprobe, pytest, ruff, mypy, ...
install-test: $(VENV)/.installed-test
$(VENV)/.installed-test: pyproject.toml | venv
	$(PIP) install -e '.[test]'
	@touch $(VENV)/.installed $@

# System packages some tests drive for real (logrotate, Alertmanager, PostgreSQL); skipped when
# unavailable.
# Debian's prometheus-alertmanager enables its own service: the tests start their own instance
# on loopback (PostgreSQL in a temporary data directory), so a service this target installed is
# stopped and disabled again.
sysdeps:
	@missing=""; \
	command -v logrotate >/dev/null 2>&1 || [ -x /usr/sbin/logrotate ] || missing="$$missing logrotate"; \
	command -v prometheus-alertmanager >/dev/null 2>&1 || missing="$$missing prometheus-alertmanager"; \
	ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null 2>&1 || \
	  missing="$$missing postgresql"; \
	if [ -n "$$missing" ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing \
	     >/dev/null) || echo "sysdeps: apt-get failed; tests needing$$missing will skip"; \
	  case "$$missing" in *alertmanager*) [ -d /run/systemd/system ] && \
	    systemctl disable --now prometheus-alertmanager >/dev/null 2>&1 || true;; esac; \
	  case "$$missing" in *postgresql*) [ -d /run/systemd/system ] && \
	    systemctl disable --now postgresql >/dev/null 2>&1 || true;; esac; \
	elif [ -n "$$missing" ]; then \
	  echo "sysdeps: not root or no apt-get; tests needing$$missing will skip"; \
	fi

demo: install
	$(BIN)/nanwatch demo

lint: install-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install-test
	$(BIN)/mypy

pytest: install-test sysdeps
	$(BIN)/python -m pytest -q

test: lint typecheck pytest

check: test

bench: install-test
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) build dist .pytest_cache .mypy_cache .ruff_cache
