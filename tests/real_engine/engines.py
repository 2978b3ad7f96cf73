"""Real vLLM engines on 127.0.0.1 for the real-engine tests and the pressure benchmark: the CPU
build in .venv-vllm serving the tiny model in .cache/tiny-llama (both made by `make
install-vllm`), started on free ports, waited for with a bound, and stopped by process group.

Why a process group: vLLM's API server forks an engine-core process, which starts a worker; a
SIGKILL of the API server's pid alone would leave those two running. Each engine starts in its
own session, so its group id is its pid and `os.killpg` reaches the three processes and nothing
else.

Why the shared-memory sweep: vLLM's processes talk over POSIX shared memory (`psm_*`, ~170 and
~250 MB each, and `sem.mp-*`) that they unlink only on a clean exit; an engine SIGKILLed, or
stopped while its core is still shutting down, leaves them in /dev/shm for good. Before each
signal the engine notes which of those its group has mapped, and once the whole group is gone
unlinks them and any other such file made since it started that no live process maps (a
semaphore its resource tracker made and let go of, say)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from cacheroute_sim.processes import ROOT, free_port
from tests import segment_guard

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
TINY_MODEL = ROOT / ".cache" / "tiny-llama"
CACHE = ROOT / ".cache"
SERVED_MODEL = "tiny"
MAX_MODEL_LEN = 2048  # the tiny model's max_position_embeddings
MAX_NUM_SEQS = 4
# One engine alone answers /health ~70 s after it starts on 2 cores (most of it torch.compile's
# warm-up, ~40 s, shorter once .cache/vllm holds the compiled graph); two starting together
# share the cores. The bound leaves room for both and a loaded machine.
HEALTH_TIMEOUT_S = 420.0


class EngineError(RuntimeError):
    pass


def missing_setup() -> str | None:
    """What `make install-vllm` has not made yet, or None when the engines can start."""
    if not VLLM_PYTHON.exists():
        return f"{VLLM_PYTHON} is missing: run `make install-vllm` (or `make test-vllm`)"
    if not (TINY_MODEL / "config.json").exists():
        return f"{TINY_MODEL} is missing: run `make install-vllm` (or `make test-vllm`)"
    return None


def engine_env(cpu: int | None) -> dict[str, str]:
    """Offline, every cache inside the checkout, no usage report; `cpu` pins the engine's
    OpenMP threads (vLLM's default binds every engine to the same first core)."""
    env = {
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(CACHE / "hf"), "XDG_CACHE_HOME": str(CACHE),
        "VLLM_CACHE_ROOT": str(CACHE / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(CACHE / "torchinductor"),
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB: plenty for 4 sequences of 2048 tokens
        "VLLM_CPU_OMP_THREADS_BIND": "nobind" if cpu is None else str(cpu),
        "PYTHONUNBUFFERED": "1",
    }
    return env


class VllmEngine:
    """One `vllm.entrypoints.openai.api_server` process group serving the tiny model.

    start() returns at once (engines start in parallel); wait_healthy() blocks until /health
    answers 200. kill() is a crash (SIGKILL to the group); restart() starts it again on the
    same port, appending to the same log."""

    def __init__(self, log_path: Path, port: int | None = None, cpu: int | None = None,
                 max_num_seqs: int = MAX_NUM_SEQS, extra_args: Sequence[str] = (),
                 extra_env: dict[str, str] | None = None, kv_events: bool = False,
                 kv_events_over_tcp: bool = False, max_model_len: int = MAX_MODEL_LEN) -> None:
        self.port = port or free_port()
        # vLLM binds its KV cache event publisher on `kv_events_bind` and a subscriber connects
        # to `kv_events_endpoint`: a Unix socket beside the log (nothing listens on the network),
        # or with `kv_events_over_tcp` `tcp://*:port`, the form vLLM's /kv_event_sources names
        # for a subscriber in another process (an instance agent, vllm-router) to reach as
        # tcp://127.0.0.1:port. None = it publishes nothing.
        self.kv_events_bind: str | None = None
        self.kv_events_endpoint: str | None = None
        if kv_events and kv_events_over_tcp:
            events_port = free_port()
            self.kv_events_bind, self.kv_events_endpoint = f"tcp://*:{events_port}", f"tcp://127.0.0.1:{events_port}"
        elif kv_events:
            self.kv_events_bind = self.kv_events_endpoint = f"ipc://{log_path.parent}/kv-events-{self.port}"
        self.max_model_len = max_model_len
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.cpu = cpu
        self.max_num_seqs = max_num_seqs
        self.extra_args = list(extra_args)
        self.extra_env = dict(extra_env or {})  # e.g. VLLM_SERVER_DEV_MODE=1 for /reset_prefix_cache
        self.popen: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.shm_files: set[Path] = set()
        self._shm_at_start: set[str] = set()

    def argv(self) -> list[str]:
        return [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(TINY_MODEL), "--served-model-name", SERVED_MODEL,
                "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
                "--max-model-len", str(self.max_model_len), "--max-num-seqs", str(self.max_num_seqs),
                # X-Request-Id on every answer: the client's own, or one vLLM makes up.
                "--enable-request-id-headers", *self._kv_events_args(), *self.extra_args]

    def _kv_events_args(self) -> list[str]:
        if self.kv_events_bind is None:
            return []
        return ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                  "endpoint": self.kv_events_bind})]

    # --- lifecycle -----------------------------------------------------------------------------
    def start(self) -> VllmEngine:
        problem = missing_setup()
        if problem:
            raise EngineError(problem)
        self._shm_at_start = segment_guard.shm_files(segment_guard.ENGINE_FILES)
        with open(self.log_path, "ab" if self.starts else "wb") as log:
            log.write(f"=== start {self.starts + 1}: {' '.join(self.argv())}\n".encode())
            log.flush()
            self.popen = subprocess.Popen(self.argv(), cwd=ROOT, env={**os.environ, **engine_env(self.cpu), **self.extra_env},
                                          stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)
        self.starts += 1
        return self

    def wait_healthy(self, timeout: float = HEALTH_TIMEOUT_S) -> VllmEngine:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.running():
                raise EngineError(f"vLLM on :{self.port} exited with {self.popen.returncode} "
                                  f"before it was healthy; its log ends:\n{self.tail()}")
            if self.healthy():
                return self
            time.sleep(0.5)
        raise EngineError(f"vLLM on :{self.port} not healthy after {timeout:.0f} s; "
                          f"its log ends:\n{self.tail()}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to the API server (it shuts its engine core down), then SIGKILL to the group
        after `timeout`, and to whatever of the group is left either way."""
        if self.popen is None:
            return
        self.note_shared_memory()
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self._kill_group()

    def kill(self, note_shared_memory: bool = True) -> None:
        """A crash: SIGKILL to every process of the engine at once. A test that must kill at a
        precise moment notes the shared memory beforehand: reading every process's maps takes
        long enough on a loaded machine for a short stream to finish meanwhile."""
        if self.popen is not None:
            if note_shared_memory:
                self.note_shared_memory()
            self._kill_group()

    def restart(self) -> VllmEngine:
        self.kill()
        return self.start()

    def _kill_group(self, timeout: float = 15.0) -> None:
        """SIGKILL the group and wait until none of it is left: the leader is reaped here, its
        engine core and worker by init once orphaned, a moment later."""
        assert self.popen is not None
        pgid = self.popen.pid
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            self._unlink_shared_memory()
            return  # the whole group is gone already
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + timeout
        while group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if group_alive(pgid):
            raise EngineError(f"processes of vLLM group {pgid} outlived SIGKILL by {timeout:.0f} s")
        self._unlink_shared_memory()

    def note_shared_memory(self) -> None:
        """Remember the /dev/shm files the engine's processes have mapped (see the module doc)."""
        if self.popen is not None:
            self.shm_files |= group_shared_memory(self.popen.pid)

    def _unlink_shared_memory(self) -> None:
        orphans = segment_guard.orphans(self._shm_at_start, segment_guard.ENGINE_FILES)
        for path in self.shm_files | {segment_guard.SHM / name for name in orphans}:
            path.unlink(missing_ok=True)
        self.shm_files.clear()


    # --- observations --------------------------------------------------------------------------
    def tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def metric(self, name: str, **labels: str) -> float:
        """The sum of one metric of the engine's /metrics over the label sets that carry
        `labels` (e.g. `metric("vllm:request_success_total", finished_reason="abort")`)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=5) as response:
            value = metric_sum(response.read().decode(), name, **labels)
        if value is None:
            raise EngineError(f"{name} {labels or ''} not in {self.url}/metrics")
        return value


def metric_sum(text: str, name: str, **labels: str) -> float | None:
    """The sum of metric `name` in a Prometheus text exposition over the label sets that carry
    `labels`; None when no line has it."""
    wanted = [f'{key}="{value}"' for key, value in labels.items()]
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " ")
              and all(w in line for w in wanted)]
    return sum(values) if values else None


def group_shared_memory(pgid: int) -> set[Path]:
    """vLLM's own /dev/shm files (psm_*, sem.mp-*) mapped by a process of group `pgid`."""
    found: set[Path] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            # /proc/<pid>/stat is "pid (comm) state ppid pgrp ...", and comm may hold spaces.
            if int((proc / "stat").read_text().rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            maps = (proc / "maps").read_text()
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not ours to read
        for line in maps.splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(("/dev/shm/psm_", "/dev/shm/sem.mp-")):
                found.add(Path(fields[5].removesuffix(" (deleted)")))
    return found


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def start_engines(count: int, log_dir: Path, timeout: float = HEALTH_TIMEOUT_S, *,
                  extra_args: Sequence[str] = (), extra_env: dict[str, str] | None = None,
                  kv_events: bool = False, kv_events_over_tcp: bool = False,
                  max_model_len: int = MAX_MODEL_LEN) -> list[VllmEngine]:
    """`count` engines started together (each ~70 s alone), each on its own core when there
    are enough; all healthy, or all stopped and an EngineError with the failing one's log."""
    cpus = sorted(os.sched_getaffinity(0))
    engines = [VllmEngine(log_dir / f"vllm-{i}.log", cpu=cpus[i] if count <= len(cpus) else None,
                          extra_args=extra_args, extra_env=extra_env, kv_events=kv_events,
                          kv_events_over_tcp=kv_events_over_tcp, max_model_len=max_model_len)
               for i in range(count)]
    try:
        for engine in engines:
            engine.start()
        deadline = time.monotonic() + timeout
        for engine in engines:
            engine.wait_healthy(max(1.0, deadline - time.monotonic()))
    except BaseException:
        stop_engines(engines)
        raise
    return engines


def stop_engines(engines: Sequence[VllmEngine]) -> None:
    for engine in engines:
        engine.note_shared_memory()
        if engine.running():
            engine.popen.send_signal(signal.SIGTERM)  # all at once: they shut down in parallel
    for engine in engines:
        engine.stop()
