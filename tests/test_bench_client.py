"""`bench serving`'s client (`ddtree/bench/stream_client.py`): both clients read the same stream into
the same result, a request in flight owns its connection, bad requests come back as failed results,
and the client's own load is measured."""

import asyncio
import time
from argparse import Namespace

import pytest
from server_fixtures import build_tiny_pair, server_argv, thread_server

from ddtree.bench.serving import Item, one_request
from ddtree.bench.stream_client import PROBE_S, ClientLoad, Lanes, make_client


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_tiny_pair(str(tmp_path_factory.mktemp("client_pair")), seed=5)


def _ns(**kw) -> Namespace:
    base = dict(max_tokens=6, temperature=0.0, ignore_eos=True, chat=False)
    return Namespace(**(base | kw))


async def _both(base_url: str, items: list[Item], ns) -> dict:
    out = {}
    for kind in ("httpx", "openai"):
        client = make_client(kind, base_url, None, 60.0)
        try:
            model = await client.model()
            out[kind] = [await one_request(client, model, it, ns) for it in items]
        finally:
            await client.close()
    return out


def test_httpx_and_openai_clients_read_the_same_stream(pair):
    items = [
        Item(prompt="def f(x):"),
        Item(prompt=[3, 4, 5], max_tokens=4),
        Item(messages=[{"role": "user", "content": "hi"}], max_tokens=5),
    ]
    with thread_server(server_argv(pair, "DDTREE")) as srv:
        got = asyncio.run(_both(srv.base_url, items, _ns()))
    for a, b, it in zip(got["httpx"], got["openai"], items):
        assert a.ok and b.ok, (a.error, b.error)
        assert a.completion_tokens == b.completion_tokens == (it.max_tokens or 6)
        assert a.prompt_tokens == b.prompt_tokens > 0
        # T=0: the same rounds, so the same `ddtree` extension
        assert a.rounds == b.rounds > 0 and a.mean_accept_length == b.mean_accept_length >= 1.0
        assert a.timing and set(a.timing) == set(b.timing)
        assert 0 < a.ttft <= a.latency and 0 < b.ttft <= b.latency


def test_a_rejected_request_is_a_failed_result_with_the_servers_reason(pair):
    bad = Item(prompt="x", max_tokens=-3)
    with thread_server(server_argv(pair, "DFLASH")) as srv:
        got = asyncio.run(_both(srv.base_url, [bad], _ns()))
    for kind, (res,) in got.items():
        assert not res.ok and res.error, kind
        assert "max_tokens" in res.error, (kind, res.error)
    assert "HTTP 400" in got["httpx"][0].error


def test_a_request_in_flight_owns_its_connection():
    """Eight overlapping requests take eight lanes; the next ones reuse them (no new connection,
    none shared while in use)."""

    async def main():
        lanes = Lanes({}, 5.0)
        held = []

        async def use(delay):
            async with lanes.lane() as http:
                assert http not in held  # nobody else's in-flight connection
                held.append(http)
                await asyncio.sleep(delay)
                held.remove(http)

        await asyncio.gather(*(use(0.01) for _ in range(8)))
        assert len(lanes.https) == 8
        await asyncio.gather(*(use(0.0) for _ in range(8)))
        await use(0.0)
        assert len(lanes.https) == 8 and len(lanes.free) == 8
        assert all(h.timeout.read == 5.0 for h in lanes.https)
        await lanes.aclose()
        assert lanes.https == [] and lanes.free == []

    asyncio.run(main())


def test_client_load_sees_a_blocked_loop_and_a_busy_cpu():
    """0.15 s of this process's CPU time spent with the loop blocked: the lag probe sees at least
    that much wall time, the CPU share counts it. Measured in CPU time, so a loaded machine (the
    process getting less than a core) stretches the wall time but changes no assertion."""

    async def main():
        async with ClientLoad() as load:
            await asyncio.sleep(0.02)
            c = time.process_time()
            while time.process_time() - c < 0.15:  # the loop blocked, the CPU busy
                pass
            await asyncio.sleep(0.02)
        return load, load.report()

    load, r = asyncio.run(main())
    assert r["loop_lag_ms"]["max"] >= 150.0 - PROBE_S * 1e3
    assert r["loop_lag_ms"]["mean"] < r["loop_lag_ms"]["max"]
    assert load.cpu >= 0.15 and r["cpu_share"] == pytest.approx(load.cpu / load.wall)
    assert r["cpu_share"] <= 1.2  # one thread: at most a core, up to the clocks' granularity


def test_unknown_client_is_refused():
    with pytest.raises(ValueError, match="--client"):
        make_client("aiohttp", "http://127.0.0.1:1", None, 1.0)
