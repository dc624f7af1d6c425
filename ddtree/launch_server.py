"""`python -m ddtree.launch_server --model-path ... --speculative-algorithm DDTREE ...` (SGLang's entry point)."""

import sys

from ddtree.server.launch import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
