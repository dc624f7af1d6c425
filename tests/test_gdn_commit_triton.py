"""no_buffer's in-place commit kernel (ddtree/kernels/gdn/commit_triton.py) against the pool's reference
commit (gathers + replay + index_put, where our kernels do not run): every layer, ragged accept lengths
(the root alone up to past the conv window), GQA, a dv of a partial tile, conv windows of 1 and 3, a bf16
state pool, slots in any order with rows no request owns untouched, garbage past each path; the dispatch;
and the hybrid engine (no_buffer DDTREE) token-identical to AR with the kernel in the loop. Without a GPU
the kernel runs in Triton's CPU interpreter."""

import pytest
import torch
from triton_utils import DEV, cpu_interpreter_only, load_kernel_module

kernel = load_kernel_module("ddtree.kernels.gdn.commit_triton")

from ddtree import envs  # noqa: E402
from ddtree.engine.config import GDNGeometry  # noqa: E402
from ddtree.engine.memory import state_pool  # noqa: E402
from ddtree.engine.memory.state_pool import HybridStatePool  # noqa: E402
from ddtree.kernels.gdn import backend  # noqa: E402


def _pool(geo, ssm_dtype, seed, rows=4, width=7):
    pool = HybridStatePool(geo, rows, width, DEV, "no_buffer", ssm_dtype, torch.float32)
    g = torch.Generator().manual_seed(seed)
    for t in (pool.conv, pool.ssm, *pool.stash.values()):
        t.copy_((torch.randn(t.shape, generator=g) * 0.5).to(t.dtype))
    pool.stash["node_g"].copy_(-pool.stash["node_g"].abs())  # log-decay <= 0
    pool.stash["node_beta"].copy_(pool.stash["node_beta"].sigmoid())
    return pool


def _commit(pool, slots, path, acc):
    st = pool.stash
    kernel.commit_replay_triton(
        pool.ssm, pool.conv, st["node_x"], st["node_y"], st["node_g"], st["node_beta"],
        slots, path, acc, pool.geo.hk,
    )  # fmt: skip


@pytest.mark.parametrize(
    "geo,ssm_dtype",
    [
        (GDNGeometry(num_layers=3, hk=2, dk=16, hv=4, dv=24, kernel=4), "float32"),
        (GDNGeometry(num_layers=2, hk=1, dk=32, hv=2, dv=16, kernel=2), "float32"),
        (GDNGeometry(num_layers=2, hk=2, dk=16, hv=2, dv=32, kernel=4), "bfloat16"),
    ],
)
def test_matches_the_reference_commit(geo, ssm_dtype, monkeypatch):
    slots = torch.tensor([3, 0, 1], device=DEV)
    # accepted 2, 0 (the root alone) and 5 (past the window); the rest of each path is garbage
    path = torch.tensor([[0, 2, 5, 6, 9, 9], [0, -7, 3, 3, 3, 3], [0, 1, 2, 3, 4, 6]], device=DEV)
    acc = torch.tensor([2, 0, 5], device=DEV)
    want, got, before = (_pool(geo, ssm_dtype, seed=1) for _ in range(3))
    monkeypatch.setenv(envs.REFERENCE.name, "gdn")  # the pool's reference commit
    want.commit(slots, path.clamp(min=0), acc)
    _commit(got, slots, path, acc)
    tol = 1e-5 if ssm_dtype == "float32" else 1e-2
    torch.testing.assert_close(got.ssm.float(), want.ssm.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(got.conv, want.conv, rtol=0, atol=0)
    assert not torch.equal(got.ssm[:, slots], before.ssm[:, slots])  # the commit did something
    assert torch.equal(got.ssm[:, 2], before.ssm[:, 2]) and torch.equal(
        got.conv[:, 2], before.conv[:, 2]
    )
    for name, t in got.stash.items():  # the stash is only read
        assert torch.equal(t, before.stash[name]), name


@cpu_interpreter_only
def test_dispatch(monkeypatch):
    """The kernel where our Triton kernels run, the reference under DDTREE_REFERENCE=gdn."""
    geo = GDNGeometry(num_layers=2, hk=1, dk=16, hv=2, dv=16, kernel=4)
    slots, path, acc = torch.tensor([1]), torch.tensor([[0, 1, 2]]), torch.tensor([2])
    monkeypatch.setenv(envs.FUSED_KERNELS_INTERPRET.name, "1")
    for force, want in (("", {("commit", "triton"): 1}), ("gdn", {("replay", "reference"): 1})):
        monkeypatch.setenv(envs.REFERENCE.name, force)
        backend.ran.clear()
        _pool(geo, "float32", 0).commit(slots, path, acc)
        assert dict(backend.ran) == want, (force, backend.ran)


@cpu_interpreter_only
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("algorithm,chunk", [("DDTREE", False), ("DFLASH", True), ("DDTREE", True)])
def test_hybrid_no_buffer_lossless_with_the_commit_kernel(
    toy_hybrid_pair, monkeypatch, algorithm, chunk
):
    """The commit kernel in the interpreter (with chunk: the verify kernel too, CUDA's no_buffer
    pair of kernels; the rest on the references), 2 requests, T=0 == AR."""
    from engine_utils import accepted_prompts, mean_accept, run

    from ddtree import SamplingParams
    from ddtree.kernels.gdn import dispatch

    prompts = accepted_prompts(2)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ar = [o.token_ids for o in run(toy_hybrid_pair, prompts, params)]
    monkeypatch.setattr(state_pool, "commit_kernel", lambda t: True)
    if chunk:
        monkeypatch.delenv(envs.REFERENCE.name, raising=False)
        monkeypatch.setattr(dispatch, "use_triton", lambda t: True)
    backend.ran.clear()
    kw = dict(speculative_ddtree_budget=16) if algorithm == "DDTREE" else {}
    outs = run(
        toy_hybrid_pair,
        prompts,
        params,
        algorithm=algorithm,
        mamba_scheduler_strategy="no_buffer",
        **kw,
    )
    assert [o.token_ids for o in outs] == ar and mean_accept(outs) > 2
    assert backend.ran[("commit", "triton")] > 0
    assert (backend.ran[("tree", "chunk")] > 0) == chunk
