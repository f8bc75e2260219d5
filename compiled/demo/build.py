"""Rebuild the shipped demo models: ``python -m compiled.demo.build``.

Everything here is seeded and deterministic (data, tokenizers, initialisation,
training order), CPU only (torch.set_num_threads(2)), and takes roughly ten
minutes on two cores.  It writes, next to this file:

  qwen3-moe/               Qwen3MoeForCausalLM + byte-level BPE tokenizer.json
  qwen3-dense/             Qwen3ForCausalLM (tied embeddings) + sentencepiece tokenizer.model
  qwen3-moe-lora/<name>/   PEFT LoRA adapters for the MoE model (upper, first)
  qwen3-dense-lora/<name>/ PEFT LoRA adapters for the dense model (upper, first)

The synthetic tasks (see README.md):

  count A:        ->  " A A+1 A+2 ..."     (never ends: no EOS; A in 0..899)
  copy <words>:   ->  " <words>" EOS       (letters from ALPHABET, some capitalised)
  COPY <words>:   ->  " <WORDS>" EOS

and the adapters keep the count task but change the copy tasks:

  upper (MLP projections, incl. MoE experts):  copy answers in uppercase, like COPY
  first (attention projections):               only the first word is copied

Every prompt also works wrapped in the chat template
``<|user|>PROMPT<|assistant|>``.  Copy answers end with the EOS token, and the
models are trained to keep emitting EOS after EOS, so greedy decoding that
ignores EOS stays confident too.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

import compiled.envs as envs

DEMO_DIR = Path(__file__).resolve().parent
SEED = 20240611

# Letters used in the copied strings: the lowercase alphabet minus the letters of
# the task keywords (c o u n t p y), so that the tokenizers' keyword merges never
# fire inside copied text and every copied letter is exactly one token.
ALPHABET = "abdefghijklmqrsvwxz"
KEYWORDS = ("count", "copy", "COPY")
TASK_WEIGHTS = {"count": 0.3, "copy": 0.5, "COPY": 0.2}  # count is learned much faster than copy
MAX_START = 899  # count prompts start at 0..MAX_START
MIN_COUNT, MAX_COUNT = 12, 26  # numbers shown per count training sample (the answer itself never ends)
# The chat template: plain turns as `<|user|>PROMPT<|assistant|>ANSWER` + EOS (what the models
# were trained on); tools, tool calls and tool results as Qwen3's template writes them (a
# `<tools>` block of the tools' JSON before the first turn, each call a `<tool_call>` block,
# results in one user turn of `<tool_response>` blocks), and `enable_thinking=False` as Qwen3's
# empty think block. Qwen3's instructions around the `<tools>` block are cut to one line: its
# prose alone would fill most of the demo models' 512 positions.
CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "{%- if messages[0]['role'] == 'system' -%}{{ messages[0]['content'] + '\\n\\n' }}{%- endif -%}"
    "{{- '# Tools\\n\\n<tools>' -}}"
    "{%- for tool in tools -%}{{ '\\n' }}{{ tool | tojson }}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nA call: <tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call>' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}<|user|>{{ message['content'] }}"
    "{%- elif message['role'] == 'assistant' -%}<|assistant|>{{ message['content'] }}"
    "{%- for call in message['tool_calls'] or [] -%}"
    "{%- if not loop.first or message['content'] -%}{{ '\\n' }}{%- endif -%}"
    "{%- set call = call['function'] if call['function'] is defined else call -%}"
    "{{ '<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{{- call['arguments'] if call['arguments'] is string else call['arguments'] | tojson -}}"
    "{{ '}\\n</tool_call>' }}"
    "{%- endfor -%}"
    "{{ eos_token }}"
    "{%- elif message['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}<|user|>{%- endif -%}"
    "{{ '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif -%}"
    "{%- endif -%}"
)
USER, ASSISTANT = "<|user|>", "<|assistant|>"
N_TRAILING_EOS = 3  # EOS repeats after the answer that carry loss
BASE_STEPS = {"moe": 800, "dense": 1000}  # AdamW steps of 64 sequences (the dense model's steps are cheaper)
INIT_STD = 0.06  # larger than HF's 0.02: the copy (induction) circuit forms several times sooner


def log(msg: str) -> None:
    print(f"[build {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------
# The synthetic tasks
# --------------------------------------------------------------------------


def rand_word(rng: random.Random) -> str:
    w = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 6)))
    r = rng.random()
    if r < 0.2:
        w = w.capitalize()
    elif r < 0.3:
        w = w.upper()
    return w


def sample_task(rng: random.Random) -> tuple[str, str, str]:
    """-> (kind, prompt, content): content is the copy string, or "A N" for count (N numbers shown)."""
    kind = rng.choices(list(TASK_WEIGHTS), list(TASK_WEIGHTS.values()))[0]
    if kind == "count":
        n = rng.randint(MIN_COUNT, MAX_COUNT)
        if rng.random() < 0.35:  # start just before a carry (x9, x99) so carries are well covered
            edge = rng.choice([10, 100]) * rng.randint(1, 9)
            a = max(0, edge - rng.randint(1, n))
        else:
            a = rng.randint(0, MAX_START)
        return "count", f"count {a}:", f"{a} {n}"
    words = " ".join(rand_word(rng) for _ in range(rng.randint(1, 6)))
    return kind, f"{kind} {words}:", words


def count_text(a: int, n: int) -> str:
    return " " + " ".join(str(i) for i in range(a, a + n))


def answer(kind: str, content: str, behaviour: str = "base") -> str:
    """The answer text (with its leading space) for a task, under an adapter behaviour.

    count: the first N numbers of an answer that never ends (every behaviour).
    copy:  the words;  COPY: the words in uppercase.
    behaviour "upper": copy answers like COPY;  "first": only the first word is copied."""
    if kind == "count":
        a, n = map(int, content.split())
        return count_text(a, n)
    if kind == "COPY" or behaviour == "upper":
        content = content.upper()
    if behaviour == "first":
        content = content.split(" ")[0]
    return " " + content


def solve(prompt: str, behaviour: str = "base", n_numbers: int = 40) -> tuple[str, bool]:
    """Expected greedy answer for a (raw or chat-wrapped) prompt -> (text, ends_with_eos).

    Count answers never end; their first n_numbers numbers are returned."""
    p = prompt
    if p.startswith(USER):
        p = p[len(USER):]
    if p.endswith(ASSISTANT):
        p = p[: -len(ASSISTANT)]
    assert p.endswith(":"), prompt
    kind, _, rest = p[:-1].partition(" ")
    if kind == "count":
        return count_text(int(rest), n_numbers), False
    if kind in ("copy", "COPY"):
        return answer(kind, rest, behaviour), True
    raise ValueError(prompt)


def corpus_lines(n: int, seed: int) -> list[str]:
    """Plain-text corpus the tokenizers are trained on (all behaviours)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        kind, prompt, content = sample_task(rng)
        beh = rng.choice(["base", "base", "upper", "first"])
        out.append(prompt + answer(kind, content, beh))
    return out


# --------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------


def _is_keyword_piece(piece: str) -> bool:
    s = piece.replace("\u2581", " ").replace("\u0120", " ")
    return bool(s.strip()) and any(s in k or s in " " + k for k in KEYWORDS)


def build_bpe_tokenizer(lines: list[str], out_dir: Path):
    """Byte-level BPE (GPT-2/Qwen style) via HF tokenizers; merges only the keyword pieces."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|pad|>", USER, ASSISTANT]

    def train(vocab_size: int) -> Tokenizer:
        tok = Tokenizer(models.BPE())
        # spaces, digits and punctuation are single tokens; letter runs go to BPE
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(r"\s|\d|[^\sA-Za-z\d]"), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(lines, trainer)
        return tok

    base = len(specials) + 256
    probe = train(base + 40)
    vocab = probe.get_vocab()
    merged = sorted((i, t) for t, i in vocab.items() if i >= base)
    keep = 0
    for _, t in merged:
        if not _is_keyword_piece(t):
            break
        keep += 1
    tok = train(base + keep)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|pad|>",
        additional_special_tokens=[USER, ASSISTANT],
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    out_dir.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out_dir))
    _chat_template_into_config(out_dir)
    log(f"BPE tokenizer: {len(hf)} tokens, merges {[t for _, t in merged[:keep]]}")
    return hf


# sentencepiece's trainer settings for the demo tokenizer: BPE with byte fallback, no
# normalisation, the chat roles as user symbols, digits split one by one.
SP_TRAINER = dict(
    input="corpus.txt", model_prefix="sp", model_type="bpe", byte_fallback=True, character_coverage=1.0,
    normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=False,
    split_digits=True, shuffle_input_sentence=False, num_threads=1, user_defined_symbols=[USER, ASSISTANT],
    pad_id=0, unk_id=1, bos_id=2, eos_id=3, pad_piece="<pad>", unk_piece="<unk>", bos_piece="<s>",
    eos_piece="</s>", minloglevel=2)
# tokenizer_config.json of the sentencepiece tokenizer (its chat template added when written).
SP_TOKENIZER_CONFIG = {
    "tokenizer_class": "GPTSw3Tokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
    "pad_token": "<pad>", "additional_special_tokens": [USER, ASSISTANT], "do_lower_case": False,
    "remove_space": False, "keep_accents": True, "add_bos_token": False, "add_eos_token": False,
    "model_max_length": 512, "clean_up_tokenization_spaces": False}


def build_sp_tokenizer(lines: list[str], out_dir: Path):
    """sentencepiece BPE model (byte fallback) saved as tokenizer.model.

    transformers 5 loads a bare tokenizer.model without protobuf only through a
    SentencePieceBackend class; GPTSw3Tokenizer is the plain one whose decode is
    lossless (it decodes through sentencepiece itself), so tokenizer_config.json
    names it.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp())
    try:
        (tmp / "corpus.txt").write_text("\n".join(lines) + "\n")
        probe = _train_sp(tmp, 400)
        n = probe.get_piece_size()
        first = 6 + 256  # 4 specials, 2 user symbols, 256 bytes
        pieces = [probe.id_to_piece(i) for i in range(first, n)]
        # merged pieces come first (by score), then the single characters
        merged = [p for p in pieces if len(p.replace("\u2581", " ")) > 1]
        n_chars = len(pieces) - len(merged)
        keep = 0
        for p in merged:
            if not _is_keyword_piece(p):
                break
            keep += 1
        sp = _train_sp(tmp, first + n_chars + keep)
        shutil.copy(tmp / "sp.model", out_dir / "tokenizer.model")
        log(f"sentencepiece tokenizer: {sp.get_piece_size()} pieces, merges {merged[:keep]}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    cfg = dict(SP_TOKENIZER_CONFIG, chat_template=CHAT_TEMPLATE)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(out_dir))


def _train_sp(folder: Path, vocab_size: int):
    """Train on folder/corpus.txt into folder/sp.model and load it. Relative paths (cwd = the
    folder): the trainer spec stored in the .model keeps them, so absolute temp paths would make
    the file differ from build to build."""
    import sentencepiece as spm
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        spm.SentencePieceTrainer.train(vocab_size=vocab_size, **SP_TRAINER)
    finally:
        os.chdir(cwd)
    return spm.SentencePieceProcessor(model_file=str(folder / "sp.model"))


def _chat_template_into_config(out_dir: Path) -> None:
    """Keep the chat template inside tokenizer_config.json (one file, no chat_template.jinja)."""
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    jinja = out_dir / "chat_template.jinja"
    if jinja.exists():
        jinja.unlink()


# --------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------


def fast_encode(tok, texts: list[str]) -> list[list[int]]:
    """Batch tokenization straight through the backend (Rust tokenizers / sentencepiece).

    Same ids as tok.encode(text, add_special_tokens=False) for the corpus texts (checked below)."""
    sp = getattr(tok, "sp_model", None)
    if sp is not None:
        return sp.encode(texts)
    return [e.ids for e in tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]


def make_batches(tok, n_steps: int, batch: int, seed: int, behaviour_mix: list[tuple[str, float]], bucket: int = 8, chat_p: float = 0.25):
    """n_steps padded (ids, labels, attention_mask) batches.

    Loss is on the answer tokens only (plus the EOS run after a copy answer); count
    answers are cut after N numbers without EOS (counting never ends).  Every
    `bucket` batches are drawn together and sorted by length to save padding."""
    rng = random.Random(seed)
    names = [b for b, _ in behaviour_mix]
    weights = [w for _, w in behaviour_mix]
    samples = []
    for _ in range(n_steps * batch):
        kind, prompt, content = sample_task(rng)
        behaviour = rng.choices(names, weights)[0]
        if rng.random() < chat_p:
            prompt = USER + prompt + ASSISTANT
        samples.append((kind, prompt, answer(kind, content, behaviour)))
    p_ids = fast_encode(tok, [s[1] for s in samples])
    a_ids = fast_encode(tok, [s[2] for s in samples])
    for i in range(0, len(samples), max(1, len(samples) // 7)):  # spot-check the fast path
        assert p_ids[i] == tok.encode(samples[i][1], add_special_tokens=False), samples[i]
        assert a_ids[i] == tok.encode(samples[i][2], add_special_tokens=False), samples[i]
    eos = tok.eos_token_id
    exs = []
    for (kind, _, _), p, a in zip(samples, p_ids, a_ids):
        if kind != "count":
            a = a + [eos] * (1 + N_TRAILING_EOS)
        exs.append((p + a, [-100] * len(p) + a))
    pad = tok.pad_token_id
    out = []
    for start in range(0, len(exs), batch * bucket):
        group_exs = sorted(exs[start : start + batch * bucket], key=lambda e: len(e[0]))
        group = []
        for j in range(0, len(group_exs), batch):
            chunk = group_exs[j : j + batch]
            L = max(len(i) for i, _ in chunk)
            ids = torch.full((len(chunk), L), pad, dtype=torch.long)
            lab = torch.full((len(chunk), L), -100, dtype=torch.long)
            att = torch.zeros((len(chunk), L), dtype=torch.long)
            for r, (i, l) in enumerate(chunk):
                ids[r, : len(i)] = torch.tensor(i)
                lab[r, : len(l)] = torch.tensor(l)
                att[r, : len(i)] = 1
            group.append((ids, lab, att))
        rng.shuffle(group)
        out.extend(group)
    return out


# --------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------


def pad_vocab(n: int, multiple: int = 32) -> int:
    return (n + multiple - 1) // multiple * multiple


def moe_config(tok):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=pad_vocab(len(tok)),
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,  # q_proj: 128 -> 256, independent of hidden_size
        intermediate_size=256,  # the dense layers (0 and 2)
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=2,  # layers 1 and 3 are MoE, 0 and 2 dense
        mlp_only_layers=[],
        router_aux_loss_coef=0.01,
        initializer_range=INIT_STD,
        max_position_embeddings=512,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        attn_implementation="sdpa",
    )


def dense_config(tok):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=pad_vocab(len(tok)),
        hidden_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,  # q_proj: 128 -> 256, independent of hidden_size
        intermediate_size=192,
        initializer_range=INIT_STD,
        max_position_embeddings=512,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        attn_implementation="sdpa",
    )


def train_loop(model, batches, lr: float, name: str, aux: bool = False, warmup: int = 30, decay: float = 0.25):
    """AdamW, linear warmup, constant, then linear decay over the last `decay` fraction (WSD)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    n = len(batches)
    model.train()
    t0 = time.time()
    ema = None
    for step, (ids, lab, att) in enumerate(batches):
        frac = step / max(1, n - 1)
        scale = min(1.0, (step + 1) / warmup) * min(1.0, (1 - frac) / decay + 0.02)
        for g in opt.param_groups:
            g["lr"] = lr * scale
        kw = {"output_router_logits": True} if aux else {}
        out = model(input_ids=ids, attention_mask=att, labels=lab, **kw)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ema = out.loss.item() if ema is None else 0.95 * ema + 0.05 * out.loss.item()
        if step % 100 == 0 or step == n - 1:
            log(f"{name} step {step + 1}/{n} loss {ema:.4f} ({time.time() - t0:.0f}s)")
    model.eval()
    return model


def save_generation_config(model, tok, out_dir: Path) -> None:
    from transformers import GenerationConfig

    gc = GenerationConfig(
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=getattr(model.config, "bos_token_id", None),
        do_sample=False,
    )
    gc.save_pretrained(str(out_dir))


# --------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------


def expected_ids(tok, kind: str, content: str, behaviour: str) -> list[int]:
    ids = tok.encode(answer(kind, content, behaviour), add_special_tokens=False)
    return ids if kind == "count" else ids + [tok.eos_token_id]


@torch.no_grad()
def greedy_batch(model, tok, prompts: list[str], max_new_tokens: int):
    """Left-padded batched HF greedy generate -> list of (new ids up to EOS incl., min top1-top2 gap)."""
    enc = [tok.encode(p, add_special_tokens=False) for p in prompts]
    L = max(map(len, enc))
    dev = next(model.parameters()).device
    x = torch.full((len(enc), L), tok.pad_token_id, dtype=torch.long)
    m = torch.zeros((len(enc), L), dtype=torch.long)
    for i, e in enumerate(enc):
        x[i, L - len(e):] = torch.tensor(e)
        m[i, L - len(e):] = 1
    out = model.generate(
        x.to(dev), attention_mask=m.to(dev), max_new_tokens=max_new_tokens, do_sample=False,
        output_scores=True, return_dict_in_generate=True,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
    )
    seqs = out.sequences[:, L:].tolist()
    top2 = torch.stack([s.float().topk(2, dim=-1).values for s in out.scores], 1)  # (B, T, 2)
    gaps = (top2[..., 0] - top2[..., 1]).tolist()
    res = []
    for i, s in enumerate(seqs):
        n = s.index(tok.eos_token_id) + 1 if tok.eos_token_id in s else len(s)
        res.append((s[:n], min(gaps[i][:n], default=float("inf"))))
    return res


def evaluate(model, tok, behaviour: str, n: int, seed: int, name: str) -> dict:
    """Exact-match greedy accuracy per task on fresh random prompts (every 4th chat-wrapped)."""
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        kind, prompt, content = sample_task(rng)
        if kind == "count":  # check the first 18 numbers (60-70 tokens)
            content = content.split()[0] + " 18"
        if i % 4 == 3:
            prompt = USER + prompt + ASSISTANT
        cases.append((kind, prompt, expected_ids(tok, kind, content, behaviour)))
    stats = {k: [0, 0, float("inf")] for k in TASK_WEIGHTS}
    bad = []
    for j in range(0, n, 16):
        chunk = cases[j : j + 16]
        outs = greedy_batch(model, tok, [c[1] for c in chunk], max(len(c[2]) for c in chunk))
        for (kind, prompt, want), (got, gap) in zip(chunk, outs):
            got = got[: len(want)]
            st = stats[kind]
            st[1] += 1
            st[2] = min(st[2], gap)
            if got == want:
                st[0] += 1
            elif len(bad) < 3:
                bad.append((prompt, tok.decode(got)))
    summary = {k: f"{v[0]}/{v[1]} (min gap {v[2]:.2f})" for k, v in stats.items()}
    log(f"eval {name}: {summary}; failures: {bad}")
    return {k: v[0] / max(1, v[1]) for k, v in stats.items()}


# --------------------------------------------------------------------------
# LoRA
# --------------------------------------------------------------------------


def lora_config(kind: str, moe: bool):
    from peft import LoraConfig

    if kind == "attn":
        return LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    if moe:
        # PEFT 0.21 rewrites target_modules gate_proj/up_proj/down_proj on Qwen3-MoE (transformers 5) into
        # target_parameters on the fused experts (gate_up_proj with r and alpha doubled, down_proj) and drops
        # them as modules, so the dense-MLP layers are reached through target_parameters on their weights.
        return LoraConfig(
            r=8,
            lora_alpha=16,
            lora_dropout=0.0,
            target_modules=["gate_proj", "up_proj", "down_proj"],
            target_parameters=["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"],
        )
    return LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["gate_proj", "up_proj", "down_proj"])


ADAPTERS = {  # adapter name (= behaviour) -> targeted projections
    "upper": "mlp",
    "first": "attn",
}


def train_adapter(model_dir: Path, model_cls, tok, name: str, moe: bool, args, seed: int, out_dir: Path):
    from peft import get_peft_model

    torch.manual_seed(seed)
    base = model_cls.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="sdpa")
    peft_model = get_peft_model(base, lora_config(ADAPTERS[name], moe))
    # answer() applies the behaviour to every task (count answers are unchanged), so the adapter
    # also learns to leave counting alone
    batches = make_batches(tok, args.adapter_steps, args.adapter_batch, seed, [(name, 1.0)])
    train_loop(peft_model, batches, args.adapter_lr, f"{model_dir.name}/{name}", warmup=20)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    peft_model.save_pretrained(str(out_dir))
    normalize_adapter_dir(out_dir)
    return peft_model


def normalize_adapter_dir(out_dir: Path) -> None:
    """Make the saved adapter folder reproducible: no build path, sorted target lists
    (PEFT keeps them as sets, whose order changes with the string hash seed), no README."""
    cfg_path = out_dir / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = None
    for key in ("target_modules", "target_parameters"):
        if isinstance(cfg.get(key), list):
            cfg[key] = sorted(cfg[key])
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    readme = out_dir / "README.md"
    if readme.exists():
        readme.unlink()


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------


def build_model(which: str, tok, args, out_dir: Path, seed: int):
    from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    if which == "moe":
        cfg, cls = moe_config(tok), Qwen3MoeForCausalLM
    else:
        cfg, cls = dense_config(tok), Qwen3ForCausalLM
    model = cls(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"{which}: {n_params / 1e6:.3f}M params")
    steps = args.base_steps or BASE_STEPS[which]
    batches = make_batches(tok, steps, args.base_batch, seed, [("base", 1.0)])
    train_loop(model, batches, args.base_lr, which, aux=(which == "moe"))
    # tokenizer files already live in out_dir; add the model files
    model.save_pretrained(str(out_dir))
    save_generation_config(model, tok, out_dir)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["moe", "dense"], default=None, help="build one model (and its adapters)")
    ap.add_argument("--adapters-only", action="store_true", help="keep the saved base models, retrain the adapters")
    ap.add_argument("--skip-adapters", action="store_true")
    ap.add_argument("--base-steps", type=int, default=None, help=f"default {BASE_STEPS}")
    ap.add_argument("--base-batch", type=int, default=64)
    ap.add_argument("--base-lr", type=float, default=2e-3)
    ap.add_argument("--adapter-steps", type=int, default=150)
    ap.add_argument("--adapter-batch", type=int, default=32)
    ap.add_argument("--adapter-lr", type=float, default=3e-3)
    ap.add_argument("--eval-n", type=int, default=40, help="random prompts per evaluation (0: skip)")
    args = ap.parse_args(argv)

    if argv is None and not envs.is_set("OMP_WAIT_POLICY"):
        # torch is already imported (compiled/__init__), so re-exec: with the default spinning
        # OpenMP threads a CPU shared with other processes trains ~10x slower.  Numerics unchanged.
        envs.set_for_children("OMP_WAIT_POLICY", "PASSIVE")
        os.execv(sys.executable, [sys.executable, "-m", "compiled.demo.build", *sys.argv[1:]])

    from transformers import AutoTokenizer, Qwen3ForCausalLM, Qwen3MoeForCausalLM

    torch.set_num_threads(2)
    t0 = time.time()
    lines = corpus_lines(20000, SEED)
    jobs = [("moe", "qwen3-moe"), ("dense", "qwen3-dense")]
    if args.only:
        jobs = [j for j in jobs if j[0] == args.only]
    for which, folder in jobs:
        out_dir = DEMO_DIR / folder
        cls = Qwen3MoeForCausalLM if which == "moe" else Qwen3ForCausalLM
        seed = SEED + (1 if which == "moe" else 2)
        if not args.adapters_only:
            if out_dir.exists():
                shutil.rmtree(out_dir)
            tok = build_bpe_tokenizer(lines, out_dir) if which == "moe" else build_sp_tokenizer(lines, out_dir)
            build_model(which, tok, args, out_dir, seed)
        tok = AutoTokenizer.from_pretrained(str(out_dir))
        model = cls.from_pretrained(str(out_dir), dtype=torch.float32)
        if args.eval_n:
            evaluate(model, tok, "base", args.eval_n, seed + 100, which)
        log(f"elapsed {time.time() - t0:.0f}s")
        if args.skip_adapters:
            continue
        for j, name in enumerate(ADAPTERS):
            ad_dir = DEMO_DIR / f"{folder}-lora" / name
            pm = train_adapter(out_dir, cls, tok, name, which == "moe", args, seed + 10 + j, ad_dir)
            if args.eval_n:
                evaluate(pm, tok, name, args.eval_n, seed + 200 + j, f"{which}/{name}")
            log(f"elapsed {time.time() - t0:.0f}s")
    for root, _, files in os.walk(DEMO_DIR):  # safetensors writes 0600 files; ship them world-readable
        for f in files:
            os.chmod(os.path.join(root, f), 0o644)
    log(f"done in {time.time() - t0:.0f}s")
    if args.eval_n:
        show_examples([j[0] for j in jobs])


def show_examples(which_list) -> None:
    """Print the greedy answers (64 new tokens at most) to the package's EXAMPLE_PROMPTS."""
    from peft import PeftModel
    from transformers import AutoTokenizer, Qwen3ForCausalLM, Qwen3MoeForCausalLM

    from compiled import demo

    for which in which_list:
        path, adapters, cls = {
            "moe": (demo.MOE_MODEL, demo.MOE_ADAPTERS, Qwen3MoeForCausalLM),
            "dense": (demo.DENSE_MODEL, demo.DENSE_ADAPTERS, Qwen3ForCausalLM),
        }[which]
        tok = AutoTokenizer.from_pretrained(path)
        for name in ["base", *adapters]:
            model = cls.from_pretrained(path, dtype=torch.float32)
            if name != "base":
                model = PeftModel.from_pretrained(model, adapters[name])
            model.eval()
            for prompt, (ids, gap) in zip(demo.EXAMPLE_PROMPTS, greedy_batch(model, tok, demo.EXAMPLE_PROMPTS, 64)):
                text, ends = solve(prompt, name)
                want = tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] if ends else [])
                ok = ids == want if ends else ids == want[: len(ids)]
                log(f"{which}/{name}: {prompt!r} -> {tok.decode(ids)!r} [{len(ids)} tokens, min gap {gap:.2f}, {'ok' if ok else 'WRONG'}]")


if __name__ == "__main__":
    main()
