"""Instance selection as every process sees it: the load components read from the shared table
(`load_view`), the strategies that score them (`strategies`) and the report of both that any
worker and the sidecar answer at /debug/instance_loads (`report`)."""
