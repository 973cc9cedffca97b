"""bench.budget's arguments (its runs on the real models: tests/test_gemma3.py)."""

import pytest


def test_every_token_kept_needs_a_model_with_sliding_layers(capsys):
    from bench import budget

    with pytest.raises(SystemExit) as e:
        budget.main(["--model", "models/kjv-llama-mha", "--specs", "full", "--streams", "1", "--prompt-tokens",
                     "16", "--new-tokens", "1", "--no-scaling", "--no-quality", "--every-token-kept"])
    assert e.value.code == 2
    assert "no sliding-window layers" in capsys.readouterr().err
