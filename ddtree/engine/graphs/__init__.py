"""CUDA graphs for a round's phases and the short prefill: the graph runner (`runner.py`), and each
family's static buffers (verify and commit `buffers.py`, `draft.py`, `extend.py`)."""
