"""Scheduling policy without a model: prefill and decode alternate while both have work (a long
prompt cannot stall the running requests), and one prefill batch holds at most
min(--chunked-prefill-size, --max-prefill-tokens) tokens."""

import types

import pytest

from ddtree.engine.scheduling.request import Req, SamplingParams
from ddtree.engine.scheduling.scheduler import Scheduler


class RoomyBlocks:
    num_free_pages = num_available_pages = 10**6

    def can_allocate(self, req, n):
        return True

    def can_admit(self, req, n, hit):
        return True

    def allocate(self, req, n):
        pass

    def extra_pages(self, req, n):
        return 0


def scheduler(chunk: int, max_prefill: int | None = None) -> Scheduler:
    runner = types.SimpleNamespace(
        bm=RoomyBlocks(),
        release=lambda req: None,
        match_prefix=lambda req: None,
        admit=lambda req, hit: None,
        checkpoint_align=0,
    )
    return Scheduler(
        runner, max_running=8, chunk_tokens=chunk, verify_width=4, max_prefill_tokens=max_prefill
    )


def run(s: Scheduler, steps: int) -> list[tuple[str, int]]:
    """Schedule `steps` batches, pretending each ran: prefill advances kv_len, decode emits one
    token."""
    trace = []
    for _ in range(steps):
        b = s.schedule()
        if b is None:
            break
        for r, q in zip(b.reqs, b.q_lens):
            if b.is_prefill:
                r.kv_len += q
                if not r.needs_prefill and not r.output_ids:
                    r.output_ids.append(1)
            else:
                r.kv_len = r.seq_len
                r.output_ids.append(1)
        trace.append(("P" if b.is_prefill else "D", sum(b.q_lens) if b.is_prefill else len(b.reqs)))
    return trace


def req(n: int) -> Req:
    return Req(prompt_ids=list(range(n)), params=SamplingParams(max_tokens=1000))


def test_long_prefill_alternates_with_decode():
    s = scheduler(chunk=64)
    s.add(req(10))
    assert run(s, 2) == [("P", 10), ("D", 1)]  # the short request is decoding
    s.add(req(64 * 5))  # a long prompt: five chunks
    trace = run(s, 10)
    assert trace == [("P", 64), ("D", 1)] * 4 + [("P", 64), ("D", 2)], trace
    # without a running request the chunks run back to back
    s2 = scheduler(chunk=64)
    s2.add(req(64 * 3))
    assert run(s2, 3) == [("P", 64)] * 3


def test_max_prefill_tokens_caps_one_prefill_batch():
    s = scheduler(chunk=2048, max_prefill=100)
    for _ in range(3):
        s.add(req(60))
    trace = run(s, 3)
    assert trace[0] == ("P", 100), trace  # 60 + the first 40 of the second prompt
    assert all(n <= 100 for kind, n in trace if kind == "P")


@pytest.mark.parametrize(
    "chunk, max_prefill, budget", [(-1, 500, 500), (64, 500, 64), (512, 100, 100)]
)
def test_prefill_budget(chunk, max_prefill, budget):
    assert scheduler(chunk, max_prefill).prefill_budget == budget
    s = scheduler(chunk, max_prefill)
    s.add(req(2 * budget))
    assert run(s, 3) == [
        ("P", budget),
        ("P", budget),
        ("D", 1),
    ]  # chunking disabled still never exceeds --max-prefill-tokens


def test_short_prompt_behind_a_long_one_is_admitted_at_the_next_prefill():
    s = scheduler(chunk=64)
    s.add(req(64 * 10))
    assert run(s, 1) == [("P", 64)]
    s.add(req(5))  # arrives while the long prompt prefills
    trace = run(s, 3)
    # the long prompt's chunk yields half the budget; the short prompt is prefilled at once and decodes
    assert trace[0] == ("P", 32 + 5) and trace[1] == ("D", 1), trace
    assert trace[2] == ("P", 64)  # nobody waits: the long prompt has the whole budget again
