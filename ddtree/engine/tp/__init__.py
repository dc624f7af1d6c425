"""Tensor parallelism: one process per rank started from `--tp-size` (`launch.py`), rank 0's commands
broadcast to the others each step (`rank.py`), the followers' loop (`launch.run_rank`). The sharded layers
are `ddtree.models.parallel`; how a model splits is `ddtree.models.tp_layout`."""
