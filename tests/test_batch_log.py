"""SGLang-style engine log lines: one per prefill batch, one every --decode-log-interval decode
steps."""

import logging
import re

import pytest
from server_fixtures import build_tiny_pair

from ddtree import LLM, SamplingParams
from ddtree.config import ServerArgs, resolve_server_args
from ddtree.models.configs import ConfigError

DECODE = re.compile(
    r"^Decode batch\. #running-req: (\d+), #token: (\d+), token usage: (\d\.\d\d), accept len: "
    r"(\d+\.\d\d), gen throughput \(token/s\): (\d+\.\d\d), #queue-req: (\d+), budget: "
    r"(\d+\.\d), predicted accept: (-|\d+\.\d\d), round: (\d+\.\d\d) ms, host: (\d+\.\d\d) ms, "
    r"server: (\d+\.\d\d) ms$"
)
PREFILL = re.compile(
    r"^Prefill batch\. #new-seq: (\d+), #new-token: (\d+), #cached-token: \d+, token usage: "
    r"(\d\.\d\d), #running-req: (\d+), #queue-req: (\d+)$"
)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_tiny_pair(str(tmp_path_factory.mktemp("log_pair")))


def lines(caplog, pattern):
    return [
        m
        for m in (pattern.match(r.getMessage()) for r in caplog.records if r.name == "ddtree")
        if m
    ]


@pytest.mark.parametrize("algorithm, interval", [("NONE", 4), ("DDTREE", 2)])
def test_decode_and_prefill_lines_every_interval(pair, caplog, algorithm, interval):
    kw = (
        {"speculative_draft_model_path": pair[1], "speculative_ddtree_budget": 6}
        if algorithm != "NONE"
        else {}
    )
    llm = LLM(
        pair[0],
        device="cpu",
        dtype="float32",
        speculative_algorithm=algorithm,
        decode_log_interval=interval,
        max_total_tokens=512,
        **kw,
    )
    caplog.set_level(logging.INFO, logger="ddtree")
    caplog.clear()
    outs = llm.generate(
        [[1, 2, 3], [4, 5, 6, 7]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )
    prefill = lines(caplog, PREFILL)
    assert prefill and [int(m[1]) for m in prefill] == [2] and [int(m[2]) for m in prefill] == [7]
    decode = lines(caplog, DECODE)
    steps = max(o.rounds for o in outs)
    assert len(decode) == steps // interval  # one line per `interval` decode steps, none in between
    first = decode[0]
    assert int(first[1]) == 2 and int(first[2]) > 7 and float(first[3]) > 0 and int(first[6]) == 0
    assert float(first[5]) > 0
    if algorithm == "NONE":
        assert float(first[4]) == 1.0 and float(first[7]) == 0.0
    else:
        assert float(first[4]) >= 1.0
    if algorithm == "DDTREE":
        assert float(first[7]) == 6.0  # the fixed budget per request-round
    assert first[8] == "-"  # no predictions without --speculative-ddtree-budget auto
    assert float(first[9]) > 0 and float(first[10]) > 0 and float(first[11]) == 0.0  # offline


def test_decode_line_reports_auto_budgets_and_predictions(pair, caplog):
    llm = LLM(
        pair[0],
        device="cpu",
        dtype="float32",
        speculative_algorithm="DDTREE",
        speculative_draft_model_path=pair[1],
        speculative_ddtree_budget="auto",
        speculative_ddtree_max_budget=8,
        decode_log_interval=2,
    )
    caplog.set_level(logging.INFO, logger="ddtree")
    llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    first = lines(caplog, DECODE)[0]
    assert 0.0 <= float(first[7]) <= 8.0 and float(first[8]) >= 1.0


def test_decode_log_interval_is_checked():
    with pytest.raises(ConfigError, match="--decode-log-interval 0"):
        resolve_server_args(ServerArgs(decode_log_interval=0, device="cpu"))


def test_gen_throughput_is_over_busy_time_not_idle_time():
    """The decode line's throughput divides the tokens by the steps' own seconds (prefill and
    decode, with the server's loop around them): a pause with no request in between, however
    long, does not dilute it (the server's line read 4.4 tok/s while it decoded 60+)."""
    from types import SimpleNamespace

    from ddtree.engine.scheduling.batch_log import BatchLog

    sched = SimpleNamespace(running=[], waiting=[], bm=SimpleNamespace(num_pages=0))
    log = BatchLog(sched, interval=2)
    timing = SimpleNamespace(round_s=0.02, host_s=0.005)
    rec = SimpleNamespace(budgets=[0], predicted=[], timing=timing)
    log.prefill([5], step_s=0.05)
    log.decode([[1, 2]], rec)
    log.server_time(0.005)
    # an idle stretch here costs nothing: only steps count
    assert log.busy_s == pytest.approx(0.05 + 0.025 + 0.005)
    with_lines = []
    handler = logging.Handler()
    handler.emit = lambda r: with_lines.append(r.getMessage())
    logger = logging.getLogger("ddtree")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    try:
        log.decode([[3, 4]], rec)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
    m = DECODE.match(with_lines[-1])
    assert m is not None
    # 4 tokens over 0.05 + 2 x 0.025 + 0.005 s of steps
    assert float(m[5]) == pytest.approx(4 / 0.105, abs=0.01)
