"""Benchmarks: each module measures one thing, prints JSON and a table, and writes its report to
``simulations/results/`` (``--json``); ``suite`` runs them all (``python -m simulations bench``)."""
