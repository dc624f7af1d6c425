#!/usr/bin/env bash
# lm-eval (EleutherAI's lm-evaluation-harness) against `ddtree serve` on the embedded pair, as users
# evaluate a served model: `loglikelihood` on a small local multiple-choice task (lm-eval sends each
# batch as a list of token-id prompts with echo: true, logprobs: 1, max_tokens: 1 and reads the
# prompt's log-probs) and `generate_until` with --batch_size 2 (a list of two prompts per call).
# Not in CI (lm-eval is heavy); issue 55. Run from the repository root:
#   python3 -m venv /tmp/lmeval && /tmp/lmeval/bin/pip install "lm-eval[api]" transformers  # once
#   bash scripts/clients/lm_eval.sh [PORT]
# LMEVAL=path/to/lm_eval picks another install; SERVER_ARGS adds `ddtree serve` flags, LMEVAL_ARGS
# lm-eval flags (`--log_samples --output_path DIR` keeps every request's scores).
set -euo pipefail
PORT=${1:-30111}
LMEVAL=${LMEVAL:-/tmp/lmeval/bin/lm_eval}
WORK=$(mktemp -d)
TOKENIZER=$(python3 -c "from ddtree.assets import default_model_paths; print(default_model_paths()[0])")

# ten items in the embedded target's domain (Python): the right continuation and three wrong ones
python3 - "$WORK" <<'EOF'
import json, sys
items = [
    ("def add(a, b):\n    return", [" a + b", " a - b", " b / a", " None + 1"]),
    ("for i in range(10):\n    print(", ["i)", "]", "i]", "10:"]),
    ("import os\npath = os.path.join(", ["root, name)", "root name", ")root(", "]"]),
    ("class Stack:\n    def __init__(self):\n        self.items =", [" []", " ]", " [[", " )"]),
    ("if __name__ ==", [" \"__main__\":", " main", " 3:", " ]"]),
    ("with open(path) as f:\n    data =", [" f.read()", " f.", " ]", " path path"]),
    ("try:\n    x = int(s)\nexcept", [" ValueError:", " ValueError", " ]", " (:"]),
    ("def __repr__(self):\n    return", [" f\"{self.name}\"", " ]]", " )", " return"]),
    ("result = [x for x in items if", [" x]", " ]", " x)", " for"]),
    ("raise TypeError(", ["\"expected a string\")", "]", "))", "raise"]),
]
with open(f"{sys.argv[1]}/mc.jsonl", "w") as f:
    for q, choices in items:
        f.write(json.dumps({"question": q, "choices": choices, "answer": 0}) + "\n")
common = f"""dataset_path: json
dataset_kwargs:
  data_files:
    test: {sys.argv[1]}/mc.jsonl
test_split: test
doc_to_text: "{{{{question}}}}"
"""
with open(f"{sys.argv[1]}/ddtree_mc.yaml", "w") as f:
    f.write("task: ddtree_mc\noutput_type: multiple_choice\n" + common + """doc_to_choice: "{{choices}}"
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
  - metric: acc_norm
""")
with open(f"{sys.argv[1]}/ddtree_gen.yaml", "w") as f:
    f.write("task: ddtree_gen\noutput_type: generate_until\n" + common + """doc_to_target: "{{choices[0]}}"
target_delimiter: ""
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 16
  temperature: 0
metric_list:
  - metric: exact_match
""")
EOF

python3 -m ddtree.launch_server --device cpu --dtype float32 --speculative-algorithm DDTREE \
  --port "$PORT" --log-level warning ${SERVER_ARGS:-} &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null || true; rm -rf "$WORK"' EXIT
for _ in $(seq 120); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  sleep 1
done

ARGS="base_url=http://127.0.0.1:$PORT/v1/completions,model=ddtree,tokenizer=$TOKENIZER"
ARGS="$ARGS,tokenizer_backend=huggingface,num_concurrent=1,max_retries=1"
set -x
"$LMEVAL" run --model local-completions --model_args "$ARGS" --include_path "$WORK" \
  --tasks ddtree_mc --batch_size 2 ${LMEVAL_ARGS:-}
"$LMEVAL" run --model local-completions --model_args "$ARGS" --include_path "$WORK" \
  --tasks ddtree_gen --batch_size 2 ${LMEVAL_ARGS:-}
