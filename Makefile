# The whole set-up: `make demo` and `make test` install what they need first.
PYTHON ?= $(shell test -x /usr/bin/python3 && echo /usr/bin/python3 || command -v python3)
VENV   := .venv
STAMP  := $(VENV)/.installed

.PHONY: install demo test clean

install: $(STAMP)

# --system-site-packages: pyverbs comes from the system's rdma-core (python3-pyverbs), as on real clusters.
$(STAMP): pyproject.toml Makefile scripts/install-system-deps.sh scripts/constraints.txt
	./scripts/install-system-deps.sh
	test -x $(VENV)/bin/python || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	@# torch for dlfs.torch and its tests: the CPU build (scripts/constraints.txt), not a CUDA one of several GB.
	$(VENV)/bin/python -m pip install -q -c scripts/constraints.txt -e '.[test,torch]'
	@# The RDMA transport needs pyverbs: a venv made before without system site-packages would hide it.
	@$(VENV)/bin/python -c 'import pyverbs.device, pyverbs.qp' || { echo "dlfs: pyverbs does not import in $(VENV): python3-pyverbs must be installed for $(PYTHON) and $(VENV) made with --system-site-packages (make clean install)" >&2; exit 1; }
	touch $@

demo: install
	$(VENV)/bin/python scripts/demo.py

# Four workers (the tests mostly wait on daemons), one test file each at a time: a file's module fixtures
# (a node, a cluster) start once; tests marked `serial` run alone (tests/conftest.py). Bytecode is
# written even where the environment says not to: hundreds of dlfs processes and four workers would
# otherwise each compile the same modules (pytest's rewritten tests too).
test: install
	env -u PYTHONDONTWRITEBYTECODE $(VENV)/bin/python -m pytest -rs --durations=25 -n 4 --dist loadfile

clean:
	rm -rf $(VENV) .demo build *.egg-info
