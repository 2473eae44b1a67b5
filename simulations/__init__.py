"""Multi-process swarm scenarios, WAN emulation and benchmarks (run with ``python -m simulations.NAME``)."""
