"""no_buffer commit replays the accepted path in groups of layers (bounded transient memory): the result
must not depend on the group size."""

import torch

from ddtree.engine.config import GDNGeometry
from ddtree.engine.memory import state_pool
from ddtree.engine.memory.state_pool import HybridStatePool


def _pool(seed: int) -> HybridStatePool:
    geo = GDNGeometry(num_layers=5, hk=2, dk=4, hv=4, dv=4, kernel=4)
    pool = HybridStatePool(geo, 3, 6, "cpu", "no_buffer", "float32", torch.float32)
    g = torch.Generator().manual_seed(seed)
    for t in (pool.conv, pool.ssm, *pool.stash.values()):
        t.copy_(torch.randn(t.shape, generator=g) * 0.5)
    pool.stash["node_g"].copy_(-pool.stash["node_g"].abs())  # log-decay <= 0
    pool.stash["node_beta"].copy_(pool.stash["node_beta"].sigmoid())
    return pool


def test_replay_groups_of_layers_match_one_group(monkeypatch):
    slots = torch.tensor([2, 0])
    path = torch.tensor([[0, 2, 5, -1], [0, 1, -1, -1]])
    acc = torch.tensor([2, 1])
    whole, grouped = _pool(0), _pool(0)
    whole.commit(slots, path, acc)
    # one layer per group: the per-layer bytes of 2 rows exceed the cap
    monkeypatch.setattr(state_pool, "REPLAY_GROUP_BYTES", 1)
    grouped.commit(slots, path, acc)
    untouched = _pool(0)
    assert not torch.equal(whole.ssm[:, slots], untouched.ssm[:, slots])  # the commit did something
    torch.testing.assert_close(grouped.ssm, whole.ssm, rtol=0, atol=0)
    torch.testing.assert_close(grouped.conv, whole.conv, rtol=0, atol=0)
    torch.testing.assert_close(
        whole.ssm[:, 1], untouched.ssm[:, 1], rtol=0, atol=0
    )  # row 1 not in slots
