"""Every engine and sampling argument is checked where it enters: a bad value is a one-line error
naming the argument, its value and what it takes, raised before anything is loaded or queued.
Files the loader reads are named when they are broken; vLLM's habits (max_tokens, stop_reason,
numpy token ids) hold."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from compiled import LLM, SamplingParams
from compiled.demo import MOE_MODEL
from compiled.errors import ConfigError, RequestError
from compiled.runtime.config import EngineConfig
from compiled.runtime.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def llm():
    return LLM(MOE_MODEL, device="cpu", max_model_len=128)


# ---- engine settings ------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens=0: expected None or an int >= 1"),
    (dict(max_num_seqs=0), "max_num_seqs=0: expected an int >= 1"),
    (dict(max_num_seqs=True), "max_num_seqs=True: expected an int >= 1"),
    (dict(max_num_seqs="8"), "max_num_seqs='8': expected an int >= 1"),
    (dict(kv_cache_tokens=-5), "kv_cache_tokens=-5: expected None or an int >= 1"),
    (dict(kv_cache_tokens=0), "kv_cache_tokens=0: expected None or an int >= 1"),
    (dict(max_model_len=-5), "max_model_len=-5: expected None or an int >= 2"),
    (dict(max_model_len=0), "max_model_len=0: expected None or an int >= 2"),
    (dict(max_model_len=1.5), "max_model_len=1.5: expected None or an int >= 2"),
    (dict(mem_fraction=0.0), "mem_fraction=0.0: expected a float in (0, 1]"),
    (dict(mem_fraction=1.5), "mem_fraction=1.5: expected a float in (0, 1]"),
    (dict(mem_fraction=math.nan), "mem_fraction=nan: expected a float in (0, 1]"),
    (dict(mem_fraction="0.5"), "mem_fraction='0.5': expected a float in (0, 1]"),
    (dict(seed=1.5), "seed=1.5: expected an int"),
    (dict(enforce_eager="yes"), "enforce_eager='yes': expected True or False"),
    (dict(compile=1), "compile=1: expected None, True or False"),
    (dict(cuda_graph_buckets=[1, 0]), "cuda_graph_buckets=(1, 0): expected None or a list of ints >= 1"),
    (dict(piecewise_buckets=[-16]), "piecewise_buckets=(-16,): expected None or a list of ints >= 1"),
    (dict(passes="fuse_qkv"), "passes='fuse_qkv': expected None or a list of names"),
    (dict(max_piecewise_tokens=0), "max_piecewise_tokens=0: expected an int >= 1"),
    (dict(logits_chunk=0), "logits_chunk=0: expected an int >= 1"),
    (dict(dtype="int8"), "dtype='int8': expected None or one of float32, bfloat16, float16, fp32, bf16, fp16"),
    (dict(model=7), "model=7: expected None or a folder path"),
])
def test_bad_engine_setting_is_refused_before_loading(kwargs, message):
    with pytest.raises(ConfigError) as e:
        LLM(**kwargs)
    assert str(e.value) == message


def test_numpy_and_path_settings_are_taken_as_python_values(tmp_path):
    config = EngineConfig.from_kwargs(max_num_seqs=np.int64(4), max_model_len=np.int32(64), mem_fraction=np.float32(0.5),
                                      cuda_graph_buckets=[np.int64(1), 2], artifact=tmp_path)
    assert config.max_num_seqs == 4 and type(config.max_num_seqs) is int and type(config.max_model_len) is int
    assert config.cuda_graph_buckets == (1, 2) and all(type(b) is int for b in config.cuda_graph_buckets)
    assert config.mem_fraction == 0.5 and config.artifact == str(tmp_path)


def test_settings_built_directly_are_checked_by_resolve():
    with pytest.raises(ConfigError, match=r"^max_num_seqs=-1: expected an int >= 1$"):
        EngineConfig(max_num_seqs=-1).resolve(128)


def test_kv_cache_smaller_than_one_sequence_is_refused():
    with pytest.raises(ConfigError) as e:
        LLM(MOE_MODEL, device="cpu", kv_cache_tokens=64)
    assert str(e.value) == ("the KV cache holds 64 tokens (kv_cache_tokens=64), fewer than one max_model_len=512 "
                            "sequence needs; raise kv_cache_tokens to at least 512 or lower max_model_len to at most 64")


def test_kv_cache_sized_from_memory_too_small_is_refused():
    per_token = 2 * 4 * 2 * 64 * 4  # K and V, 4 layers, 2 KV heads of 64, float32: the demo model
    with pytest.raises(ConfigError) as e:
        LLM(MOE_MODEL, device="cpu", cpu_kv_cache_bytes=101 * per_token)
    assert str(e.value) == (f"the KV cache holds 100 tokens (cpu_kv_cache_bytes={101 * per_token}), fewer than one "
                            "max_model_len=512 sequence needs; raise cpu_kv_cache_bytes or kv_cache_tokens or lower "
                            "max_model_len to at most 100")


def test_kv_cache_that_holds_the_context_serves_it_whole():
    small = LLM(MOE_MODEL, device="cpu", kv_cache_tokens=64, max_model_len=64)
    out = small.generate([[5] * 10], SamplingParams(max_new_tokens=100, ignore_eos=True))[0]
    assert len(out.token_ids) == 54 and out.finish_reason == "length"


# ---- sampling parameters --------------------------------------------------------------------

def test_params_changed_after_construction_are_checked_at_generate(llm):
    params = SamplingParams(max_new_tokens=3)
    params.temperature = -1.0
    with pytest.raises(ValueError) as e:
        llm.generate(["copy hi:"], params)
    assert str(e.value) == "SamplingParams.temperature must be finite and >= 0 (0 means greedy), got -1.0"
    params = SamplingParams()
    params.max_new_tokens = 0
    with pytest.raises(ValueError) as e:
        llm.generate(["copy hi:"], params)
    assert str(e.value) == "SamplingParams.max_new_tokens must be >= 1, got 0"
    assert not llm.engine.has_work


def test_logit_bias_outside_the_vocabulary_is_refused(llm):
    vocab = llm.model_config.vocab_size
    with pytest.raises(RequestError) as e:
        llm.generate(["copy hi:", "copy ho:"], [SamplingParams(), SamplingParams(logit_bias={vocab: 1.0})])
    assert str(e.value) == (f"sampling params of prompt 1: logit_bias names token {vocab}, outside the vocabulary "
                            f"of {vocab}")
    assert not llm.engine.has_work


def test_sampling_params_of_another_type_are_refused(llm):
    with pytest.raises(TypeError) as e:
        llm.generate(["copy hi:"], {"temperature": 0.0})
    assert str(e.value) == "sampling_params: expected a SamplingParams or a list of them (one per prompt), got dict"
    assert not llm.engine.has_work


def test_max_tokens_is_vllms_name_for_max_new_tokens(llm):
    params = SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.0)
    assert params.max_new_tokens == 5 and params.max_tokens == 5
    assert len(llm.generate(["count 7:"], params)[0].token_ids) == 5
    params.max_tokens = 2
    assert params.max_new_tokens == 2
    assert SamplingParams(max_tokens=4, max_new_tokens=4).max_new_tokens == 4
    with pytest.raises(ValueError) as e:
        SamplingParams(max_tokens=5, max_new_tokens=6)
    assert str(e.value) == ("SamplingParams got max_tokens=5 and max_new_tokens=6: they are one setting "
                            "(max_tokens is vLLM's name), pass one of them")
    with pytest.raises(ValueError, match=r"^SamplingParams.max_new_tokens must be >= 1, got 0$"):
        SamplingParams(max_tokens=0)


# ---- prompts --------------------------------------------------------------------------------

def test_numpy_token_ids_are_ints(llm):
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    plain = llm.generate([[3, 5, 7]], params)[0]
    out = llm.generate([[np.int64(3), np.int32(5), 7]], params)[0]
    assert out.token_ids == plain.token_ids and all(type(t) is int for t in out.prompt_token_ids)
    out = llm.generate([np.array([3, 5, 7])], params)[0]
    assert out.token_ids == plain.token_ids


@pytest.mark.parametrize("prompt, message", [
    ([1, np.int64(500)], "prompt 0 has token id 500 outside the vocabulary [0, 288)"),
    ([1, -1], "prompt 0 has token id -1 outside the vocabulary [0, 288)"),
    ([1, True], "prompt 0 has token id True of type bool: expected ints in [0, 288)"),
    ([1, 2.0], "prompt 0 has token id 2.0 of type float: expected ints in [0, 288)"),
    ({"prompt": "x"}, "prompt 0 is a dict: expected a str or a list of token ids"),
    ([5] * 128, "prompt 0 has 128 tokens; the context holds 128 (max_model_len), so a prompt may have at most 127"),
])
def test_bad_prompt_is_one_line(llm, prompt, message):
    with pytest.raises(RequestError) as e:
        llm.generate([prompt])
    assert str(e.value) == message
    assert not llm.engine.has_work


# ---- stop_reason, as vLLM reports it --------------------------------------------------------

def test_stop_reason_names_what_the_user_asked_for(llm):
    greedy = dict(temperature=0.0, max_new_tokens=32)
    eos = llm.generate(["copy hi:"], SamplingParams(**greedy))[0]
    assert eos.finish_reason == "stop" and eos.stop_reason is None  # the model's EOS
    full = llm.generate(["count 7:"], SamplingParams(**greedy))[0]
    assert full.finish_reason == "length" and full.stop_reason is None
    by_id = llm.generate(["count 7:"], SamplingParams(**greedy, stop_token_ids=[full.token_ids[3]]))[0]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == full.token_ids[3]
    by_str = llm.generate(["count 7:"], SamplingParams(**greedy, stop=["10"]))[0]
    assert by_str.finish_reason == "stop" and by_str.stop_reason == "10"


# ---- files the loader reads -----------------------------------------------------------------

def _demo_copy(tmp_path, broken: str, content: str) -> str:
    """The demo model folder with one file replaced by `content` (the others linked)."""
    for name in os.listdir(MOE_MODEL):
        if name != broken:
            os.symlink(os.path.join(MOE_MODEL, name), tmp_path / name)
    (tmp_path / broken).write_text(content)
    return str(tmp_path)


@pytest.mark.parametrize("broken", ["tokenizer.json", "tokenizer_config.json", "generation_config.json"])
def test_malformed_json_names_the_file(tmp_path, broken):
    folder = _demo_copy(tmp_path, broken, "{oops")
    with pytest.raises(ConfigError) as e:
        LLM(folder, device="cpu")
    assert str(e.value) == (f"{folder}/{broken}: malformed JSON (Expecting property name enclosed in double quotes: "
                            "line 1 column 2 (char 1))")


@pytest.mark.parametrize("broken", ["tokenizer.json", "tokenizer_config.json"])
def test_tokenizer_file_that_is_not_an_object_is_named(tmp_path, broken):
    folder = _demo_copy(tmp_path, broken, "[1, 2]")
    with pytest.raises(ConfigError) as e:
        load_tokenizer(folder)
    assert str(e.value) == f"{folder}/{broken}: expected a JSON object, got list"


def test_bad_eos_in_generation_config_is_named(tmp_path):
    folder = _demo_copy(tmp_path, "generation_config.json", '{"eos_token_id": "0"}')
    with pytest.raises(ConfigError) as e:
        LLM(folder, device="cpu")
    assert str(e.value) == (f"{folder}/generation_config.json: field 'eos_token_id' must be an int or a list of "
                            "ints >= 0, got '0'")
