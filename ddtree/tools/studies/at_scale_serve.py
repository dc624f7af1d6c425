"""The at-scale run's served configs and their servers.

A config is data: a table name, an algorithm and the `ddtree serve` flags that make it
(`ServeConfig`). `--configs` names them (NONE, DFLASH, DDTREE<budget>: `DDTREE64`, and any value
`--speculative-ddtree-budget` takes, e.g. `DDTREEauto` once that lands); `--config-json FILE` gives
a list of {"name", "algorithm", "flags", "env"} objects for anything else (a new policy is a new
entry, not new code; "env": DDTREE_* switches for that server alone, an A/B of one switch in one
run). Every server gets the run's `--server-flags` after the config's own flags.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass

ALGORITHMS = ("NONE", "DFLASH", "DDTREE")


@dataclass(frozen=True)
class ServeConfig:
    name: str  # the table's column; "DDTREE ..." configs are compared with DFLASH, DFLASH with NONE
    algorithm: str
    flags: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()  # environment the server starts with (on top of ours)

    @property
    def budget(self) -> str | None:
        f = self.flags
        i = f.index("--speculative-ddtree-budget") if "--speculative-ddtree-budget" in f else -1
        return f[i + 1] if i >= 0 else None


def parse_config(name: str) -> ServeConfig:
    name = name.strip().upper()
    if name.startswith("DDTREE"):
        budget = name[6:].lower() or "64"
        return ServeConfig(f"DDTREE B={budget}", "DDTREE", ("--speculative-ddtree-budget", budget))
    if name not in ("NONE", "DFLASH"):
        raise ValueError(f"--configs: unknown config {name!r}; use NONE, DFLASH or DDTREE<budget>")
    return ServeConfig(name, name)


def load_configs(names: str, json_path: str | None) -> list[ServeConfig]:
    configs = [parse_config(c) for c in names.split(",") if c.strip()]
    if json_path:
        try:
            with open(json_path, encoding="utf-8") as f:
                items = json.load(f)
            extra = [
                ServeConfig(
                    str(c["name"]),
                    str(c["algorithm"]).upper(),
                    tuple(c.get("flags", ())),
                    tuple((str(k), str(v)) for k, v in c.get("env", {}).items()),
                )
                for c in items
            ]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"--config-json {json_path}: {e}; give a list of "
                '{"name": ..., "algorithm": NONE|DFLASH|DDTREE, "flags": [...], "env": {...}}'
            ) from e
        configs += extra
    bad = [c.algorithm for c in configs if c.algorithm not in ALGORITHMS]
    if bad:
        raise ValueError(f"--config-json: unknown algorithm {bad}; use one of {ALGORITHMS}")
    names = [c.name for c in configs]
    if len(set(names)) != len(names):
        raise ValueError(f"--configs / --config-json: duplicate config names {names}")
    return configs


def level_items(base: list, concurrency: int, ns) -> list:
    n = max(ns.min_prompts, ns.waves * concurrency)
    return [base[i % len(base)] for i in range(n)]


def server_argv(ns, target: str, drafter: str | None, cfg: ServeConfig) -> list[str]:
    """`python3 -m ddtree.launch_server` for one config: `target` is a model directory or an
    `inflate:` spec (the server builds that pair in memory; it brings its own drafter)."""
    argv = [sys.executable, "-m", "ddtree.launch_server", "--model-path", target]
    argv += ["--port", str(ns.port), "--speculative-algorithm", cfg.algorithm]
    argv += ["--device", ns.device, "--attention-backend", ns.attention_backend]
    argv += ["--max-running-requests", str(max(ns.levels)), "--log-level", "warning"]
    argv += ["--enable-metrics"]  # bench serving reads budgets and host time per level from it
    if ns.max_total_tokens:
        argv += ["--max-total-tokens", str(ns.max_total_tokens)]
    if cfg.algorithm != "NONE" and drafter is not None:
        argv += ["--speculative-draft-model-path", drafter]
    if ns.disable_cuda_graph or ns.device == "cpu":
        argv += ["--disable-cuda-graph"]
    else:
        argv += ["--cuda-graph-max-bs", str(max(ns.levels))]
    return argv + list(cfg.flags) + shlex.split(ns.server_flags or "")


class Server:
    """One config's server, log in --out; `with` waits for /health."""

    def __init__(self, ns, argv: list[str], log: str, env: tuple[tuple[str, str], ...] = ()):
        self.argv, self.log_path, self.ns, self.env = argv, log, ns, dict(env)
        self.url = f"http://127.0.0.1:{ns.port}"

    def __enter__(self):
        import httpx

        self.log = open(self.log_path, "w", encoding="utf-8")
        env = {**os.environ, **self.env} if self.env else None
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < self.ns.server_timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode}; see {self.log_path}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    self.startup_s = time.perf_counter() - t0
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.__exit__()
        raise RuntimeError(f"server not up after {self.ns.server_timeout_s} s; see {self.log_path}")

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
