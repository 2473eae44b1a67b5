"""The local data-parallel group: this host's other devices, training as one peer of the swarm.

- :mod:`.group`: ``LocalGroup``, rank 0's side in the node process: starts the workers, sends them
  commands, all-reduces the gradients with them, restarts them when one fails.
- :mod:`.worker`: a worker process (ranks 1..N-1).
- :mod:`.protocol`: what every rank speaks: rank 0's commands, the store's keys, the collectives.
- :mod:`.processes`: the workers' processes and the group's sockets (loopback only), from rank 0's side.
"""
