"""BENCHMARKS.md from the results JSON files: `python -m bench.report` (make bench-report).

Reads every bench/results/*.json and writes BENCHMARKS.md plus PNG charts in
bench/results/charts/. Every number in the report comes from those files; nothing is typed by
hand; each section names the command and the machine of its run, never a commit or a date.
Modules: `fmt` (numbers and Markdown tables), `blocks` (command, machine, method and notes of any
results file), `charts` (matplotlib, Agg), `routing`, `peers`, `affinity`, `affinity_vllm`,
`hotpath`, `others` (one section each), `settled` (the results whose benchmark is gone), `build`
(the document), `__main__` (CLI).
"""
