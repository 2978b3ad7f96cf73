"""BENCHMARKS.md from the results JSON files: `python -m bench.report` (make bench-report).

Reads bench/results/{routing,peers,select,pressure,pressure_vllm}.json where present and writes
BENCHMARKS.md plus PNG charts in bench/results/charts/. Every number in the report comes from
those files; nothing is typed by hand. Modules: `fmt` (numbers and Markdown tables), `blocks`
(command, machine, method and notes of any results file), `charts` (matplotlib, Agg),
`routing`, `peers`, `others` (one section each), `build` (the document), `__main__` (CLI).
"""
