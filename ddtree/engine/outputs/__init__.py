"""From tokens to text: the emitter (stop strings and ids, finishes, deferred detokenisation) and the
incremental detokenizer."""
