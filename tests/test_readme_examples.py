"""The README's curl examples, sent as written (their URL, headers and body) to a server started
with the flags the README names for them: each must answer 200, as it does for a new user who
pastes it."""

import json
import pathlib
import re
import shlex

import httpx
import pytest
from server_fixtures import thread_server

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def curl_commands() -> list[str]:
    """Every `curl` command in the README's bash blocks, continuation lines joined."""
    cmds = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S):
        for part in re.split(r"\n(?=\s*curl )", block):
            part = part.strip()
            if part.startswith("curl "):
                cmds.append(part)
    return cmds


def as_request(cmd: str) -> tuple[str, dict, str]:
    """(url, headers, body) of one curl command (the flags the README uses: -s, -H, -d)."""
    words = shlex.split(cmd)
    url, headers, body, i = None, {}, None, 1
    while i < len(words):
        w = words[i]
        if w == "-s":
            i += 1
        elif w == "-H":
            k, v = words[i + 1].split(":", 1)
            headers[k.strip()] = v.strip()
            i += 2
        elif w == "-d":
            body = words[i + 1]
            i += 2
        else:
            assert url is None, f"unexpected curl word {w!r} in {cmd!r}"
            url = w
            i += 1
    assert url is not None and body is not None, cmd
    json.loads(body)  # the example's body is valid JSON
    return url, headers, body


def test_the_readme_has_curl_examples():
    assert len(curl_commands()) >= 5


@pytest.fixture(scope="module")
def server():
    # the examples set no max_tokens: a short context bounds what each one generates
    argv = ["--device", "cpu", "--dtype", "float32", "--context-length", "160"]
    argv += ["--tool-call-parser", "qwen3_coder", "--reasoning-parser", "qwen3"]
    with thread_server(argv) as srv:
        yield srv


@pytest.mark.parametrize("cmd", curl_commands())
def test_readme_curl_example_answers_200(server, cmd):
    url, headers, body = as_request(cmd)
    url = re.sub(r"^(http://)?localhost:30000", server.base_url, url)
    r = httpx.post(url, headers=headers, content=body, timeout=120)
    assert r.status_code == 200, (cmd, r.text[:300])
