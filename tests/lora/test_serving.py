"""Multi-LoRA serving on CPU (fp32): prompt logprobs of every row against its own oracle (PEFT's
forward where PEFT runs the adapter, else the merged model `W + scaling * B @ A`), batches that
mix adapters and base rows, more adapters than slots and than the CPU tier holds, and bad input."""

from __future__ import annotations

import pytest
import torch

from compiled import LLM, SamplingParams
from compiled.demo import DENSE_ADAPTERS, DENSE_MODEL, MOE_ADAPTERS, MOE_MODEL
from compiled.errors import CompiledError, ConfigError, RequestError
from compiled.graphs.config import ModelConfig
from compiled.lora.adapter import load_adapter
from compiled.lora.merge import merge_into
from compiled.lora.weights import LoRAError
from tests.conftest import hf_model, make_checkpoint
from tests.graphs.test_hf_parity import assert_prompt_logprobs_match, random_prompts
from tests.lora.test_adapter import ATTN, MLP, make_peft_adapter, per_expert_tensors, write_adapter

LOGPROBS = SamplingParams(max_new_tokens=1, prompt_logprobs=-1)


@torch.no_grad()
def oracle_logprobs(base: str, adapter_path: str | None, prompt: list[int], max_rank: int = 64) -> torch.Tensor:
    """log_softmax of HF's logits, the adapter merged into the weights (None: the base model)."""
    model = hf_model(base)
    if adapter_path is not None:
        merge_into(model, load_adapter("oracle", adapter_path, ModelConfig.from_pretrained(base), max_rank))
    return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)


def check_rows(llm: LLM, base: str, prompts, names, paths: dict[str, str]) -> None:
    outs = llm.generate(prompts, LOGPROBS, lora=names)
    for prompt, name, out in zip(prompts, names, outs):
        assert_prompt_logprobs_match(out, oracle_logprobs(base, paths.get(name), prompt))


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("serving")
    return {"dense": make_checkpoint(root / "dense"), "mixed": make_checkpoint(root / "mixed", moe=True,
                                                                             decoder_sparse_step=2)}


@pytest.fixture(scope="module")
def adapters(bases, tmp_path_factory):
    """Random non-zero adapters of several ranks and targets, each made by PEFT (or, for the
    per-expert layout PEFT no longer saves, written in the transformers-4 key layout)."""
    root = tmp_path_factory.mktemp("adapters")
    mixed = ModelConfig.from_pretrained(bases["mixed"])
    return {
        "dense": {
            "attn_r8": make_peft_adapter(bases["dense"], root / "d1", seed=1, r=8, lora_alpha=16, target_modules=ATTN),
            "all_r16": make_peft_adapter(bases["dense"], root / "d2", seed=2, r=16, lora_alpha=8,
                                         target_modules=ATTN + MLP),
            "all_r64_rslora": make_peft_adapter(bases["dense"], root / "d3", seed=3, r=64, lora_alpha=32,
                                                use_rslora=True, target_modules=ATTN + MLP),
            "mlp_pattern": make_peft_adapter(bases["dense"], root / "d4", seed=4, r=8, lora_alpha=16,
                                             target_modules=MLP, rank_pattern={"down_proj": 4}),
        },
        "mixed": {
            "fused_experts": make_peft_adapter(
                bases["mixed"], root / "m1", seed=5, r=8, lora_alpha=16, use_rslora=True, target_modules=ATTN + MLP,
                target_parameters=["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]),
            "per_expert": write_adapter(root / "m2", per_expert_tensors(mixed, 4, seed=6), r=4, lora_alpha=8,
                                        target_modules=["gate_proj", "up_proj", "down_proj"]),
            "attn_only": make_peft_adapter(bases["mixed"], root / "m3", seed=7, r=16, lora_alpha=16,
                                           target_modules=["q_proj", "v_proj"]),
        },
    }


@pytest.mark.parametrize("which", ["dense", "mixed"])
def test_mixed_batch_each_row_matches_its_oracle(which, bases, adapters):
    """Four or more adapters and base rows in one batch; small step budget forces chunked prefill."""
    base, paths = bases[which], adapters[which]
    llm = LLM(base, device="cpu", dtype="float32", lora_modules=paths, max_loras_per_batch=len(paths),
              max_num_batched_tokens=40)
    names = [None, *paths, None, *paths][:6]
    prompts = random_prompts(ModelConfig.from_pretrained(base).vocab_size, [9, 23, 5, 31, 17, 12][:len(names)])
    check_rows(llm, base, prompts, names, paths)


@pytest.mark.parametrize("model, adapters", [(MOE_MODEL, MOE_ADAPTERS), (DENSE_MODEL, DENSE_ADAPTERS)])
def test_demo_adapters_match_their_merged_models(model, adapters):
    llm = LLM(model, device="cpu", dtype="float32", lora_modules=dict(adapters), max_lora_rank=16)
    tok = llm.tokenizer
    prompts = [tok.encode(p) for p in ("copy Bird wax:", "COPY jam:", "count 95:")]
    check_rows(llm, model, prompts, ["upper", "first", None], dict(adapters))


@pytest.mark.parametrize("model, adapters", [(MOE_MODEL, MOE_ADAPTERS), (DENSE_MODEL, DENSE_ADAPTERS)])
def test_demo_adapters_greedy_equals_peft_generate(model, adapters):
    import peft
    llm = LLM(model, device="cpu", dtype="float32", lora_modules=dict(adapters), max_lora_rank=16)
    prompt = llm.tokenizer.encode("copy Bird wax:")
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    for name, path in adapters.items():
        ours = llm.generate([prompt], greedy, lora=name)[0].token_ids
        with torch.no_grad():
            pm = peft.PeftModel.from_pretrained(hf_model(model), path).eval()
            ref = pm.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                              eos_token_id=None)[0, len(prompt):].tolist()
        assert ours == ref, name


def test_more_adapters_than_slots_and_than_the_cpu_tier(bases, adapters):
    """Four adapters through two slots and a CPU tier of three: every row still gets its own
    adapter, whatever was evicted on the way; a pinned adapter stays loaded."""
    base, paths = bases["dense"], adapters["dense"]
    names = list(paths)
    llm = LLM(base, device="cpu", dtype="float32", enable_lora=True, max_loras_per_batch=2, max_loaded_loras=3)
    llm.load_lora(names[0], paths[names[0]], pinned=True)
    for name in names[1:3]:
        llm.load_lora(name, paths[name])
    prompts = random_prompts(ModelConfig.from_pretrained(base).vocab_size, [7, 19, 11, 4, 15, 9], seed=3)
    rows = [names[0], names[1], names[2], None, names[1], names[0]]
    check_rows(llm, base, prompts, rows, paths)
    llm.load_lora(names[3], paths[names[3]])          # evicts the least recently used unpinned one
    assert names[0] in llm.loras and names[3] in llm.loras and len(llm.loras) == 3
    evicted = ({names[1], names[2]} - set(llm.loras)).pop()
    with pytest.raises(RequestError, match=f"unknown adapter '{evicted}'"):
        llm.generate([[1, 2, 3]], LOGPROBS, lora=evicted)
    rows = [names[3], names[0], None, names[3]]
    check_rows(llm, base, prompts[:4], rows, paths)
    assert llm.engine.kv.num_used == 0


def test_unload_and_load_between_runs(bases, adapters):
    base, paths = bases["dense"], adapters["dense"]
    llm = LLM(base, device="cpu", dtype="float32", enable_lora=True, max_loras_per_batch=1)
    prompt = random_prompts(ModelConfig.from_pretrained(base).vocab_size, [13], seed=4)[0]
    llm.load_lora("x", paths["attn_r8"])
    check_rows(llm, base, [prompt], ["x"], {"x": paths["attn_r8"]})
    llm.unload_lora("x")
    llm.load_lora("x", paths["all_r16"])          # the same name, another adapter: no stale slot
    check_rows(llm, base, [prompt], ["x"], {"x": paths["all_r16"]})


def test_unload_refused_while_requests_use_it(bases, adapters):
    base, paths = bases["dense"], adapters["dense"]
    llm = LLM(base, device="cpu", dtype="float32", lora_modules={"a": paths["attn_r8"]})
    request = llm.engine.make_request(0, [1, 2, 3], SamplingParams(max_new_tokens=2), "a")
    llm.engine.add(request)
    with pytest.raises(ConfigError, match="adapter 'a' is used by 1 queued or running requests"):
        llm.unload_lora("a")
    llm.engine.abort(request.id)
    llm.unload_lora("a")
    assert llm.loras == []


def _one_line(e) -> str:
    message = str(e.value)
    assert "\n" not in message
    return message


def test_bad_input(bases, adapters, tmp_path):
    base, paths = bases["dense"], adapters["dense"]
    llm = LLM(base, device="cpu", dtype="float32", lora_modules={"a": paths["attn_r8"]}, max_lora_rank=16)
    prompts = [[1, 2, 3], [4, 5]]
    with pytest.raises(LoRAError) as e:
        llm.load_lora("big", paths["all_r64_rslora"])
    assert "rank 64" in _one_line(e) and "max_lora_rank 16" in str(e.value)
    with pytest.raises(LoRAError) as e:
        llm.load_lora("a", paths["attn_r8"])
    assert "'a' is already loaded" in _one_line(e)
    with pytest.raises(LoRAError) as e:
        llm.unload_lora("nope")
    assert "'nope' is not loaded" in _one_line(e)
    with pytest.raises(LoRAError) as e:
        llm.load_lora("missing", str(tmp_path / "none"))
    assert "missing" in _one_line(e)
    with pytest.raises(RequestError) as e:
        llm.generate(prompts, LOGPROBS, lora=["a", "ghost"])
    assert "prompt 1" in _one_line(e) and "'ghost'" in str(e.value)
    with pytest.raises(ValueError, match="3 adapter names in lora= for 2 prompts"):
        llm.generate(prompts, LOGPROBS, lora=["a", None, "a"])
    with pytest.raises(CompiledError) as e:   # an adapter made for another model
        llm.load_lora("x", adapters["mixed"]["per_expert"])
    assert "'x'" in _one_line(e)
    # nothing that ran was lost: the LLM still serves
    assert len(llm.generate(prompts, LOGPROBS, lora=["a", None])) == 2
    plain = LLM(base, device="cpu", dtype="float32")
    with pytest.raises(RequestError) as e:
        plain.generate(prompts, LOGPROBS, lora="a")
    assert "LoRA is off" in _one_line(e)
    with pytest.raises(ConfigError) as e:
        plain.load_lora("a", paths["attn_r8"])
    assert "LoRA is off" in _one_line(e)


def test_queued_adapters_are_prefetched_and_a_step_never_waits_for_a_load(bases, adapters, monkeypatch):
    """Two slots: while a request with adapter A decodes, the next queued adapter (B) is copied
    into the free slot before its request is admitted, and not C (no slot left without evicting
    B). A request whose copy has not landed waits while the running one keeps decoding; once it
    lands, it is admitted and every output equals its run alone."""
    base, paths = bases["dense"], adapters["dense"]
    a, b, c = list(paths)[:3]
    llm = LLM(base, device="cpu", dtype="float32", enable_lora=True, max_loras_per_batch=2, max_num_seqs=1)
    for name in (a, b, c):
        llm.load_lora(name, paths[name])
    prompts = random_prompts(ModelConfig.from_pretrained(base).vocab_size, [9, 12, 7], seed=5)
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    alone = [llm.generate([p], greedy, lora=n)[0].token_ids for p, n in zip(prompts, (a, b, c))]
    pool, engine = llm.engine.loras, llm.engine
    for name in (b, c):       # start from slots holding neither B nor C
        if name in pool.slot_of:
            pool.in_slot[pool.slot_of.pop(name)] = None
    requests = [engine.make_request(i, p, greedy, n) for i, (p, n) in enumerate(zip(prompts, (a, b, c)))]
    for r in requests:
        engine.add(r)
    landed = {"b": False}
    monkeypatch.setattr(pool, "ready", lambda slot: pool.in_slot[slot] != b or landed["b"])
    monkeypatch.setattr(pool, "wait", lambda slot: landed.update(b=True))
    engine.step()                                   # A admitted; B's copy started behind it
    assert requests[0].row is not None and b in pool.slot_of and c not in pool.slot_of
    while not requests[0].finished:                 # A decodes while B's copy is in flight
        engine.step()
        assert not landed["b"]
    assert requests[1].row is None
    engine.step()                                   # nothing else can run: the step waits for B's copy
    assert landed["b"] and requests[1].row is not None
    while engine.has_work:
        engine.step()
    assert [r.output_token_ids for r in requests] == alone


def test_a_request_waiting_for_a_slot_is_not_overtaken_for_long(bases, adapters):
    """Two slots, held by A (a long request) and B (a short one). C's request finds no slot: B's
    slot, whose requests end first, takes no new request (a later B one waits) and goes to C once
    B's request ends, long before A's does; meanwhile later requests on A and on the base model go
    ahead of C. Every output equals its run alone."""
    base, paths = bases["dense"], adapters["dense"]
    a, b, c = list(paths)[:3]
    llm = LLM(base, device="cpu", dtype="float32", enable_lora=True, max_loras_per_batch=2)
    for name in (a, b, c):
        llm.load_lora(name, paths[name])
    vocab = ModelConfig.from_pretrained(base).vocab_size
    rows = [(a, 24), (b, 3), (c, 3), (b, 3), (a, 3), (None, 3)]
    prompts = random_prompts(vocab, [9, 12, 7, 5, 8, 6], seed=6)
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for _, n in rows]
    alone = [llm.generate([p], sp, lora=name)[0].token_ids for p, sp, (name, _) in zip(prompts, params, rows)]
    engine = llm.engine
    requests = [engine.make_request(i, p, sp, name) for i, (p, sp, (name, _)) in enumerate(zip(prompts, params, rows))]
    for r in requests:
        engine.add(r)
    admitted_at: dict[int, int] = {}
    step = 0
    while engine.has_work:
        engine.step()
        step += 1
        admitted_at.update((i, step) for i, r in enumerate(requests) if r.row is not None and i not in admitted_at)
        if step == 1:
            assert set(admitted_at) == {0, 1, 4, 5}, admitted_at   # C waits; B's later request too
        if not requests[0].finished:
            finished_a = step + 1
    assert admitted_at[2] < admitted_at[3] and admitted_at[2] < finished_a
    assert [r.output_token_ids for r in requests] == alone
    assert engine.kv.num_used == 0


def test_cpu_tier_holds_adapters_in_the_slots_dtype(bases, adapters):
    """A bf16 engine keeps its adapters in bf16 (half the bytes of the loaded float32), and a slot
    receives them unchanged."""
    base, paths = bases["dense"], adapters["dense"]
    llm = LLM(base, device="cpu", dtype="bfloat16", lora_modules={"a": paths["attn_r8"]})
    pool = llm.engine.loras
    tier = pool.adapters["a"]
    assert {w.a.dtype for w in tier.dense.values()} == {w.b.dtype for w in tier.dense.values()} == {torch.bfloat16}
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2), lora="a")[0].token_ids) == 2
    target = pool.dense[0]
    w = tier.dense[(target.layer, target.projs[0])]
    assert torch.equal(target.a[pool.slot_of["a"], :w.rank], w.a)
