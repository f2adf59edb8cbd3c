#!/usr/bin/env bash
# Loglikelihood evaluation against `engine serve` with lm-eval's local-completions model:
# a multiple-choice task on a local dataset, scored from the server's echoed prompt logprobs.
# lm-eval is large, so it lives in a virtual environment of its own (made on first use):
#
#   bash scripts/lm_eval_check.sh [VENV]      # default VENV: .venv-lm-eval
#
# It serves the built-in demo model on a free port, runs the task, and prints lm-eval's table.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-$here/.venv-lm-eval}
if [ ! -x "$venv/bin/lm_eval" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q -c "$here/constraints.txt" "lm-eval[api]==0.4.13" transformers
fi
work=$(mktemp -d)
trap 'kill "${server:-0}" 2>/dev/null || true; rm -rf "$work"' EXIT
cat > "$work/data.jsonl" <<'DATA'
{"question": "The opposite of hot is", "choices": [" cold", " green", " seven"], "answer": 0}
{"question": "Return the length of an object with", "choices": [" len", " banana", " sky"], "answer": 0}
{"question": "A list can be sorted with the function", "choices": [" river", " sorted", " moon"], "answer": 1}
{"question": "To read a file, first", "choices": [" open it", " paint it", " eat it"], "answer": 0}
DATA
cat > "$work/engine_local_ll.yaml" <<YAML
task: engine_local_ll
dataset_path: json
dataset_kwargs:
  data_files:
    test: $work/data.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
YAML
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
ENGINE_API_KEY= engine --log-level warning serve --port "$port" &
server=$!
for _ in $(seq 240); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
demo=$(python3 -c 'from engine.builtin_models import DEMO_MODEL_DIR; print(DEMO_MODEL_DIR)')
HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 "$venv/bin/lm_eval" --model local-completions \
  --model_args "model=demo,base_url=http://127.0.0.1:$port/v1/completions,tokenizer_backend=huggingface,tokenizer=$demo,num_concurrent=1,max_retries=1" \
  --tasks engine_local_ll --include_path "$work" --output_path "$work/out"
