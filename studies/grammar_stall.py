"""A plain request beside pathological grammars (issue 54): a DDTREE server on the embedded pair,
four plain 8-token requests alone, then four more sent 0.5 s after two regexes whose masks take
seconds a token (`(.{1,50}){1,50}`, `a(.{1,50}){1,50}`), with /health polled throughout. Prints
the latencies, the pathological requests' answers and the /health codes. From the repository
root (CPU): `python3 studies/grammar_stall.py`. tests/test_server_grammar_bounds.py is its CI form.
"""

import os
import sys
import threading
import time

import httpx

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
)
from server_fixtures import server_argv, start_thread_server  # noqa: E402

from ddtree.assets import PACKAGE_PAIR  # noqa: E402

PAIR = (f"{PACKAGE_PAIR}/target", f"{PACKAGE_PAIR}/drafter")
PLAIN = {"prompt": "def f(x):", "max_tokens": 8, "temperature": 0}
REGEXES = ("(.{1,50}){1,50}", "a(.{1,50}){1,50}")


def main() -> None:
    srv = start_thread_server(server_argv(PAIR, "DDTREE"))
    url = srv.base_url + "/v1/completions"

    def latency(body, timeout=60):
        t0 = time.monotonic()
        try:
            r = httpx.post(url, json=body, timeout=timeout)
        except httpx.TimeoutException:
            return None, "timeout"
        return round(time.monotonic() - t0, 2), r.status_code

    alone = [latency(PLAIN) for _ in range(4)]
    health, stop, bad = [], threading.Event(), []

    def poll():
        while not stop.is_set():
            try:
                health.append(httpx.get(srv.base_url + "/health", timeout=5).status_code)
            except httpx.HTTPError:
                health.append("err")
            time.sleep(0.5)

    for pat in REGEXES:
        body = PLAIN | {"regex": pat, "max_tokens": 64}
        threading.Thread(
            target=lambda p=pat, b=body: bad.append((p, *latency(b, 600))), daemon=True
        ).start()
    threading.Thread(target=poll, daemon=True).start()
    time.sleep(0.5)
    beside = [latency(PLAIN) for _ in range(4)]
    stop.set()
    print("plain alone (s, status)", alone)
    print("plain beside the regexes", beside)
    print("pathological (regex, s, status)", bad)
    print("/health", {h: health.count(h) for h in set(health)}, flush=True)
    os._exit(0)  # a pathological fill may still run on the old code: do not wait for it


if __name__ == "__main__":
    main()
