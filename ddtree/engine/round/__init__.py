"""One decoding round: its data (`data.py`: Round, Draft, Verify), the decoder that runs it (plan ->
draft -> verify -> accept -> commit -> emit), sampling at every node, log-probs, grammar rows."""
