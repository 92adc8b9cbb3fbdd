"""The portable torus implementations, each a ``torus_collectives.schedule`` run on
XLA's own collectives inside the caller's ``shard_map``:

* ``shard_map``: every ring step as a ``lax.ppermute`` (runs on any backend);
* ``lax_torus``: every ring phase as one per-axis ``lax.psum_scatter`` / ``lax.all_gather``.

The Pallas remote-DMA kernels are the third torus implementation; they live in
``torus_collectives.kernels`` because they need Pallas. ``registry`` loads each backend
only when a call chooses it.
"""
