"""config.json as HF writes it: the architecture comes from "architectures", else from
"model_type" (what a bare `Qwen3MoeConfig(...).save_pretrained` writes), as transformers resolves
it; what is neither supported nor resolvable is a one-line error naming the file."""

from __future__ import annotations

import json

import pytest

from compiled.errors import ConfigError
from compiled.graphs.config import ModelConfig
from tests.conftest import DENSE, MOE


@pytest.mark.parametrize("moe, architecture", [(True, "Qwen3MoeForCausalLM"), (False, "Qwen3ForCausalLM")])
def test_architecture_from_model_type(tmp_path, moe, architecture):
    from transformers import Qwen3Config, Qwen3MoeConfig
    (Qwen3MoeConfig(**MOE) if moe else Qwen3Config(**DENSE)).save_pretrained(str(tmp_path))
    assert "architectures" not in json.loads((tmp_path / "config.json").read_text())
    cfg = ModelConfig.from_pretrained(str(tmp_path))
    assert cfg.architecture == architecture and cfg.is_moe == moe


def _write(tmp_path, **raw) -> str:
    file = tmp_path / "config.json"
    file.write_text(json.dumps(dict(DENSE, **raw)))
    return str(file)


@pytest.mark.parametrize("raw, message", [
    (dict(model_type="llama"), "no 'architectures' and unsupported model_type 'llama' (supported: qwen3, qwen3_moe)"),
    (dict(), "neither 'architectures' nor 'model_type' is set (supported: Qwen3ForCausalLM, Qwen3MoeForCausalLM)"),
    (dict(architectures=["LlamaForCausalLM"], model_type="qwen3"),
     "unsupported architecture 'LlamaForCausalLM' (supported: Qwen3ForCausalLM, Qwen3MoeForCausalLM)"),
    (dict(model_type="qwen3", eos_token_id="2"), "field 'eos_token_id' must be an int or a list of ints >= 0, got '2'"),
    (dict(model_type="qwen3", eos_token_id=[1, True]),
     "field 'eos_token_id' must be an int or a list of ints >= 0, got [1, True]"),
])
def test_unresolvable_config_names_the_file(tmp_path, raw, message):
    file = _write(tmp_path, **raw)
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_pretrained(file)
    assert str(e.value) == f"{file}: {message}"
