"""Sites: one swarm peer backed by a ``torch.distributed`` group of N ranks that shards the model with
FSDP2 (see docs/sharded-sites.md).

- ``layout``: the wire vector's flat order, and which rank holds which elements of it;
- ``pieces``: pieces of the wire vector between the ranks that hold them and rank 0;
- ``wire``: rank 0's wire buffer, the site's contribution in a mapped file;
- ``outer``: DiLoCo's outer state sharded like the model, and the site's outer rounds;
- ``launch``: the site's ranks on one host (spawned) or several (``torchrun``).
"""
