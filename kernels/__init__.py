"""Pallas TPU kernels of torus-collectives, installed as ``torus_collectives.kernels``.

* ``remote_dma``: the machinery the three kernel families share: the topology and ring
  neighbours, the entry barrier, remote copies and their waits, semaphore budgets, the
  mesh-target check;
* ``torus_kernels``: the blocking remote-DMA kernels that execute a torus ``Schedule``;
* ``buffer_layout``: where their grid of chunks lies in a flat buffer, and the DMAs of
  its segments that exist;
* ``leaf_kernels``: the same schedules run on a bucket's leaves where they lie (no
  packing), each leaf cut along its rows as ``leaf_grid`` says;
* ``quantized_kernels``: the block-scaled (int8) all-reduce, reduce-scatter and
  all-gather, requantizing at every hop;
* ``split_leaf_kernels``: the leaf kernels' all-reduce as chains of Pallas calls (a
  start, one per hop and a done, each returning while its DMAs are on the link);
* ``pallas_backend``: the collective backend contract of ``torus_collectives.registry``
  on top of them;
* ``batch_norm``: the per-replica batch-norm passes as fused kernels.

Imported only when an implementation chooses Pallas; from the core they import only the
shared facts (``schedule``, ``tiling``, ``kernel_config``, ``axes``, ``quantization``,
``target``, the vma helpers) and batch norm's ``norm.block_sizes`` and ``norm.passes``,
never the public API.
"""
