"""The training state: its byte format, its capture from a model, its transfer between peers, on disk.

- :mod:`.codec`: the safetensors byte format a state travels and rests in: encode, strict decode (a
  donor may be hostile), digest.
- :mod:`.capture`: a model, its optimizers and extra tensors as named tensors and metadata
  (``capture``), and back again after a check against the local ones (``restore``).
- :mod:`.chunks`: the state cut into fixed-size chunks (its ``Layout``), the chunks' hashes and the root
  digest that commits to them, which peers publish in their progress records.
- :mod:`.protocol`: state download's wire messages and limits.
- :mod:`.serve`: state download, the donor's side (snapshots of the live state, served to joiners).
- :mod:`.download`: state download, the joiner's side (many donors at once, every chunk checked).
- :mod:`.replay`: catching up a few steps by replaying their committed results (kept and served by
  every peer, each checked against the trusted digest of the step it leads to) instead of a download.
- :mod:`.checkpoint`: checkpoints on disk, written atomically and verified when read.
- :mod:`.file_tensors`: file-backed tensors, for model-sized state that is touched once per round.

When the optimizer captures, serves, downloads and restores its state is decided in ``training/optimizer/``.
"""
