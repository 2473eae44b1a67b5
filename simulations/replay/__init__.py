"""Scenario replay: a swarm's timeline read from a TOML file (``scenario``), replayed with real node
processes (``runner``) and analysed into a report with plots (``report``, ``plots``).
``python -m simulations run|check|report`` is the command."""
