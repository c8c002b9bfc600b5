"""Development and operations tooling: local Redis and Triton launchers, the model export (torch).

Management commands, tests and benchmarks use it; the request path and the services never do.
"""
