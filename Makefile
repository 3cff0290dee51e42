# nanrunbook: `make demo` and `make test` work on a fresh clone of a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of PyTorch that the capture API's tests and examples run on.
TORCH ?= torch==2.13.0

.PHONY: demo test lint fuzz bench bench-diff bench-set bench-sentinel bench-adapters bench-warnings bench-watch bench-shrink bench-capsule install clean fixtures

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.test-installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test,lint]' '$(TORCH)'
	touch $@ $(VENV)/.installed

demo: $(VENV)/.installed
	@echo '$$ nanrunbook check fixtures/hold-backward-dynamic-skip'
	@$(BIN)/nanrunbook check fixtures/hold-backward-dynamic-skip; status=$$?; \
	  echo; echo "exit code: $$status (1 = HOLD, 0 = CONTINUE, 3 = rejected)"; test $$status -eq 1

# A worker per core (CI's two), each test file on one worker so that a file's
# module fixtures (a spawned multi-rank job shared by its tests) run once.
# TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= auto

test: $(VENV)/.test-installed
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

lint: $(VENV)/.test-installed
	$(BIN)/ruff check nanrunbook tests fixtures
	$(BIN)/ruff format --check nanrunbook tests fixtures
	$(BIN)/mypy

fixtures: $(VENV)/.installed
	$(BIN)/python fixtures/generate.py

# `make bench`: time `nanrunbook check` on a generated bundle (cached in .bench-cache/)
# against one SHA-256 stream and naive torch. BENCH_ARGS="--size 4GiB --runs 3" for more.
bench: $(VENV)/.test-installed
	$(BIN)/python bench/bench_check.py $(BENCH_ARGS)

# `make bench-sentinel`: what the training-loop sentinel costs a real CPU training loop
# (a 27M-parameter transformer), with and without it in alternating runs.
bench-sentinel: $(VENV)/.test-installed
	$(BIN)/python bench/bench_sentinel.py $(BENCH_ARGS)

# `make bench-adapters`: what the transformers, Lightning and Accelerate adapters cost a step, with and
# without each in alternating runs of one process (CPU time a step, and wall-clock).
bench-adapters: $(VENV)/.test-installed
	$(BIN)/python bench/bench_adapters.py $(BENCH_ARGS)

# `make bench-warnings`: the sentinel's early warnings on six diverging and six healthy
# real CPU runs (tests/warning_runs.py): onset, first warning, lead, false alarms.
bench-warnings: $(VENV)/.test-installed
	$(BIN)/python bench/bench_warnings.py $(BENCH_ARGS)

# `make bench-bundle-write`: peak host memory and time of writing a 256 MiB bundle,
# the writer holding it in memory against streaming it to a spool (spool_dir=).
.PHONY: bench-bundle-write
bench-bundle-write: $(VENV)/.test-installed
	$(BIN)/python bench/bench_bundle_write.py $(BENCH_ARGS)

# `make bench-recovery`: a recovery point's save, verify and resume against DCP's own
# save and load and one SHA-256 stream, same-run ratios (issue 28's budgets).
.PHONY: bench-recovery
bench-recovery: $(VENV)/.test-installed
	$(BIN)/python bench/bench_recovery.py $(BENCH_ARGS)

# `make bench-diff`: time `nanrunbook diff` of two 1 GiB bundles (a few tensors differ)
# against checking both, same run. BENCH_ARGS="--runs 9" for more.
bench-diff: $(VENV)/.test-installed
	$(BIN)/python bench/bench_diff.py $(BENCH_ARGS)

# `make bench-set`: an incident set of 8 x 128 MiB against one 1 GiB bundle, same run.
bench-set: $(VENV)/.test-installed
	$(BIN)/python bench/bench_set.py $(BENCH_ARGS)

# `make bench-capsule`: a hold's capsule write against dcp.save of the same state, and
# `nanrunbook replay` against load + 3 steps + the bundle's bytes at the SHA-256 rate.
bench-capsule: $(VENV)/.test-installed
	$(BIN)/python bench/bench_capsule.py $(BENCH_ARGS)

# `make bench-scale`: `check` of incident sets and `merge` of per-rank reports of 8, 128,
# 1,024 and 16,384 small ranks (generated once in .bench-cache/): time per rank, peak RSS.
.PHONY: bench-scale
bench-scale: $(VENV)/.test-installed
	$(BIN)/python bench/bench_scale.py $(BENCH_ARGS)

# `make bench-sentinel-fsdp2`: what the sentinel costs an FSDP2 loop on 2 gloo ranks (CPU):
# same-run step ratio, check share, collectives and host reads added per step.
.PHONY: bench-sentinel-fsdp2
bench-sentinel-fsdp2: $(VENV)/.test-installed
	$(BIN)/python bench/bench_sentinel_fsdp2.py $(BENCH_ARGS)

# `make fuzz`: the hostile-evidence property suite with the long, random `fuzz` profile
# (20x the CI examples) and the canonical form's at 5x (tests/property_budget.py), then time and peak memory of every explicit hostile case.
fuzz: $(VENV)/.test-installed
	HYPOTHESIS_PROFILE=fuzz $(BIN)/python -m pytest -q tests/test_hostile_properties.py tests/test_canonical.py
	$(BIN)/python fuzz/measure_cases.py

# `make install`: the command, its man pages and shell completion for the installing
# user, under PREFIX (default ~/.local). The package stays installed in $(VENV) and
# $(PREFIX)/bin/nanrunbook links to it. With $(PREFIX)/bin on PATH, `man nanrunbook`
# finds $(PREFIX)/share/man and bash-completion finds $(PREFIX)/share/bash-completion.
PREFIX ?= $(HOME)/.local
MANDIR ?= $(PREFIX)/share/man
BASHCOMPDIR ?= $(PREFIX)/share/bash-completion/completions
ZSHCOMPDIR ?= $(PREFIX)/share/zsh/site-functions
# fish reads user completions from its config directory only.
FISHCOMPDIR ?= $(or $(XDG_CONFIG_HOME),$(HOME)/.config)/fish/completions
INSTALLED := $(PREFIX)/bin/nanrunbook $(MANDIR)/man1/nanrunbook.1 \
  $(MANDIR)/man5/nanrunbook-bundle.5 $(MANDIR)/man7/nanrunbook-sentinel.7 \
  $(BASHCOMPDIR)/nanrunbook $(ZSHCOMPDIR)/_nanrunbook \
  $(FISHCOMPDIR)/nanrunbook.fish

.PHONY: uninstall completions

install: $(VENV)/.installed
	install -d '$(PREFIX)/bin' '$(MANDIR)/man1' '$(MANDIR)/man5' '$(MANDIR)/man7' '$(BASHCOMPDIR)' \
	  '$(ZSHCOMPDIR)' '$(FISHCOMPDIR)'
	ln -sfn '$(abspath $(BIN))/nanrunbook' '$(PREFIX)/bin/nanrunbook'
	install -m 644 man/nanrunbook.1 '$(MANDIR)/man1/nanrunbook.1'
	install -m 644 man/nanrunbook-bundle.5 '$(MANDIR)/man5/nanrunbook-bundle.5'
	install -m 644 man/nanrunbook-sentinel.7 '$(MANDIR)/man7/nanrunbook-sentinel.7'
	install -m 644 completions/nanrunbook.bash '$(BASHCOMPDIR)/nanrunbook'
	install -m 644 completions/_nanrunbook '$(ZSHCOMPDIR)/_nanrunbook'
	install -m 644 completions/nanrunbook.fish '$(FISHCOMPDIR)/nanrunbook.fish'
	@case ":$$PATH:" in *":$(PREFIX)/bin:"*) ;; \
	  *) echo "note: put $(PREFIX)/bin on PATH for the command and for man nanrunbook";; esac

uninstall:
	rm -f $(foreach f,$(INSTALLED),'$(f)')

# Regenerate completions/ from the installed command (a test checks they are current).
completions: $(VENV)/.installed
	for shell in bash zsh fish; do \
	  case $$shell in bash) f=nanrunbook.bash;; zsh) f=_nanrunbook;; fish) f=nanrunbook.fish;; esac; \
	  _NANRUNBOOK_COMPLETE=source_$$shell $(BIN)/nanrunbook \
	    | $(BIN)/python -c 'import sys; sys.stdout.write(sys.stdin.read().strip() + "\n")' \
	    > completions/$$f || exit 1; \
	done

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis

# `make bench-watch`: `nanrunbook watch` on a generated 1,000,000-line telemetry file
# (cached in .bench-cache/) against a bare orjson.loads loop and `wc -l`, with peak RSS.
.PHONY: bench-watch
bench-watch: $(VENV)/.test-installed
	$(BIN)/python bench/bench_watch.py $(BENCH_ARGS)
