"""Every Triton kernel compiles for Hopper (sm_90), on a CPU-only machine.

The CPU tests run the kernels under Triton's interpreter, which accepts code the compiler refuses (a
global that is not a constexpr, say), so such a kernel would first fail on a GPU. Here a subprocess
points Triton at a stand-in driver that reports an sm_90 target and turns every launch into a
warm-up (compile, no launch), with PDL and TMA on as on Hopper; then a small Qwen3-MoE model with a dense
layer runs a prefill and a decode step through the Triton backends (every pass on: fused linears,
q/k norm + RoPE in attention), and the fused MoE is called at decode and prefill sizes with the
H100's tuned configs (TMA, part-height tiles) and as the one-token GEMVs; the launches those leave
out (the routing kernel, over all experts and over a rank's, and inside the alignment's count
kernel, the prologues' own launches, the plain K/V store, extend attention with TMA, the greedy
argmax, the skinny GEMM's one-row GEMV mode, the multi-LoRA kernels, the norm kernels doing LoRA
work and the fused MoE with expert LoRA) are called directly, and so are the FP8 paths (each scale
mode of the fused MoE's GEMVs and grouped GEMMs with and without expert LoRA, of the skinny GEMM
with its prologues and LoRA epilogue, the W8A16 GEMM with its tiles and split K as the heuristic
picks them at 64 rows and forced (narrow columns, K tiles over several scale blocks, 8 warps), and
the dequantization kernel). Outputs are never computed, so nothing is compared: the test is that
every kernel compiles."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from tests.conftest import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# every @triton.jit kernel the package launches (a new kernel belongs here, and in a call below)
EXPECTED = {"_skinny_kernel", "_add_rms_norm_kernel", "_silu_mul_kernel", "_decode_kernel", "_extend_kernel",
            "_store_kv_kernel",
            "_norm_rope_store_kernel", "topk_route_kernel", "align_count_kernel", "align_place_kernel",
            "moe_gemm1_kernel", "moe_gemm2_kernel", "moe_sum_kernel",
            "moe_sum_add_rms_norm_kernel", "_argmax_kernel", "moe_gemv_up_kernel", "moe_gemv_down_kernel",
            "_lora_shrink_kernel", "_lora_expand_kernel", "moe_lora_shrink_kernel", "_w8a16_kernel",
            "_dequant_kernel", "_quant_group_kernel"}
CONFIG = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=97, hidden_size=256, intermediate_size=384,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
              max_position_embeddings=128, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128,
              norm_topk_prob=True, mlp_only_layers=[1])


def test_every_kernel_compiles_for_hopper():
    env = child_env(TRITON_INTERPRET=None, COMPILED_LINEAR_BACKEND="triton", COMPILED_ATTENTION_BACKEND="triton",
                    COMPILED_MOE_BACKEND="triton")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    compiled = set(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert EXPECTED <= compiled, EXPECTED - compiled


def _stand_in_hopper() -> list[str]:
    """Make Triton compile for sm_90 without a GPU; returns the list the launches append to."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    class Hopper(DriverBase):
        @classmethod
        def is_active(cls):
            return True

        def map_python_to_cpp_type(self, ty):
            return ty

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_benchmarker(self):
            raise NotImplementedError

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

    driver.set_active(Hopper())
    names: list[str] = []
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        names.append(self.fn.__name__)
        return kernel
    JITFunction.run = compile_only
    import compiled.triton_utils as triton_utils
    triton_utils.hopper_or_newer = lambda device: True
    return names


def _model_steps() -> None:
    """A prefill of three prompts and a decode step of the passed graph, in bf16."""
    from compiled.graphs.config import ModelConfig
    from tests.passes.test_passes import _passed, _plain, _run
    cfg = ModelConfig.from_dict(CONFIG)
    plain = _plain(cfg).to(torch.bfloat16)
    gm = _passed(cfg, plain, None).to(torch.bfloat16)
    _run(gm, cfg, [[1, 2, 3], [4] * 20, [5]], [6, 7, 8], dtype=torch.bfloat16)


def _moe_calls() -> None:
    """The fused MoE at 2 to 512 tokens with the H100's tuned configs, and the one-token GEMVs."""
    import compiled.moe.fused_moe as fm
    from compiled.moe import tuned_configs
    E, H, I, k = 128, 256, 128, 8
    table = tuned_configs.load_configs(E, 768, "NVIDIA_H100_80GB_HBM3", "bfloat16")
    w13, w2 = torch.randn(E, 2 * I, H).bfloat16(), torch.randn(E, H, I).bfloat16()
    for T in (2, 8, 64, 512):
        x = torch.randn(T, H).bfloat16()
        ids = torch.randint(0, E, (T, k))
        weights = torch.rand(T, k)
        config = table[min(table, key=lambda m: abs(m - T))]
        fm.fused_moe_triton(x, weights, ids, w13, w2, config=config)
    fm.fused_moe_triton(x[:1], weights[:1], ids[:1], w13, w2)


def _routed_moe() -> None:
    """The fused MoE routing from the router's logits in its count kernel (256 pairs), over all
    experts and over a rank's."""
    import compiled.moe.fused_moe as fm
    from compiled.moe.routing import Routed, Router, routed_buffers
    E, H, I, k, T = 128, 256, 128, 8, 32
    w13, w2, x = torch.randn(E, 2 * I, H).bfloat16(), torch.randn(E, H, I).bfloat16(), torch.randn(T, H).bfloat16()
    for local in (None, E):
        router = Router(torch.randn(T, E).bfloat16(), k, True, local)
        w, ids = routed_buffers(router)
        fm.fused_moe_triton(x, w, ids, w13, w2, route=Routed(router, w, ids))


def _other_calls() -> None:
    """Launches the model steps above do not make: on CUDA only (routing, the prologues outside the
    GEMM), without the fuse_qk_norm_rope pass (the plain K/V store), at 16 splits (the decode
    attention's L2 prefetch) or at one row (the skinny GEMM's GEMV mode: plain, split, and with
    each prologue; the decode step above has three)."""
    from compiled.attention.triton_decode import DecodeWorkspace, decode_attention_triton
    from compiled.attention.triton_store import store_kv_triton
    from compiled.linear.prologue_kernels import add_rms_norm_triton, silu_and_mul_triton
    from compiled.moe.routing import topk_route_triton
    k_cache = torch.zeros(64, 2, 128).bfloat16()
    store_kv_triton(k_cache, k_cache.clone(), torch.arange(5), torch.randn(5, 2, 128).bfloat16(),
                    torch.randn(5, 2, 128).bfloat16())
    # 16 splits: each split's first KV tile asked of L2 before the PDL wait (the smallest batches)
    decode_attention_triton(torch.randn(1, 4, 128).bfloat16(), k_cache, k_cache, torch.arange(64)[None].int(),
                            torch.zeros(1, dtype=torch.long), torch.tensor([40]), 0.1,
                            DecodeWorkspace(1, 4, 2, 128, torch.device("cpu"), min_rows=16), num_splits=16)
    topk_route_triton(torch.randn(24, 128).bfloat16(), 8, True)
    topk_route_triton(torch.randn(24, 128).bfloat16(), 8, True, local_experts=32)
    _routed_moe()
    from compiled.runtime.argmax import ArgmaxWorkspace, argmax_triton
    argmax_triton(torch.randn(2, 10000), ArgmaxWorkspace(2, torch.device("cpu")))
    x = torch.randn(24, 2048).bfloat16()
    add_rms_norm_triton(x, x, torch.ones(2048).bfloat16(), 1e-6)
    silu_and_mul_triton(x)
    from compiled.attention.triton_extend import extend_attention_triton
    q, kv = torch.randn(70, 4, 128).bfloat16(), torch.randn(70, 2, 128).bfloat16()
    one = torch.tensor([70])
    extend_attention_triton(q, kv, kv, k_cache, k_cache, torch.arange(64)[None], torch.zeros(1, dtype=torch.long),
                            one, one, torch.zeros(1, dtype=torch.long), 70, 0.1, tma=True)
    from compiled.linear import skinny_kernels as lk
    row, router = x[:1], torch.randn(128, 2048).bfloat16()
    lk.skinny_linear_triton(row, torch.randn(512, 2048).bfloat16())
    lk.skinny_linear_triton(row, router, lk.SkinnyConfig(2, 256, 2, gemv=True))
    lk.skinny_linear_triton(x[:4], router, lk.SkinnyConfig(2, 256, 1, gemv=True))   # several rows (forced)
    lk.add_rms_norm_linear_triton(row, row, torch.ones(2048).bfloat16(), 1e-6, router, True)
    lk.silu_mul_linear_triton(torch.randn(1, 4096).bfloat16(), torch.randn(512, 2048).bfloat16())


def _lora_calls() -> None:
    """The multi-LoRA shrink / expand (decode and prefill blocks, bf16 and fp32, an uneven K) and
    the fused MoE with expert LoRA at decode and prefill sizes with the H100's tuned tiles."""
    from compiled.linear.lora_kernels import lora_expand_triton, lora_shrink_triton
    for T, dtype in ((1, torch.bfloat16), (64, torch.bfloat16), (512, torch.bfloat16), (8, torch.float32)):
        x, slot = torch.randn(T, 2048).to(dtype), torch.zeros(T, dtype=torch.int32)
        s = lora_shrink_triton(x, torch.randn(8, 48, 2048).to(dtype), slot)
        lora_expand_triton(torch.randn(T, 5120).to(dtype), s, torch.randn(8, 5120, 16).to(dtype), torch.ones(8, 3),
                           slot, [4096, 512, 512])
    lora_shrink_triton(torch.randn(4, 1000).bfloat16(), torch.randn(8, 16, 1000).bfloat16(),
                       torch.zeros(4, dtype=torch.int32))
    _norm_lora_calls()
    from compiled.moe import tuned_configs
    from compiled.moe.expert_lora import fused_moe_lora_triton
    E, H, I, k, R, S = 128, 256, 128, 8, 16, 4
    table = tuned_configs.load_configs(E, 768, "NVIDIA_H100_80GB_HBM3", "bfloat16")
    lora = [torch.randn(*shape).bfloat16() for shape in ((S, E, 2 * R, H), (S, E, 2 * I, R), (S, E, R, I),
                                                         (S, E, H, R))]
    w13, w2 = torch.randn(E, 2 * I, H).bfloat16(), torch.randn(E, H, I).bfloat16()
    for T in (1, 64, 512):
        config = table[min(table, key=lambda m: abs(m - T))]
        fused_moe_lora_triton(torch.randn(T, H).bfloat16(), torch.rand(T, k), torch.randint(0, E, (T, k)), w13, w2,
                              *lora, torch.ones(S, 3), torch.zeros(T, dtype=torch.int32), config=config)


def _norm_lora_calls() -> None:
    """The norm kernels doing a linear's LoRA work: o_proj's expand in the add + RMSNorm, the qkv's
    shrink in the MoE's sum + norm (one output a program at one token, 8 at 64)."""
    from compiled.linear.lora_kernels import LoRAArgs
    from compiled.linear.prologue_kernels import add_rms_norm_triton
    from compiled.moe.fused_moe import moe_sum_add_rms_norm_triton
    nw = torch.ones(2048).bfloat16()
    for T in (1, 64):
        x, slot = torch.randn(T, 2048).bfloat16(), torch.zeros(T, dtype=torch.int32)
        la = LoRAArgs.of(torch.randn(T, 16), torch.randn(8, 2048, 16).bfloat16(), torch.ones(8, 1), slot, [2048])
        add_rms_norm_triton(x, x, nw, 1e-6, lora=la)
        moe_sum_add_rms_norm_triton(torch.randn(8 * T, 2048).bfloat16(), x, nw, 1e-6,
                                    shrink=(torch.randn(8, 48, 2048).bfloat16(), slot))


def _fp8(rows: int, cols: int, block: list[int], lead: tuple = ()):
    """A float8 weight `[*lead, rows, cols]` and its block scale."""
    from compiled.quant.dequant import resolve_block
    bo, bi = resolve_block(block, rows, cols)
    return (torch.randn(*lead, rows, cols).to(torch.float8_e4m3fn),
            torch.rand(*lead, -(-rows // bo), -(-cols // bi)) + 0.5)


def _fp8_calls() -> None:
    """The FP8 kernels in each scale mode (`quant.dequant.scale_tiling`): 128 x 128 blocks (one
    scale per row a tile, several blocks a GEMV tile; at 512 tokens W8A8, the activations'
    quantization and the fp8 x fp8 GEMMs, with one weight scale a tile and, 256 columns wide, one a
    row; at 8 tokens W8A8 in 64-row tiles) and 16 x 24 blocks (a gather per element)."""
    import compiled.moe.fused_moe as fm
    from compiled.moe import tuned_configs
    from compiled.linear import skinny_kernels as lk
    from compiled.linear.fp8_kernels import W8A16Config, w8a16_linear
    from compiled.linear.lora_kernels import LoRAArgs
    from compiled.moe.expert_lora import fused_moe_lora_triton
    from compiled.quant.dequant import WeightScale
    from compiled.quant.dequant_kernel import dequantize_triton
    E, H, I, k, R, S = 128, 256, 128, 8, 16, 4
    table = tuned_configs.load_configs(E, 768, "NVIDIA_H100_80GB_HBM3", "bfloat16")
    lora = [torch.randn(*shape).bfloat16() for shape in ((S, E, 2 * R, H), (S, E, 2 * I, R), (S, E, R, I),
                                                         (S, E, H, R))]
    for block in ([128, 128], [16, 24]):
        (q13, s13), (q2, s2) = _fp8(2 * I, H, block, (E,)), _fp8(H, I, block, (E,))
        scales = fm.ExpertScales(s13, s2, block)
        for T in (1, 8, 64, 512):   # 512 >= W8A8_MIN_TOKENS
            x, weights, ids = torch.randn(T, H).bfloat16(), torch.rand(T, k), torch.randint(0, E, (T, k))
            config = table[min(table, key=lambda m: abs(m - T))]
            fm.fused_moe_triton(x, weights, ids, q13, q2, config=config, scales=scales)
            fused_moe_lora_triton(x, weights, ids, q13, q2, *lora, torch.ones(S, 3), torch.zeros(T, dtype=torch.int32),
                                  config=config, scales=scales)
        if block == [128, 128]:   # W8A8 with N tiles wider than the blocks: a weight scale a row
            wide = dict(config, BLOCK_SIZE_N=256, down=dict(config.get("down", config), BLOCK_SIZE_N=256))
            fm.fused_moe_triton(x, weights, ids, q13, q2, config=wide, scales=scales)
            # 8 tokens W8A8 in 64-row tiles, as a tuned entry may name it (fp8 wgmma at a few tokens)
            few = dict(config, BLOCK_SIZE_M=64, HALF_M=0, W8A8=1)
            fm.fused_moe_triton(x[:8], weights[:8], ids[:8], q13, q2, config=few, scales=scales)
        q, s = _fp8(512, 2048, block)
        fp8 = WeightScale(s, block)
        x = torch.randn(64, 2048).bfloat16()
        for rows in (1, 4, 16):
            lk.skinny_linear_triton(x[:rows], q, fp8=fp8)
            lk.add_rms_norm_linear_triton(x[:rows], x[:rows], torch.ones(2048).bfloat16(), 1e-6, q, True, fp8=fp8)
            slot = torch.zeros(rows, dtype=torch.int32)
            la = LoRAArgs.of(torch.randn(rows, 16), torch.randn(8, 512, 16).bfloat16(), torch.ones(8, 1), slot, [512])
            lk.skinny_linear_lora_triton(x[:rows], q, la, fp8=fp8)
        lk.silu_mul_linear_triton(torch.randn(1, 4096).bfloat16(), q, fp8=fp8)
        w8a16_linear(x, q, s, block)
        if block == [128, 128]:   # o_proj's shape: the heuristic splits K
            w8a16_linear(x, torch.randn(2048, 4096).to(torch.float8_e4m3fn), torch.rand(16, 32) + 0.5, block)
        w8a16_linear(x, q, s, block, W8A16Config(64, 16, 64, 4))
        w8a16_linear(x[:32], q, s, block, W8A16Config(32, 64, 256, 2, 8, 3))
        dequantize_triton(q, s, block, torch.bfloat16)


if __name__ == "__main__":   # run by the test above, without the interpreter
    launched = _stand_in_hopper()
    _model_steps()
    _moe_calls()
    _other_calls()
    _lora_calls()
    _fp8_calls()
    print(json.dumps(sorted(set(launched))))
