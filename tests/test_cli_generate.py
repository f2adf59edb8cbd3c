"""`engine generate`: the README's first command, on a tiny checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from engine.cli import main


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from engine.testing.checkpoints import make_tiny_checkpoint

    path = tmp_path_factory.mktemp("llama")
    return path, make_tiny_checkpoint("LlamaForCausalLM", path, with_tokenizer=True)


def test_generate_json_matches_hf_greedy(checkpoint, capsys):
    path, hf_model = checkpoint
    args = [
        "generate",
        str(path),
        "--plugins",
        "cpu,llama",
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "0.05",
        "--prompt-ids",
        "5,6,7,8,9",
        "--prompt",
        "The quick brown fox",
        "--max-tokens",
        "6",
        "--ignore-eos",
        "--json",
    ]
    assert main(args) == 0
    outputs = json.loads(capsys.readouterr().out)
    # text prompts come first, then token-id prompts
    assert [o["prompt"] for o in outputs] == ["The quick brown fox", None]
    for output in outputs:
        prompt_ids = output["prompt_token_ids"]
        with torch.no_grad():
            expected = hf_model.generate(
                torch.tensor([prompt_ids]), max_new_tokens=6, do_sample=False, min_new_tokens=6
            )[0, len(prompt_ids) :].tolist()
        assert output["token_ids"] == expected
        assert output["finish_reason"] == "length"
    assert outputs[1]["prompt_token_ids"] == [5, 6, 7, 8, 9]


def test_generate_text_output_and_bad_input(checkpoint, capsys):
    path, _ = checkpoint
    base = ["generate", str(path), "--plugins", "cpu,llama", "--dtype", "float32", "--kv-cache-memory", "0.05"]
    assert main(base + ["--prompt", "Hello", "--max-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "prompt: 'Hello'" in out and "output ids:" in out and "tokens/s" in out
    # a bad token id is one clear line on stderr and exit status 1, not a traceback
    assert main(base + ["--prompt-ids", "1,2,99999"]) == 1
    err = capsys.readouterr().err
    assert "engine generate: error: Prompt token ids must be in [0, 320); got [99999]." in err
    assert "Traceback" not in err
    assert main(["generate", str(path / "missing"), "--plugins", "cpu,llama"]) == 1
    assert "not a checkpoint directory" in capsys.readouterr().err
