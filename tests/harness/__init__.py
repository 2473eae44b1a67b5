"""What the tests build to test with, in one place: each module starts one kind of swarm, in a test's
nursery on the in-memory network and the virtual clock, or (``processes``) as real processes.

- :mod:`.identities`: ``identity(name)``, the same keys for the same name in every test;
- :mod:`.training`: peers running a Node and a CollaborativeOptimizer on small models (``swarm``);
- :mod:`.averaging`: bare all-reduce groups (``open_group``) and the checks every round must pass;
- :mod:`.dht`: DHT nodes without the rest of a Node (``open_swarm``);
- :mod:`.nodes`: whole Nodes joined in a chain, for matchmaking (``swarm``);
- :mod:`.hosts`: bare Hosts serving probe methods, for the transport tests (their fixtures are in
  ``tests/integration/conftest.py``);
- :mod:`.processes`: real ``p2ptrain`` processes for the end-to-end tests (``NodeProc``; the ``nodes``
  fixture is in ``tests/e2e/conftest.py``).

Test modules import from here, never from one another.
"""
