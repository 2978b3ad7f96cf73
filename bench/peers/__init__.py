"""`make bench-peers`: this proxy against nginx and an LLM router (vllm-router), side by side,
all over the same simulated instances. See bench/peers/__main__.py for the command line and
bench/peers/runner.py for the method."""
