"""`make bench-peers`: this proxy against nginx and an LLM router (vllm-router), side by side,
all over the same instances of one backend at a time (the simulator, then a plain Starlette
OpenAI fake: openai_fake.py), with the peer targets judged per backend (targets.py). See bench/peers/__main__.py for the
command line and bench/peers/runner.py for the method."""
