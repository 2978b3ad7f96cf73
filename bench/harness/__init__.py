"""The one harness every benchmark runs on: the processes it starts and stops, what it compares,
the load it sends, and the results file it writes.

- `processes`: 127.0.0.1, small HTTP calls, waiting for readiness, scratch directories, `Started`
  (a context manager that stops what did start when a start fails);
- `backends`: the instances routed over (the simulator, a plain Starlette OpenAI fake);
- `contenders`: what is measured over them (this proxy, nginx, vllm-router, the relay floor, the
  instance itself), each stopped by pid;
- `cpu`: CPU seconds and RSS of a process tree from /proc, whole or by role, and `charged`;
- `wrk`, `arrivals`, `streamed`: load (wrk with a POST script; open and closed loops; one
  streaming chat and its `cacheroute_meta`);
- `stats`: percentiles;
- `results`: the command, the machine and its load at the start and the end, the tools'
  versions, and the file written in one step;
- `cli`: NAME=VALUE options, SIGTERM as Ctrl-C, progress lines.
"""
