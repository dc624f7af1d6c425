"""Unknown request fields and the server's memory and log (issue 54): 40 requests with 250k
distinct unknown top-level fields each (~4 MB), then 200 with 64 new names each, against
`python -m ddtree.launch_server` (the embedded pair, AR) logging to a file; prints the answers,
the server's RSS before and after and the log's size. From the repository root (CPU):
`python3 studies/unknown_fields_rss.py`.
"""

import json
import os
import subprocess
import sys
import tempfile
import time

import httpx

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
)
from server_fixtures import free_port, server_argv, wait_healthy  # noqa: E402

from ddtree.assets import PACKAGE_PAIR  # noqa: E402

PAIR = (os.path.join(PACKAGE_PAIR, "target"), os.path.join(PACKAGE_PAIR, "drafter"))


def rss_mb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS"))


def main() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = os.path.join(tempfile.mkdtemp(), "server.log")
    argv = [*server_argv(PAIR, "NONE"), "--port", str(port)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ddtree.launch_server", *argv], stdout=log, stderr=log
        )
        wait_healthy(url, 120, proc)
        c = httpx.Client(timeout=120)
        c.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 2})
        before, statuses = rss_mb(proc.pid), set()
        for k in range(40):
            body = {"prompt": "a", "max_tokens": 2} | {f"u{k}_{i:06d}": 1 for i in range(250_000)}
            raw = json.dumps(body)
            headers = {"content-type": "application/json"}
            r = c.post(url + "/v1/completions", content=raw, headers=headers)
            statuses.add((r.status_code, r.json()["error"]["message"][:90] if r.is_error else ""))
        for k in range(200):  # within the bound: 64 new names a request
            body = {"prompt": "a", "max_tokens": 1} | {f"v{k}_{i}": 1 for i in range(64)}
            c.post(url + "/v1/completions", json=body)
        time.sleep(1)
        after = rss_mb(proc.pid)
        proc.terminate()
        proc.wait(timeout=30)
    with open(log_path) as f:
        text = f.read()
    print(f"body {len(raw) / 1e6:.2f} MB; answers {statuses}")
    print(f"RSS MB before {before}, after {after}, delta {after - before}")
    print(f"log bytes {len(text)}, warning lines {text.count('not known to this server')}")


if __name__ == "__main__":
    main()
