"""Requests and scheduling: `Req` and its parameters, the scheduler (admission, chunked prefill,
preemption), and the step statistics and decode log."""
