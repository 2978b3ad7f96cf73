# CacheRoute Proxy, multi-process edition.
# Every target installs what it needs into .venv first, so a fresh clone needs only `make`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=
# N, SIM and STRATEGY (run-workers) have no default here: given on the command line they become
# the demo's flags; otherwise PROXY_WORKERS, PROXY_SIM_INSTANCES and PROXY_INSTANCE_STRATEGY from
# the environment decide, then the product's defaults. A variable of the same name that merely
# sits in the environment (make imports the environment) is not a command-line choice: ignored.
from_command_line = $(if $(filter command line,$(origin $(1))),$(2) $($(1)))

.PHONY: install install-vllm peers run-workers config-doc test test-vllm bench-pressure-vllm bench-affinity-vllm bench bench-events bench-pressure bench-routing bench-report bench-peers bench-affinity bench-idle bench-gate bench-flow-profile soak clean-shm clean

# setup.py builds the C parts (shm_schema/_lanes.c, shm_schema/_ring.c,
# cacheroute_proxy/routing/_least_load.c, cacheroute_proxy/http1/_chunk_pass.c) into the
# checkout: an edit rebuilds them.
$(STAMP): pyproject.toml setup.py shm_schema/_lanes.c shm_schema/_ring.c cacheroute_proxy/routing/_least_load.c cacheroute_proxy/http1/_chunk_pass.c
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	@touch $(STAMP)

install: $(STAMP)

# The demo: sidecar + N workers on :8001 (`cacheroute-proxy run`) and SIM simulated instances
# plus a simulated KDN (cacheroute_sim/demo.py). A real deployment runs `cacheroute-proxy run`
# or the systemd units (docs/operations.md); its instances register themselves.
run-workers: $(STAMP)
	$(PY) -m cacheroute_sim.demo $(call from_command_line,N,--workers) $(call from_command_line,STRATEGY,--strategy) $(call from_command_line,SIM,--sim-instances)

# The suite runs on TEST_WORKERS parallel pytest workers (pytest-xdist; tests/parallel.py says
# what shares a worker and what goes first): most tests wait on processes and sockets, so more
# workers than cores pay off. TEST_WORKERS=0: all in one process. The tests start hundreds of
# Python processes: their bytecode is compiled once here, not by each of them where
# PYTHONDONTWRITEBYTECODE is set.
TEST_WORKERS ?= 4
test: $(STAMP)
	$(PY) -m compileall -q cacheroute_proxy shm_schema sidecar proxy_workers instance_agent cacheroute_sim bench tests >/dev/null
	$(PY) -m pytest -n $(TEST_WORKERS) $(PYTEST_ARGS)

# The settings tables of docs/configuration.md, from the definitions in cacheroute_proxy/config.py
# (tests/test_config.py fails while they are not current).
config-doc: $(STAMP)
	$(PY) -m cacheroute_proxy config --update-doc docs/configuration.md

# The real-engine suite (tests/real_engine, pytest marker real_engine, left out of `make test`):
# a CPU build of vLLM in its own venv (.venv-vllm, ~3.4 GB, ~8 min the first time; every package
# pinned in tests/real_engine/vllm-requirements.txt and installed with --no-deps, see there why),
# a tiny random-weight Llama built locally (nothing comes from a model hub), and the tests run
# with .venv's pytest; the engines run on .venv-vllm's python. Every cache stays in .cache/.
VLLM_VENV  := .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_REQS  := tests/real_engine/vllm-requirements.txt
TINY_MODEL := .cache/tiny-llama
TINY_STAMP := $(TINY_MODEL)/.built
ENGINE_STAMP := $(VENV)/.installed-real-engine
CACHE_ENV  := HF_HOME=$(CURDIR)/.cache/hf HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
              XDG_CACHE_HOME=$(CURDIR)/.cache PIP_CACHE_DIR=$(CURDIR)/.cache/pip \
              VLLM_CACHE_ROOT=$(CURDIR)/.cache/vllm TORCHINDUCTOR_CACHE_DIR=$(CURDIR)/.cache/torchinductor

$(VLLM_STAMP): $(VLLM_REQS)
	@test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(CACHE_ENV) $(VLLM_PY) -m pip install --quiet --no-cache-dir pip==26.3
	$(CACHE_ENV) $(VLLM_PY) -m pip install --quiet --no-cache-dir --no-deps -r $(VLLM_REQS)
	$(CACHE_ENV) $(VLLM_PY) -c 'import vllm.entrypoints.openai.api_server, transformers, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
	@touch $(VLLM_STAMP)

$(TINY_STAMP): tests/real_engine/build_tiny_model.py $(VLLM_STAMP)
	$(CACHE_ENV) $(VLLM_PY) tests/real_engine/build_tiny_model.py $(TINY_MODEL)
	@touch $(TINY_STAMP)

# What .venv needs to drive the engines (the official openai client): the real-engine extra.
$(ENGINE_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install --quiet -e '.[test,real-engine]'
	@touch $(ENGINE_STAMP)

install-vllm: $(VLLM_STAMP) $(TINY_STAMP) $(ENGINE_STAMP)

test-vllm: install-vllm
	$(CACHE_ENV) $(PY) -m pytest -m real_engine tests/real_engine $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m bench.bench_select --out bench/results/select.json
	$(PY) -m bench.bench_events --out bench/results/events.json
	$(PY) -m bench.pipeline_cost --out bench/results/pipeline_cost.json
	$(PY) -m bench.bench_prefix_keys --out bench/results/prefix_keys.json

# bench/pipeline_cost.py's variants counted in instructions a request by callgrind, which a noisy
# machine does not move (~10 min; VARIANTS=full,exchange,...: those only).
bench-instructions: $(STAMP)
	command -v valgrind >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq valgrind)
	$(PY) -m bench.instructions --out bench/results/instructions.json $(call from_command_line,VARIANTS,--variants)

# The proxy at rest: its tree's CPU over 60 s without traffic (BASELINE=<git ref>: that ref too,
# interleaved).
bench-idle: $(STAMP)
	$(PY) -m bench.idle --out bench/results/idle.json $(if $(BASELINE),--baseline $(BASELINE),)

bench-gate: $(STAMP)
	$(PY) -m bench.gate_wait --out bench/results/gate_wait.json $(if $(BASELINE),--baseline $(BASELINE),)
	$(PY) -m bench.gate_wait --streams 8 --out bench/results/gate_wait_unqueued.json $(if $(BASELINE),--baseline $(BASELINE),)

# The sidecar's CPU per request consuming its events (in-process, real segment, ~1 min; with
# BASELINE=<git ref> the same scenarios against that ref too, interleaved).
bench-events: $(STAMP)
	$(PY) -m bench.bench_events --out bench/results/events.json $(if $(BASELINE),--baseline $(BASELINE),)

# TTFT prediction error and snapshot age against simulated instances at real time (~1 min).
bench-pressure: $(STAMP)
	$(PY) -m bench.bench_pressure --out bench/results/pressure.json

# The same against real vLLM engines (two CPU engines from .venv-vllm serving the tiny model,
# predictor profile vllm-cpu-tiny; ~1.5 min after install-vllm: engines start, 60 s of load).
bench-pressure-vllm: install-vllm
	$(CACHE_ENV) $(PY) -m bench.bench_pressure --vllm --out bench/results/pressure_vllm.json

# The peers of the real-engine leg, each in its own venv under .venv-peers (pinned in
# bench/affinity_vllm/peers/<package>.txt; ~130 MB each, made on first use, remade when the pin changes).
PEERS_DIR := .venv-peers
PEER_PACKAGES := vllm-router sglang-router
PEER_STAMPS := $(foreach p,$(PEER_PACKAGES),$(PEERS_DIR)/$(p)/.installed)

$(PEERS_DIR)/%/.installed: bench/affinity_vllm/peers/%.txt
	@test -x $(PEERS_DIR)/$*/bin/python || $(PYTHON) -m venv $(PEERS_DIR)/$*
	$(PEERS_DIR)/$*/bin/python -m pip install --quiet -r $<
	@touch $@

peers: $(PEER_STAMPS)

# kv_aware on real engines (docs/benchmarks.md): this proxy's kv_aware (on
# the engines' KV events) and least_load, 4 workers, against vllm-router cache_aware and kv_aware
# and the SGLang router cache_aware, over two CPU vLLM engines (64 KV blocks of 128 each, prefix
# caching and KV events on); least_load's saturation calibrated first, then 600 streaming chats
# at 40 % and 60 % of it, ABC...CBA, 2 runs each (~20-30 min). ARGS: more options (e.g.
# ARGS='--kv-aware-env PROXY_X=1'; python -m bench.affinity_vllm --help).
bench-affinity-vllm: install-vllm peers
	$(CACHE_ENV) $(PY) -m bench.affinity_vllm --out bench/results/affinity_vllm.json $(ARGS)

# Routing quality with many workers: 1-worker least_load reference, 4 workers shared /
# per_worker / round_robin, nginx least_conn, over one slow and two fast simulated instances
# with bursty arrivals (~15 min; QUICK=1: one short repeat, ~2 min). Prints the checks.
bench-routing: $(STAMP)
	command -v nginx >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light)
	$(PY) -m bench.routing --out bench/results/routing.json $(if $(QUICK),--quick,) $(if $(REPEATS),--repeats $(REPEATS),)

# This proxy (2 workers, least_load) against nginx least_conn (2 workers) and vllm-router
# power_of_two, over two instances of each backend in turn: the simulator (sim), then a plain
# Starlette/uvicorn OpenAI fake (starlette): added latency, req/s, p99, streams/s, CPU/1k (the
# proxy's also by role: workers, sidecar, launcher), RSS, and the peer targets PASS/FAIL with
# per-repeat ratios (~10 min with 3 repeats of 5 s points; QUICK=1: one repeat of 2 s points,
# ~2-4 min; BACKEND=sim|starlette: one backend only; ISOLATE=1: each contender up only for its
# own points). More contenders (1/4 workers, round_robin): python -m bench.peers --contenders.
bench-peers: $(STAMP)
	command -v nginx >/dev/null && command -v wrk >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light wrk)
	$(PY) -m pip install --quiet -e '.[bench]' || echo 'bench-peers: the bench extra did not install; what needs it is skipped (see notes)'
	$(PY) -m bench.peers --out bench/results/peers.json $(call from_command_line,BACKEND,--backend) $(if $(QUICK),--quick,) $(if $(ISOLATE),--isolate,)

# Where a plain request's CPU goes in the running proxy: bench-peers' plain point (proxy-w2-ll and
# the relay floor, wrk c32), CPU per request by role, then py-spy over every process: user time
# by layer and by function; then the same for its long streams, a request being one stream
# (~4 min; BACKEND=sim|starlette, default sim; needs ptrace: root; the workers idle between a
# stream's tokens, so its points are longer and sampled faster).
bench-flow-profile: $(STAMP)
	command -v wrk >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk)
	$(PY) -c 'import importlib.metadata as m; m.version("py-spy")' 2>/dev/null || $(PY) -m pip install --quiet -e '.[bench]'
	$(PY) -m bench.flow_profile --out bench/results/flow_profile.json $(call from_command_line,BACKEND,--backend)
	$(PY) -m bench.flow_profile --load stream --seconds 30 --rate 400 --out bench/results/flow_profile_stream.json $(call from_command_line,BACKEND,--backend)

# kv_aware (shared index, per-worker indexes, 1 worker) against least_load and round_robin over
# three simulated instances that keep KV (one at half speed) and a simulated KDN, at 60 % of the
# saturation least_load reaches (calibrated first), in bursts: the targets' workload (64 ids, one
# a request, Zipf(0.6), each instance holding 0.4 of their KV), then the mixed one (1-3 of 200 ids
# and shared system prompts) without targets. The first runs each contender REPEATS times (3),
# interleaved, the tables its medians (~30 min; the second ~10; REQUESTS=300 for a short run).
bench-affinity: $(STAMP)
	$(PY) -m bench.bench_affinity --out bench/results/affinity.json --repeats $(or $(REPEATS),3) $(if $(REQUESTS),--requests $(REQUESTS),)
	$(PY) -m bench.bench_affinity --out bench/results/affinity_mixed200.json --workload mixed200 $(if $(REQUESTS),--requests $(REQUESTS),)

# BENCHMARKS.md and bench/results/charts/*.png from whatever bench/results/*.json exist.
bench-report: $(STAMP)
	$(PY) -c 'import matplotlib' 2>/dev/null || $(PY) -m pip install --quiet -e '.[bench]'
	$(PY) -m bench.report

# Bounded soak under chaos (flapping instance, a worker SIGKILLed every minute), then the end
# invariants; stops by itself and stops everything it started (DURATION seconds of load;
# STRATEGY=kv_aware: that strategy, most plain chats led by shared system prompts).
DURATION ?= 600
soak: $(STAMP)
	$(PY) -m bench.soak --duration $(DURATION) $(if $(STRATEGY),--strategy $(STRATEGY),) \
		--out bench/results/soak$(if $(STRATEGY),_$(STRATEGY),).json

# Remove a segment left by a crashed run (the launcher removes it on a clean stop). Refused
# (exit 1, naming the processes) while a sidecar or worker still uses it; FORCE=1 removes it anyway.
clean-shm: $(STAMP)
	$(PY) -m cacheroute_proxy shm unlink$(if $(FORCE), --force,)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(PEERS_DIR) .cache *.egg-info build .pytest_cache shm_schema/_lanes.*.so shm_schema/_ring.*.so cacheroute_proxy/routing/_least_load.*.so cacheroute_proxy/http1/_chunk_pass.*.so
