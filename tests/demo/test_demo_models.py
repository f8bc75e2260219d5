"""The shipped demo models (compiled/demo) load with plain HF transformers / PEFT
and greedily give the documented task answers; CPU only, a few seconds."""

from __future__ import annotations

import json
import os
import string
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from compiled import demo  # noqa: E402
from compiled.demo import build  # noqa: E402

MODELS = {
    "moe": (demo.MOE_MODEL, demo.MOE_ADAPTERS, "Qwen3MoeForCausalLM"),
    "dense": (demo.DENSE_MODEL, demo.DENSE_ADAPTERS, "Qwen3ForCausalLM"),
}
COUNT_TOKENS = 48  # greedy tokens checked for the never-ending count answers
COPY_PROMPTS = [p for p in demo.EXAMPLE_PROMPTS if "copy " in p.lower()]
COUNT_PROMPTS = [p for p in demo.EXAMPLE_PROMPTS if "count " in p]
ASCII = string.printable + "  double  space, trailing space "
# GPTSw3Tokenizer (the dense model's sentencepiece-backed class) drops \r \v \f before encoding
ASCII_SP = ASCII.translate({ord(c): None for c in "\r\x0b\x0c"})


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def _load(which):
    path, _, cls_name = MODELS[which]
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = getattr(transformers, cls_name).from_pretrained(path, dtype=torch.float32)
    return tok, model.eval()


@pytest.fixture(scope="module", params=sorted(MODELS))
def loaded(request):
    tok, model = _load(request.param)
    return request.param, tok, model


@torch.no_grad()
def _greedy(model, tok, prompts, max_new_tokens):
    """Batched (left-padded) HF greedy generate -> new ids per prompt, cut after the first EOS."""
    enc = [tok.encode(p, add_special_tokens=False) for p in prompts]
    L = max(map(len, enc))
    ids = torch.full((len(enc), L), tok.pad_token_id)
    mask = torch.zeros((len(enc), L), dtype=torch.long)
    for i, e in enumerate(enc):
        ids[i, L - len(e):] = torch.tensor(e)
        mask[i, L - len(e):] = 1
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False)
    res = []
    for row in out[:, L:].tolist():
        if tok.eos_token_id in row:
            row = row[: row.index(tok.eos_token_id) + 1]
        res.append(row)
    return res


def _expected(tok, prompt, behaviour="base"):
    text, ends = build.solve(prompt, behaviour)
    ids = tok.encode(text, add_special_tokens=False)
    return ids + [tok.eos_token_id] if ends else ids[:COUNT_TOKENS]


def _check(tok, model, prompts, behaviour):
    wants = [_expected(tok, p, behaviour) for p in prompts]
    gots = _greedy(model, tok, prompts, max(map(len, wants)))
    for p, want, got in zip(prompts, wants, gots):
        assert got[: len(want)] == want, (behaviour, p, tok.decode(got), tok.decode(want))


# ---------------------------------------------------------------- files, configs


def test_files_and_size():
    total = 0
    for root, _, files in os.walk(demo.DEMO_DIR):
        if "__pycache__" in root:
            continue
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    assert total < 8 * 2**20, total
    moe = set(os.listdir(demo.MOE_MODEL))
    dense = set(os.listdir(demo.DENSE_MODEL))
    common = {"config.json", "generation_config.json", "model.safetensors", "tokenizer_config.json"}
    assert common | {"tokenizer.json"} <= moe
    assert common | {"tokenizer.model"} <= dense and "tokenizer.json" not in dense
    for adapters in (demo.MOE_ADAPTERS, demo.DENSE_ADAPTERS):
        assert len(adapters) >= 2
        for path in adapters.values():
            assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(path))


def test_configs():
    moe = transformers.AutoConfig.from_pretrained(demo.MOE_MODEL)
    assert moe.model_type == "qwen3_moe" and not moe.tie_word_embeddings
    is_moe = [
        i not in moe.mlp_only_layers and (i + 1) % moe.decoder_sparse_step == 0
        for i in range(moe.num_hidden_layers)
    ]
    assert any(is_moe) and not all(is_moe)  # dense and MoE layers mixed
    assert moe.num_experts == 8 and moe.num_experts_per_tok == 2 and moe.norm_topk_prob
    dense = transformers.AutoConfig.from_pretrained(demo.DENSE_MODEL)
    assert dense.model_type == "qwen3" and dense.tie_word_embeddings
    for cfg, path in ((moe, demo.MOE_MODEL), (dense, demo.DENSE_MODEL)):
        assert cfg.num_attention_heads > cfg.num_key_value_heads  # GQA
        gen = json.loads(Path(path, "generation_config.json").read_text())
        assert gen["eos_token_id"] == cfg.eos_token_id is not None
        assert cfg.pad_token_id is not None
    # head_dim independent of hidden_size / heads in the dense model
    assert dense.head_dim * dense.num_attention_heads != dense.hidden_size
    # the shipped checkpoint keeps the per-expert layout
    from safetensors import safe_open

    with safe_open(os.path.join(demo.MOE_MODEL, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in keys
    assert "model.layers.0.mlp.gate_proj.weight" in keys


# ---------------------------------------------------------------- tokenizers


@pytest.mark.parametrize("which", sorted(MODELS))
def test_tokenizer(which):
    path = MODELS[which][0]
    tok = transformers.AutoTokenizer.from_pretrained(path)
    cfg = transformers.AutoConfig.from_pretrained(path)
    assert tok.eos_token_id == cfg.eos_token_id
    assert tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id
    text = ASCII if which == "moe" else ASCII_SP
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    if which == "dense":  # the sentencepiece model itself (byte fallback) round-trips everything
        import sentencepiece

        sp = sentencepiece.SentencePieceProcessor(model_file=os.path.join(path, "tokenizer.model"))
        assert sp.decode(sp.encode(ASCII)) == ASCII
        assert sp.encode(ASCII_SP) == ids
    assert tok.decode(tok.encode("copy abd:", add_special_tokens=False) + [tok.eos_token_id], skip_special_tokens=True) == "copy abd:"
    assert max(ids) < cfg.vocab_size
    chat = tok.apply_chat_template([{"role": "user", "content": "count 5:"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|user|>count 5:<|assistant|>"
    ids = tok.apply_chat_template([{"role": "user", "content": "count 5:"}], add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids == tok.encode(chat, add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids[0]) == "<|user|>"


# ---------------------------------------------------------------- greedy answers


def test_base_answers(loaded):
    _, tok, model = loaded
    _check(tok, model, demo.EXAMPLE_PROMPTS, "base")


def test_adapters(loaded):
    peft = pytest.importorskip("peft")
    which, tok, _ = loaded
    for name, path in MODELS[which][1].items():
        cfg = json.loads(Path(path, "adapter_config.json").read_text())
        targets = set(cfg.get("target_modules") or []) | set(cfg.get("target_parameters") or [])
        if name == "first":
            assert targets == {"q_proj", "k_proj", "v_proj", "o_proj"}
        else:
            assert any("gate" in t for t in targets) and any("down_proj" in t for t in targets)
            assert not targets & {"q_proj", "k_proj", "v_proj", "o_proj"}
        _, base = _load(which)
        model = peft.PeftModel.from_pretrained(base, path).eval()
        _check(tok, model, COPY_PROMPTS, name)  # the behaviour changes ...
        _check(tok, model, COUNT_PROMPTS, "base")  # ... and counting still works
        assert build.solve(COPY_PROMPTS[-1], name) != build.solve(COPY_PROMPTS[-1], "base")


def test_batched_equals_alone(loaded):
    """64 greedy tokens per example prompt: left-padded batch == one prompt at a time."""
    _, tok, model = loaded
    batched = _greedy(model, tok, demo.EXAMPLE_PROMPTS, 64)
    for prompt, got in zip(demo.EXAMPLE_PROMPTS, batched):
        assert _greedy(model, tok, [prompt], 64)[0] == got, prompt
