"""What the HTTP process and a `--dp-size` replica say to each other over their pipe (pickled
tuples, one kind per first element). Streams go one way in batches: a replica sends one DELTAS
message per publish (every stream that advanced in that engine step), never one per token.

HTTP process -> replica:
  (ADD, rid, prompt_ids, SamplingParams, arrival)   admit a request (arrival: time.monotonic(),
                                                    one clock for every process of the host)
  (ABORT, rid)                                      the client went away
  (CALL, call_id, what)                             what = INFO (pool numbers) | METRICS (text)
  (FAIL_ALL, message)                               end every request in flight (shutdown)
  (STOP,)                                           leave (after the server drained)
replica -> HTTP process:
  (READY, info)                                     the engine is built (warm-up may still run)
  (FAILED, message, is_config)                      it could not be built (is_config: a
                                                    ConfigError's problems); the process exits
  (STATUS, problem | None)                          every HEARTBEAT_S: its /health problem
  (ADDED, rid) / (REFUSED, rid, kind, message)      the answer to ADD (kind: busy (its queue is
                                                    full: another replica is tried) | unavailable
                                                    | invalid | error: 503 / 400 / 500)
  (DELTAS, [(rid, Delta), ...])                     the streams' new output; a Delta with
                                                    finish_reason or error ends its stream
  (REPLY, call_id, result)                          the answer to CALL (None where it failed)
  (STOPPED,)                                        it drained and is leaving
"""

ADD, ABORT, CALL, FAIL_ALL, STOP = "add", "abort", "call", "fail_all", "stop"
READY, FAILED, STATUS, ADDED, REFUSED, DELTAS, REPLY, STOPPED = (
    "ready",
    "failed",
    "status",
    "added",
    "refused",
    "deltas",
    "reply",
    "stopped",
)
INFO, METRICS = "info", "metrics"

HEARTBEAT_S = 0.25  # a replica's STATUS period
STALE_S = 15.0  # no message for this long: the replica is reported as not answering
