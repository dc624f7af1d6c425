"""What every request holds agrees with the pools, between two engine steps.

The invariant behind issue 39: whatever finishes a request (stop string, stop id, EOS, length,
abort, preemption) and wherever it falls inside an accepted block, what the request commits - its
tokens, `kv_len`, its pages, the cached pages it leaves, the recurrent-state checkpoints - agrees:

- slots: every block-table row is free or held by exactly one running request; waiting requests
  hold no slot, no page and no KV (`kv_len == 0`);
- pages: the block manager's own check (every page free, private to one request or cached; ref
  counts = the running requests whose cached prefix passes the node), and each running request's
  pages cover exactly its `kv_len` tokens (while it prefills: its whole prompt), its shared
  (cached) pages end at or below `kv_len` (no KV write can reach them) and spell its own tokens,
  page by page;
- lengths: a decoding request caches every token but the pending one (`kv_len == seq_len - 1`), a
  prefilling one a part of its prompt (or of its tokens, after a preemption); none has passed its
  max_tokens or the context;
- hybrid targets: every checkpoint row is free or held by one live cached node;
- the engine forgets a request when it finishes: the live requests are exactly the scheduler's,
  and no detokenizer state outlives its request.

`problems(engine)` lists what is wrong (empty when whole), host-only and O(pages + requests +
cached nodes); `deep=True` adds the device reads (block-table rows, finite hybrid states).
`drained_problems(engine)` is the idle engine's stronger form: nothing held, every cached page
unreferenced. The differential fuzzer (tests/fuzz_engine.py) checks both after every step.
"""

from __future__ import annotations

from ddtree.engine.scheduling.request import Req, ReqStatus


class IntegrityError(AssertionError):
    pass


def _guard(out: list[str], what: str, check) -> None:
    try:
        check()
    except AssertionError as e:
        out.append(f"{what}: {e}")


def problems(engine, deep: bool = False) -> list[str]:
    """Every broken invariant of a live engine, between two steps (empty: whole)."""
    sched, runner = engine.scheduler, engine.runner
    bm = runner.bm
    out: list[str] = []
    _guard(out, "block manager", bm.check_integrity)
    running, waiting = list(sched.running), list(sched.waiting)
    ids = [id(r) for r in running + waiting]
    if len(ids) != len(set(ids)):
        out.append("a request is queued twice (running and waiting, or twice in one)")
    out += _slot_problems(bm, running, waiting)
    for r in running:
        out += [f"{r.rid}: {p}" for p in _running_problems(engine, r)]
    out += _engine_problems(engine, running + waiting)
    if runner.checkpoints is not None:
        _guard(out, "state checkpoints", lambda: runner.checkpoints.check_integrity(bm.cache))
    if deep:
        for r in running:
            row = bm.block_table[r.slot, : len(bm.pages[r.slot])].tolist()
            if row != bm.pages[r.slot]:
                out.append(f"{r.rid}: block-table row {row} != its pages {bm.pages[r.slot]}")
        if runner.state_pool is not None:
            slots = [r.slot for r in running]
            _guard(out, "state pool", lambda: runner.state_pool.check_rows(slots))
    return out


def _slot_problems(bm, running: list[Req], waiting: list[Req]) -> list[str]:
    out = []
    total = bm.block_table.shape[0]
    held = [r.slot for r in running]
    free = list(bm.free_slots)
    if sorted(held + free) != list(range(total)):
        out.append(
            f"request slots: {len(free)} free + {len(held)} running != {total} "
            f"(held {sorted(held)}, free {sorted(free)})"
        )
    if set(bm.pages) != set(held) or set(bm.shared) != set(held) or set(bm.node) != set(held):
        out.append(f"page tables of slots {sorted(bm.pages)} != running slots {sorted(held)}")
    for r in waiting:
        if r.slot >= 0 or r.kv_len or r.status is not ReqStatus.WAITING:
            out.append(f"{r.rid}: waiting with slot {r.slot}, kv_len {r.kv_len}, {r.status}")
    return out


def _running_problems(engine, r: Req) -> list[str]:
    bm = engine.runner.bm
    out = []
    if r.status is not ReqStatus.RUNNING or r.finish_reason is not None:
        out.append(f"running with status {r.status}, finish_reason {r.finish_reason}")
    pages = bm.pages.get(r.slot)
    if pages is None:
        return out + [f"running in slot {r.slot}, which has no page table"]
    p = bm.page_size
    # a prefilling request holds its whole prompt's pages from admission on, a decoding one its
    # cached tokens' (a round's verify pages past them go back at its `advance`)
    want = r.prefill_len if r.needs_prefill else r.kv_len
    if len(pages) != bm.pages_for(want):
        out.append(f"{len(pages)} pages for {want} tokens (kv_len {r.kv_len}, page size {p})")
    if bm.shared[r.slot] * p > r.kv_len:
        out.append(f"{bm.shared[r.slot]} shared pages past kv_len {r.kv_len}")
    node = bm.node[r.slot]
    for i, n in enumerate(node.path() if node is not None else ()):
        if n.key != tuple(r.token_slice(i * p, (i + 1) * p)):
            out.append(f"cached page {i} (page {n.page}) spells {n.key}, not the request's tokens")
            break
    if not 0 < r.kv_len <= r.prefill_len:
        out.append(f"kv_len {r.kv_len} outside 1..{r.prefill_len} (its prefill length)")
    elif not r.needs_prefill and (not r.output_ids or r.kv_len != r.seq_len - 1):
        out.append(f"decoding with kv_len {r.kv_len} != its tokens but the pending one")
    # max_tokens 0 (prefill only) runs until its prompt is prefilled, then finishes
    if r.num_output_tokens >= max(r.params.max_tokens, 1) or r.seq_len >= engine.max_context:
        out.append(f"still running at {r.num_output_tokens} tokens, sequence {r.seq_len}")
    if r.params.logprobs and len(r.logprobs) != r.num_output_tokens:
        out.append(f"{len(r.logprobs)} log-prob entries for {r.num_output_tokens} tokens")
    return out


def _engine_problems(engine, live: list[Req]) -> list[str]:
    out = []
    rids = {r.rid for r in live}
    if set(engine.requests) != rids:
        gone = sorted(set(engine.requests) - rids)[:4]
        lost = sorted(rids - set(engine.requests))[:4]
        out.append(f"engine requests != the scheduler's: finished but kept {gone}, lost {lost}")
    em = engine.emitter
    for name, table in (("detokenizer", em.detok), ("deferred text", em.lag)):
        stale = sorted(set(table) - rids)
        if stale:
            out.append(f"{name} state of finished requests {stale[:4]} ({len(stale)})")
    return out


def drained_problems(engine, deep: bool = False) -> list[str]:
    """An engine with nothing to do holds nothing: every slot free, no private page, every cached
    page unreferenced (so the whole pool is available), and no request state left."""
    out = problems(engine, deep)
    sched, bm = engine.scheduler, engine.runner.bm
    if sched.running or sched.waiting:
        out.append(f"not drained: {len(sched.running)} running, {len(sched.waiting)} waiting")
    if bm.num_free_slots != bm.block_table.shape[0]:
        out.append(f"{bm.block_table.shape[0] - bm.num_free_slots} request slots leaked")
    if bm.num_available_pages != bm.num_pages:
        out.append(
            f"{bm.num_pages - bm.num_available_pages} of {bm.num_pages} pages not available "
            f"({bm.num_free_pages} free, {bm.num_cached_pages} cached)"
        )
    return out


def finished_problems(req: Req) -> list[str]:
    """A finished request holds nothing and says why it finished."""
    out = []
    if req.status is not ReqStatus.FINISHED or req.finish_reason is None:
        out.append(f"finished with status {req.status}, finish_reason {req.finish_reason}")
    if req.slot >= 0 or req.kv_len:
        out.append(f"finished holding slot {req.slot}, kv_len {req.kv_len}")
    if req.params.logprobs and len(req.logprobs) != req.num_output_tokens:
        out.append(f"{len(req.logprobs)} log-prob entries for {req.num_output_tokens} tokens")
    return [f"{req.rid}: {p}" for p in out]


def check(engine, deep: bool = False) -> None:
    """Raise IntegrityError naming every broken invariant."""
    bad = problems(engine, deep)
    if bad:
        raise IntegrityError("; ".join(bad))


def check_drained(engine, deep: bool = False) -> None:
    bad = drained_problems(engine, deep)
    if bad:
        raise IntegrityError("; ".join(bad))
