"""Weight-update sharding (Xu et al. 2020) for optax transformations.

* ``sharded_update``: ``sharded_update`` and ``ShardedUpdate``: reduce-scatter the
  gradients, update each device's shard of the weights, all-gather the new weights;
* ``sharded_eval``: runs the traced update on flat shards, with every whole-leaf reduction
  completed across devices, or refuses what it cannot run exactly;
* ``xla_collectives``: the reduce-scatter and all-gather on lax, in the forms XLA's TPU
  compiler emits as genuine ones;
* ``trust_ratio``: LARS with one reduction per step (``lars``, ``scale_by_trust_ratio``).

Needs optax (the ``optax`` extra).
"""
