"""Pallas TPU kernels of torus-collectives, installed as ``torus_collectives.kernels``.

* ``torus_kernels``: remote-DMA kernels that execute a torus ``Schedule``;
* ``buffer_layout``: where their grid of chunks lies in a flat buffer, and the DMAs of
  its segments that exist;
* ``pallas_backend``: the collective backend contract of ``torus_collectives.registry``
  on top of them;
* ``batch_norm``: the per-replica batch-norm passes as fused kernels.

Imported only when an implementation chooses Pallas; they import from the core only the
schedule, layout, configs and vma helpers, never the public API.
"""
