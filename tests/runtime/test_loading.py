"""Checkpoint loading: shards, on-disk dtypes, dummy weights, and every broken-checkpoint error."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from compiled import LLM, SamplingParams
from compiled.errors import CheckpointError, ConfigError
from compiled.graphs.config import ModelConfig
from compiled.runtime.build import build_model
from compiled.runtime.config import EngineConfig
from tests.conftest import hf_model, make_checkpoint
from tests.graphs.test_hf_parity import assert_prompt_logprobs_match, random_prompts


def _hf_logprobs(path: str, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf_model(path)(torch.tensor([prompt])).logits[0].float(), -1)


@pytest.mark.parametrize("disk_dtype", [torch.bfloat16, torch.float16])
def test_sharded_low_precision_checkpoint_loads_as_fp32(tmp_path, disk_dtype):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from tests.conftest import MOE
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**MOE)).to(disk_dtype).save_pretrained(tmp_path, max_shard_size="100KB")
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    llm = LLM(str(tmp_path), device="cpu", dtype="float32")
    assert llm.model.lm_head.weight.dtype == torch.float32
    prompt = random_prompts(MOE["vocab_size"], [20])[0]
    out = llm.generate([prompt], SamplingParams(max_new_tokens=1, prompt_logprobs=-1))[0]
    assert_prompt_logprobs_match(out, _hf_logprobs(str(tmp_path), prompt))


def test_dummy_load_reads_no_files(tmp_path):
    make_checkpoint(tmp_path, moe=True)
    os.remove(tmp_path / "model.safetensors")
    cfg = ModelConfig.from_pretrained(str(tmp_path))
    config = EngineConfig(device="cpu", dtype="float32", load_format="dummy").resolve(cfg.max_position_embeddings)
    model, _ = build_model(cfg, str(tmp_path), config)
    w = model.get_submodule("model.layers.0.mlp").w13
    assert w.shape == (cfg.num_experts, 2 * cfg.moe_intermediate_size, cfg.hidden_size) and w.std() > 0.01
    llm = LLM(str(tmp_path), device="cpu", load_format="dummy")
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, ignore_eos=True))[0].token_ids) == 4


# ---- broken checkpoints: each error is one line naming the culprit ---------------------------

def _one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def test_missing_config(tmp_path):
    with pytest.raises(ConfigError) as e:
        LLM(str(tmp_path), device="cpu")
    assert "config.json" in _one_line(e)


def test_malformed_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError) as e:
        LLM(str(tmp_path), device="cpu")
    assert "config.json" in _one_line(e) and "malformed" in str(e.value)


def test_unsupported_architecture(tmp_path):
    make_checkpoint(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as e:
        LLM(str(tmp_path), device="cpu")
    assert "LlamaForCausalLM" in _one_line(e)


def test_config_missing_field(tmp_path):
    make_checkpoint(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as e:
        LLM(str(tmp_path), device="cpu")
    assert "hidden_size" in _one_line(e)


def _sharded(tmp_path) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from tests.conftest import DENSE
    Qwen3ForCausalLM(Qwen3Config(**DENSE)).save_pretrained(tmp_path, max_shard_size="50KB")
    return str(tmp_path)


def test_missing_shard(tmp_path):
    path = _sharded(tmp_path)
    victim = sorted(tmp_path.glob("*.safetensors"))[1]
    os.remove(victim)
    with pytest.raises(CheckpointError) as e:
        LLM(path, device="cpu")
    assert victim.name in _one_line(e) and "missing" in str(e.value)


def test_truncated_shard(tmp_path):
    path = _sharded(tmp_path)
    victim = sorted(tmp_path.glob("*.safetensors"))[0]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as e:
        LLM(path, device="cpu")
    assert victim.name in _one_line(e)


def _rewrite(tmp_path, edit) -> None:
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_wrong_tensor_shape(tmp_path):
    make_checkpoint(tmp_path)
    name = "model.layers.1.self_attn.k_proj.weight"
    _rewrite(tmp_path, lambda t: t.__setitem__(name, t[name][:-1].clone()))
    with pytest.raises(CheckpointError) as e:
        LLM(str(tmp_path), device="cpu")
    assert name in _one_line(e) and "shape" in str(e.value)


def test_missing_tensor(tmp_path):
    make_checkpoint(tmp_path, moe=True)
    name = "model.layers.0.mlp.experts.5.down_proj.weight"
    _rewrite(tmp_path, lambda t: t.pop(name))
    with pytest.raises(CheckpointError) as e:
        LLM(str(tmp_path), device="cpu")
    assert name in _one_line(e)


def test_unexpected_tensor(tmp_path):
    make_checkpoint(tmp_path)
    _rewrite(tmp_path, lambda t: t.__setitem__("model.layers.9.extra.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError) as e:
        LLM(str(tmp_path), device="cpu")
    assert "model.layers.9.extra.weight" in _one_line(e)
