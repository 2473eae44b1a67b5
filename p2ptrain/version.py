"""The package's version, importable without anything else of the package (the node's info and status
answers, ``p2ptrain --version``, the package root all read it here)."""

__version__ = "0.1.0"
