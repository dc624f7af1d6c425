"""Servers for tests: a tiny random target + drafter with a char-level tokenizer and chat template, served on
127.0.0.1 either in a uvicorn thread of the test process (the engine stays inspectable) or in a subprocess."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import threading
import time

import httpx

# id 0..94 = printable ASCII ('a' first), 95 = <eos> (the target's eos), 96 = <mask> (the drafter's mask token)
CHARS = sorted((chr(c) for c in range(32, 127)), key=lambda ch: (not ch.islower(), ch))
EOS_ID, MASK_ID = 95, 96
CHAT_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# base_url -> --api-key of the servers started here: the helpers below read /get_server_info, which
# needs it
API_KEYS: dict[str, str] = {}


def save_char_tokenizer(model_dir: str) -> None:
    """One token per printable ASCII character, so any ASCII text round-trips through encode/decode."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(CHARS)}
    vocab.update({"<eos>": EOS_ID, "<mask>": MASK_ID})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<mask>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<eos>",
        unk_token="<mask>",
        pad_token="<eos>",
        additional_special_tokens=["<mask>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(model_dir)


def build_tiny_pair(
    root: str,
    seed: int = 0,
    num_layers: int = 2,
    max_position_embeddings: int = 512,
    block_size: int = 4,
) -> tuple[str, str]:
    """(target_dir, drafter_dir): random Qwen3 target (vocab 97) with the char tokenizer + random drafter."""
    from hf_fixtures import save_hf_qwen3
    from pair_fixtures import save_random_drafter

    target, drafter = os.path.join(root, "target"), os.path.join(root, "drafter")
    save_hf_qwen3(
        target,
        seed=seed,
        eos_token_id=EOS_ID,
        bos_token_id=None,
        num_hidden_layers=num_layers,
        max_position_embeddings=max_position_embeddings,
    )
    save_char_tokenizer(target)
    save_random_drafter(
        target, drafter, seed=seed, num_layers=1, block_size=block_size, mask_token_id=MASK_ID
    )
    return target, drafter


def build_tiny_hybrid_pair(root: str, seed: int = 0) -> tuple[str, str]:
    """(target_dir, drafter_dir): random hybrid Qwen3.5 target (GDN + attention, recurrent-state pool)."""
    from hybrid_fixtures import save_hf_qwen3_5
    from pair_fixtures import save_random_drafter

    target, drafter = os.path.join(root, "target"), os.path.join(root, "drafter")
    save_hf_qwen3_5(target, seed=seed, eos_token_id=EOS_ID, bos_token_id=None)
    save_char_tokenizer(target)
    save_random_drafter(
        target, drafter, seed=seed, num_layers=1, block_size=4, mask_token_id=MASK_ID
    )
    return target, drafter


def build_constant_pair(root: str, block_size: int = 8) -> tuple[str, str]:
    """A pair whose drafts are always fully accepted: both final norms are zeroed, so target and drafter logits
    are all zero and greedy decoding emits token 0 ('a') forever - every round accepts the whole block."""
    from safetensors.torch import load_file, save_file

    target, drafter = build_tiny_pair(root, seed=5, block_size=block_size)
    for path, key in ((target, "model.norm.weight"), (drafter, "norm.weight")):
        f = os.path.join(path, "model.safetensors")
        tensors = load_file(f)
        tensors[key].zero_()
        save_file(tensors, f, metadata={"format": "pt"})
    return target, drafter


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_argv(pair, algorithm: str = "NONE", *extra: str) -> list[str]:
    target, drafter = pair
    argv = [
        "--model-path",
        target,
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--enable-metrics",
        "--speculative-algorithm",
        algorithm,
    ]
    if algorithm != "NONE":
        argv += ["--speculative-draft-model-path", drafter]
    if algorithm == "DDTREE":
        argv += ["--speculative-ddtree-budget", "6"]
    return argv + list(extra)


@dataclasses.dataclass
class ThreadServer:
    base_url: str
    app: object
    async_engine: object
    server: object
    thread: threading.Thread

    @property
    def engine(self):
        return self.async_engine.engine

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start_thread_server(argv: list[str], **app_kw) -> ThreadServer:
    """Build the engine and app from server flags and serve them from a uvicorn thread; waits for /health."""
    import uvicorn

    from ddtree.server.http import uvicorn_kwargs
    from ddtree.server.launch import build_app, prepare_args

    args = prepare_args(argv + ["--port", str(free_port())])
    app, async_engine = build_app(args, **app_kw)
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,
        **uvicorn_kwargs(),
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{args.port}"
    if args.api_key:
        API_KEYS[url] = args.api_key
    wait_healthy(url, 60)
    return ThreadServer(url, app, async_engine, server, thread)


@contextlib.contextmanager
def thread_server(argv: list[str], **app_kw):
    srv = start_thread_server(argv, **app_kw)
    try:
        yield srv
    finally:
        srv.stop()


def wait_healthy(base_url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(
                f"server exited with {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}"
            )
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{base_url} not healthy after {timeout}s")


@contextlib.contextmanager
def subprocess_server(
    argv: list[str], module: str = "ddtree.launch_server", env: dict | None = None
):
    """`python -m ddtree.launch_server <argv>` on a free loopback port; yields (base_url, Popen)."""
    port = free_port()
    full_env = dict(
        os.environ,
        PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        **(env or {}),
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *argv, "--port", str(port), "--log-level", "warning"],
        cwd=REPO_ROOT,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    if "--api-key" in argv:
        API_KEYS[url] = argv[argv.index("--api-key") + 1]
    try:
        wait_healthy(url, 120, proc)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def server_info(base_url: str) -> dict:
    key = API_KEYS.get(base_url)
    headers = {"Authorization": f"Bearer {key}"} if key else None
    r = httpx.get(base_url + "/get_server_info", timeout=10, headers=headers)
    r.raise_for_status()
    return r.json()


def wait_idle(base_url: str, timeout: float = 20.0) -> dict:
    """Poll until no request runs or waits; returns the final server info."""
    deadline = time.monotonic() + timeout
    while True:
        info = server_info(base_url)
        if info["num_running_requests"] == 0 and info["num_waiting_requests"] == 0:
            return info
        if time.monotonic() > deadline:
            raise TimeoutError(f"server not idle: {info}")
        time.sleep(0.05)


def wait_running(base_url: str, n: int = 1, timeout: float = 20.0) -> dict:
    """Poll until n requests are in the running batch; returns that server info."""
    deadline = time.monotonic() + timeout
    while True:
        info = server_info(base_url)
        if info["num_running_requests"] == n:
            return info
        if time.monotonic() > deadline:
            raise TimeoutError(f"expected {n} running requests: {info}")
        time.sleep(0.01)
