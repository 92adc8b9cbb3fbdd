"""Distributed batch norm over replica groups that tile the torus.

* ``batch_norm``: the fused op ``tc.batch_norm`` (statistics, group sum, normalise, and
  its custom VJP);
* ``passes``: its four per-replica passes as plain jnp (the "xla" implementation, and the
  reference the Pallas kernels are tested against);
* ``block_sizes``: ``BlockSizes``, the kernels' one tunable;
* ``linen``: ``BatchNorm``, a drop-in for ``flax.linen.BatchNorm`` (needs flax).
"""
