"""`make run-workers` (`python -m cacheroute_sim.demo`): the proxy on simulated instances, so a
`curl` works on a fresh machine at once.

It starts the production launcher (`cacheroute-proxy run`: sidecar and N workers) as one child,
waits for its control plane, then starts PROXY_SIM_INSTANCES simulated instances (instance i
on port base + 10*i, its control plane on the next port) and one simulated KDN for
Scheduler-style requests with knowledge. The instances register with the proxy themselves, as
real ones do, and send it a resource snapshot every SIM_RESOURCE_INTERVAL_S (readings of their
simulated load, as an agent beside a real engine reports the machine's). Every simulated process
logs as the proxy's do (PROXY_LOG_LEVEL, PROXY_LOG_FORMAT). A simulated process that crashes is
started again; if the proxy stops, the demo stops. Ctrl-C / SIGTERM: each simulated process gets one SIGTERM (the instances unregister
while the proxy still answers; a second one would cut what they have in flight), then the proxy
(it drains). SIGHUP is passed on to the proxy: a rolling restart of its workers.

The production launcher knows nothing of this: a deployment without `cacheroute_sim` runs
`cacheroute-proxy run` (or the systemd units) and its instances register on their own.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from collections.abc import Collection

from cacheroute_proxy import logs
from cacheroute_proxy.cli import run_flags
from cacheroute_proxy.config import ConfigError, Settings
from cacheroute_proxy.probe import get_json
from cacheroute_proxy.supervisor.children import Child, describe_exit

log = logging.getLogger("cacheroute.demo")

SIM_INSTANCES_ENV = "PROXY_SIM_INSTANCES"
SIM_PORT_BASE_ENV = "PROXY_SIM_INSTANCE_PORT_BASE"
SIM_KDN_PORT_ENV = "PROXY_SIM_KDN_PORT"
SIM_HOST = "127.0.0.1"
# How often each simulated instance sends a resource snapshot, as an
# agent beside a real engine does: the dashboard's resource charts and the pool's admission
# state come from them.
SIM_RESOURCE_INTERVAL_S = 5.0
CONTROL_PLANE_WAIT_S = 30.0
RESTART_DELAY_S = 1.0
STOP_TIMEOUT_S = 10.0
# The dashboard where the original demo served its UI, unless PROXY_UI_LISTEN or a flag says
# otherwise (--no-proxy-ui: only the control plane's /dashboard).
DEMO_UI_LISTEN = "127.0.0.1:8202"
# The proxy's own stop may take its whole drain; the demo waits that long, plus this margin.
PROXY_STOP_MARGIN_S = 15.0


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name, "")
    try:
        return int(text) if text else default
    except ValueError:
        raise SystemExit(f"demo: {name} must be an integer, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m cacheroute_sim.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    run_flags.add_run_flags(parser)  # `cacheroute-proxy run`'s own, passed on to it
    parser.add_argument("--no-proxy-ui", action="store_true",
                        help=f"no dashboard listener of its own (default: {DEMO_UI_LISTEN}, "
                             f"unless PROXY_UI_LISTEN is set); :8002/dashboard stays")
    parser.add_argument("--sim-instances", type=int, default=_env_int(SIM_INSTANCES_ENV, 2),
                        help=f"simulated instances to start ({SIM_INSTANCES_ENV}, default 2; 0 = none)")
    parser.add_argument("--sim-port-base", type=int, default=_env_int(SIM_PORT_BASE_ENV, 9001),
                        help=f"port of simulated instance 0; instance i listens on base + 10*i "
                             f"({SIM_PORT_BASE_ENV}, default 9001)")
    parser.add_argument("--kdn-port", type=int, default=_env_int(SIM_KDN_PORT_ENV, 9101),
                        help=f"port of the simulated KDN ({SIM_KDN_PORT_ENV}, default 9101)")
    return parser


def proxy_argv(args: argparse.Namespace) -> list[str]:
    """`cacheroute-proxy run` with the flags the demo was given (the rest comes from the
    environment, which the child inherits)."""
    return ["-m", "cacheroute_proxy", "run", *run_flags.run_argv(args)]


def sim_instance_ids(args: argparse.Namespace) -> list[str]:
    """The simulated instances' ids, the original's `hp_<host>:<port>`; instance i on base + 10*i."""
    return [f"hp_{SIM_HOST}:{args.sim_port_base + 10 * i}" for i in range(args.sim_instances)]


def simulated_children(args: argparse.Namespace, settings: Settings) -> list[Child]:
    logging_flags = ["--log-level", settings.log_level.lower(), "--log-format", settings.log_format]
    children = [Child(f"sim-instance{i}", [
        "-m", "cacheroute_sim.instance", "--host", SIM_HOST, "--port", str(args.sim_port_base + 10 * i),
        "--instance-id", instance_id, "--proxy-cp-url", settings.cp_url,
        "--resource-interval", str(SIM_RESOURCE_INTERVAL_S), *logging_flags], {})
        for i, instance_id in enumerate(sim_instance_ids(args))]
    if args.sim_instances:  # the knowledge server, for Scheduler-style requests with knowledge
        children.append(Child("sim-kdn", ["-m", "cacheroute_sim.kdn", "--host", SIM_HOST,
                                          "--port", str(args.kdn_port), *logging_flags], {}))
    return children


def alive_among(rows: object, ids: Collection[str]) -> int:
    """How many of `ids` are alive in a `/debug/instance_loads` answer's rows (other instances,
    e.g. PROXY_STATIC_INSTANCES', are not the demo's)."""
    if not isinstance(rows, list):
        return 0
    return sum(1 for row in rows if isinstance(row, dict) and row.get("is_alive") and row.get("instance_id") in ids)


class Demo:
    def __init__(self, args: argparse.Namespace, settings: Settings) -> None:
        self.settings = settings
        self.proxy = Child("proxy", proxy_argv(args), {})
        self.sims = simulated_children(args, settings)
        self.sim_ids = frozenset(sim_instance_ids(args))
        self._stopping = False

    def run(self) -> int:
        signal.signal(signal.SIGINT, self._on_stop)
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGHUP, lambda *_: self.proxy.signal(signal.SIGHUP))
        try:
            self.proxy.start()
            if not self._wait_for_control_plane():
                return 1
            for child in self.sims:
                child.start()
            self._announce()
            while not self._stopping:
                code = self.proxy.exited()
                if code is not None:
                    log.error("the proxy stopped (%s); stopping the demo", describe_exit(code))
                    return 1
                self._restart_crashed_sims()
                time.sleep(0.1)
            return 0
        finally:
            self._stop()

    def _on_stop(self, signum: int, frame: object) -> None:
        self._stopping = True

    def _wait_for_control_plane(self) -> bool:
        deadline = time.monotonic() + CONTROL_PLANE_WAIT_S
        while time.monotonic() < deadline and not self._stopping:
            if self.proxy.exited() is not None:
                log.error("the proxy did not start (its log above says why)")
                return False
            if get_json(f"{self.settings.cp_url}/healthz") is not None:
                return True
            time.sleep(0.1)
        if not self._stopping:
            log.error("the proxy's control plane %s did not answer within %.0fs",
                      self.settings.cp_url, CONTROL_PLANE_WAIT_S)
        return False

    def _restart_crashed_sims(self) -> None:
        now = time.monotonic()
        for child in self.sims:
            code = child.exited()
            if code is None:
                continue
            if child.next_start_at == 0.0:
                child.next_start_at = now + RESTART_DELAY_S
                log.warning("%s %s; restarting in %.0fs", child.name, describe_exit(code), RESTART_DELAY_S)
            elif now >= child.next_start_at:
                child.next_start_at = 0.0
                child.restarts += 1
                child.start()

    def _announce(self) -> None:
        """Once every simulated instance is in the proxy's directory and every worker answers
        (the instances may register before the workers listen): the line to try."""
        s = self.settings
        deadline = time.monotonic() + CONTROL_PLANE_WAIT_S
        while time.monotonic() < deadline and not self._stopping and \
                (self._alive_sims() < len(self.sim_ids) or not self._workers_answer()):
            time.sleep(0.2)
        log.info("demo: %d simulated instances registered with %s; try\n  curl -s http://%s:%d/v1/chat/completions "
                 "-H 'content-type: application/json' -d '{\"model\": \"sim-model\", \"messages\": "
                 "[{\"role\": \"user\", \"content\": \"hello\"}]}'", self._alive_sims(), s.cp_url,
                 s.dp_host, s.dp_port)

    def _workers_answer(self) -> bool:
        s = self.settings
        return all(get_json(f"http://{s.worker_private_host}:{s.worker_private_port(i)}/healthz") is not None
                   for i in range(s.workers))

    def _alive_sims(self) -> int:
        loads = get_json(f"{self.settings.cp_url}/debug/instance_loads")
        return alive_among(loads.get("instances") if isinstance(loads, dict) else None, self.sim_ids)

    def _stop(self) -> None:
        for child in self.sims:  # instances first: they unregister while the proxy still answers
            child.signal(signal.SIGTERM)
        for child in self.sims:  # one SIGTERM each: a second one would cut what is in flight
            child.wait_or_kill(STOP_TIMEOUT_S)
        self.proxy.stop(self.settings.drain_timeout_s + PROXY_STOP_MARGIN_S)


def with_demo_dashboard(args: argparse.Namespace) -> argparse.Namespace:
    """The original demo's UI address when neither the environment nor a flag chose one."""
    if args.no_proxy_ui:
        args.ui_listen = ""
    elif args.ui_listen is None and "PROXY_UI_LISTEN" not in os.environ:
        args.ui_listen = DEMO_UI_LISTEN
    return args


def main(argv: list[str] | None = None) -> int:
    args = with_demo_dashboard(build_parser().parse_args(argv))
    try:
        settings = run_flags.settings_from(args)
    except (ConfigError, ValueError) as exc:
        print(f"demo: configuration error: {exc}", file=sys.stderr)
        return 2
    logs.configure("demo", settings.log_level, settings.log_format)
    return Demo(args, settings).run()


if __name__ == "__main__":
    sys.exit(main())
