"""The one harness every benchmark runs on: the processes it starts and stops, what it compares,
the load it sends, and the results file it writes.

- `processes`: 127.0.0.1, small HTTP calls, waiting for readiness, scratch directories, `Started`
  (a context manager that stops what did start when a start fails), `Supervisor` (this proxy's
  launcher, or the demo's, on its own ports and segment);
- `backends`: the instances routed over (the simulator, a plain Starlette OpenAI fake);
- `contenders`: what is measured over them (this proxy, nginx, vllm-router, the relay floor, the
  instance itself), each stopped by pid; `rotated` orders them repeat by repeat;
- `baseline`: the product as it was at a git ref, for an A/B in one run;
- `cpu`: CPU seconds and RSS of a process tree from /proc, whole or by role; `charged` runs a
  load and charges the contender what it spent on it;
- `wrk`, `arrivals`, `streamed`: load (wrk with a POST script, and one charged wrk point; open
  and closed loops; one streaming chat and its `cacheroute_meta`);
- `stats`: percentiles, medians and ratios, one definition each;
- `results`: the command, the machine and its load at the start and the end, the tools'
  versions, and the file written in one step;
- `cli`: NAME=VALUE options, SIGTERM as Ctrl-C, progress lines.
"""
