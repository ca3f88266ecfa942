"""Packed Gated DeltaNet (model/delta_rule.py, model/linear_attention.py) against transformers' Qwen3.5 layer.

The references share no code with ours: transformers' ``Qwen3_5GatedDeltaNet`` run on each sample alone
(float32), and its token-by-token ``torch_recurrent_gated_delta_rule`` (float64) for the kernel, which is
another algorithm than our chunked one. STYLE 24: a short sample packed after a long one must come out
exactly as alone; every case also checks that the pack *would* leak if the state were carried over.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megatron_pack.model.delta_rule import packed_causal_conv1d, packed_gated_delta_rule

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _dist import spawn_world  # noqa: E402

torch.use_deterministic_algorithms(True)

HIDDEN, KEY_HEADS, VALUE_HEADS, HEAD_DIM, WIDTH = 32, 2, 4, 8, 4

CASES = [
    # (cu_seqlens, cu_seqlens_padded or None)
    ([0, 150, 155], [0, 152, 160]),                  # short after long (three 64-token chunks), padded
    ([0, 7, 27, 30], [0, 8, 32, 40]),                # padding between every sub-sequence
    ([0, 64, 65, 98], None),                         # unpadded; a chunk-sized and a one-token sample
    ([0, 10, 80, 80, 80], [0, 16, 88, 96, 96]),      # pad_to_max_length tail slot, fixed-length cu tail
]
IDS = ["short_after_long", "padding_between", "unpadded_chunk_edges", "tail_slot_fixed_cu"]


def _samples(cu, cu_pad):
    """(start row, real length) of every sub-sequence with a real token."""
    cu_pad = cu_pad or cu
    return [(cu_pad[i], cu[i + 1] - cu[i]) for i in range(len(cu) - 1) if cu[i + 1] > cu[i]]


def _real_rows(cu, cu_pad) -> torch.Tensor:
    total = (cu_pad or cu)[-1]
    real = torch.zeros(total, dtype=torch.bool)
    for start, n in _samples(cu, cu_pad):
        real[start:start + n] = True
    return real


# ---- the kernels -----------------------------------------------------------------------------------

def _kernel_inputs(total, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(total, KEY_HEADS, HEAD_DIM, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(total, VALUE_HEADS, HEAD_DIM, generator=g, dtype=dtype)
    decay = -torch.rand(total, VALUE_HEADS, generator=g, dtype=dtype) * 0.3
    beta = torch.rand(total, VALUE_HEADS, generator=g, dtype=dtype)
    return [t.requires_grad_(True) for t in (q, k, v, decay, beta)]


def _recurrence(q, k, v, decay, beta):
    """The gated delta rule's definition, one token at a time (float64; the module docstring's formula)."""
    q = q / q.norm(dim=-1, keepdim=True).square().add(1e-6).sqrt() / HEAD_DIM ** 0.5
    k = k / k.norm(dim=-1, keepdim=True).square().add(1e-6).sqrt()
    q, k = (t.repeat_interleave(VALUE_HEADS // KEY_HEADS, dim=1) for t in (q, k))
    state = torch.zeros(VALUE_HEADS, HEAD_DIM, HEAD_DIM, dtype=q.dtype)
    out = []
    for t in range(q.size(0)):
        state = state * decay[t].exp()[:, None, None]
        delta = (v[t] - torch.einsum("hkv,hk->hv", state, k[t])) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", state, q[t]))
    return torch.stack(out)


@pytest.mark.parametrize("cu,cu_pad", CASES, ids=IDS)
def test_delta_rule_matches_recurrence_per_sample(cu, cu_pad):
    """Chunked, packed (ours) == a float64 token-by-token recurrence on each sample alone, with gradients."""
    inputs = _kernel_inputs((cu_pad or cu)[-1])
    out = packed_gated_delta_rule(*inputs, cu, cu_pad, kernel="torch", use_qk_l2norm=True)
    ref = torch.zeros_like(out)
    for start, n in _samples(cu, cu_pad):
        ref[start:start + n] = _recurrence(*(t[start:start + n] for t in inputs))
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    assert float(ref.abs().max()) > 0.1 and not out[~_real_rows(cu, cu_pad)].any()
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    grads = torch.autograd.grad((out * weight).sum(), inputs)
    want = torch.autograd.grad((ref * weight).sum(), inputs)
    for got, expected in zip(grads, want):
        torch.testing.assert_close(got, expected, atol=1e-9, rtol=1e-9)
    assert all(not grad[~_real_rows(cu, cu_pad)].any() for grad in grads)  # padding receives nothing


def test_state_would_leak_without_the_reset():
    """Guard: the same recurrence over the whole pack changes the second sample (what a leak looks like)."""
    cu = [0, 150, 155]
    inputs = _kernel_inputs(155)
    ours = packed_gated_delta_rule(*inputs, cu, None, kernel="torch", use_qk_l2norm=True)
    leaked = _recurrence(*inputs)
    assert float((leaked[150:] - ours[150:]).abs().max()) > 1e-2


@pytest.mark.parametrize("cu,cu_pad", CASES, ids=IDS)
def test_conv1d_restarts_per_sample(cu, cu_pad):
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn

    total, channels = (cu_pad or cu)[-1], 6
    g = torch.Generator().manual_seed(2)
    x, weight = torch.randn(total, channels, generator=g), torch.randn(channels, WIDTH, generator=g)
    out = packed_causal_conv1d(x, weight, None, cu, cu_pad)
    ref = torch.zeros_like(out)
    for start, n in _samples(cu, cu_pad):
        ref[start:start + n] = causal_conv1d_fn(x[None, start:start + n].transpose(1, 2), weight,
                                                activation="silu")[0].T
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    whole = causal_conv1d_fn(x[None].transpose(1, 2), weight, activation="silu")[0].T
    second = _samples(cu, cu_pad)[1][0]  # guard: without the restart the second sample's first row differs
    assert float((whole[second] - out[second]).abs().max()) > 1e-3


# ---- the layer -------------------------------------------------------------------------------------

def _configs(tp: int = 1, sp: bool = False, dtype=torch.float32):
    from megatron.core.transformer.transformer_config import TransformerConfig
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    ours = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, normalization="RMSNorm",
                             layernorm_epsilon=1e-6, activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0,
                             use_cpu_initialization=True, linear_conv_kernel_dim=WIDTH,
                             tensor_model_parallel_size=tp, sequence_parallel=sp, params_dtype=dtype,
                             linear_key_head_dim=HEAD_DIM, linear_value_head_dim=HEAD_DIM,
                             linear_num_key_heads=KEY_HEADS, linear_num_value_heads=VALUE_HEADS)
    hf = Qwen3_5TextConfig(hidden_size=HIDDEN, linear_num_value_heads=VALUE_HEADS, linear_num_key_heads=KEY_HEADS,
                           linear_key_head_dim=HEAD_DIM, linear_value_head_dim=HEAD_DIM,
                           linear_conv_kernel_dim=WIDTH, num_hidden_layers=1, layer_types=["linear_attention"])
    return ours, hf


def _rank_slices(hf, tp: int, tp_rank: int) -> dict:
    """transformers' weights (or, with ``.grad``, their gradients) as TP rank ``tp_rank`` of ``tp`` holds them.

    in_proj per rank is [q, k, v, z, beta, alpha] of its heads (megatron-core's layout); conv1d channels
    [q, k, v] of its heads; dt_bias, A_log its heads; out_proj its input columns; out_norm whole.
    Example, TP=2, 2 key heads of 8: rank 1 holds q rows 8-15 and k rows 24-31 of in_proj_qkv.
    """
    def part(t, dim=0):
        return t.chunk(tp, dim)[tp_rank]

    def qkv(t):
        q, k, v = t.split([KEY_HEADS * HEAD_DIM, KEY_HEADS * HEAD_DIM, VALUE_HEADS * HEAD_DIM])
        return [part(q), part(k), part(v)]

    def grab(p):
        return p if p.grad is None else p.grad

    w = {name: grab(p) for name, p in hf.named_parameters()}
    return {"in_proj.weight": torch.cat(qkv(w["in_proj_qkv.weight"]) + [part(w[f"in_proj_{x}.weight"]) for x in "zba"]),
            "conv1d.weight": torch.cat(qkv(w["conv1d.weight"])), "dt_bias": part(w["dt_bias"]),
            "A_log": part(w["A_log"]), "out_norm.weight": w["norm.weight"],
            "out_proj.weight": part(w["out_proj.weight"], 1)}


def _layers(pg_collection, seed=0, tp: int = 1, tp_rank: int = 0, sp: bool = False, dtype=torch.float32):
    """(our PackedGatedDeltaNet, transformers' Qwen3_5GatedDeltaNet) holding the same weights."""
    from megatron.core.transformer.spec_utils import build_module
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    from megatron_pack.model.linear_attention import linear_attention_spec

    config, hf_config = _configs(tp, sp, dtype)
    torch.manual_seed(seed)
    hf = Qwen3_5GatedDeltaNet(hf_config, 0).to(dtype)
    with torch.no_grad():  # non-trivial norm weights and decays
        hf.norm.weight.uniform_(0.5, 1.5)
        hf.dt_bias.uniform_(-1.0, 1.0)
    ours = build_module(linear_attention_spec(), config=config, layer_number=1, pg_collection=pg_collection,
                        kernel="torch")
    with torch.no_grad():
        for name, value in _rank_slices(hf, tp, tp_rank).items():
            ours.get_parameter(name).copy_(value)
    return ours, hf


def _hf_grads(hf, tp: int = 1, tp_rank: int = 0) -> dict:
    """transformers' parameter gradients under our parameter names (TP rank ``tp_rank``'s part)."""
    return _rank_slices(hf, tp, tp_rank)


def _packed_params(cu, cu_pad):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu_t = torch.tensor(cu, dtype=torch.int32)
    pad_t = torch.tensor(cu_pad, dtype=torch.int32) if cu_pad is not None else None
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_t, cu_seqlens_kv=cu_t, cu_seqlens_q_padded=pad_t,
                           cu_seqlens_kv_padded=pad_t, max_seqlen_q=0, max_seqlen_kv=0)


def _reference(hf, hidden, cu, cu_pad, weight):
    """transformers' layer on each sample alone: (output [T, h] with zero padding rows, hidden's grad)."""
    hidden = hidden.detach().requires_grad_(True)
    out = torch.zeros(hidden.shape, dtype=hidden.dtype)
    for start, n in _samples(cu, cu_pad):
        out[start:start + n] = hf(hidden[None, start:start + n])[0]
    (out * weight).sum().backward()
    return out.detach(), hidden.grad


@pytest.fixture
def world_of_one():
    from megatron_pack.config.schema import Config
    from megatron_pack.model.cpu_compat import enable_cpu_compat_without_cuda
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel

    enable_cpu_compat_without_cuda()
    yield initialize_parallel(Config())
    destroy_parallel(destroy_process_group=True)


@pytest.mark.parametrize("cu,cu_pad", CASES, ids=IDS)
def test_layer_matches_transformers_per_sample(world_of_one, cu, cu_pad):
    """Packed forward and backward (inputs and every parameter) == transformers' layer on each sample alone."""
    ours, hf = _layers(world_of_one.pg_collection)
    total = (cu_pad or cu)[-1]
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(total, HIDDEN, generator=g)
    weight = torch.randn(total, HIDDEN, generator=g)
    ref, ref_hidden_grad = _reference(hf, hidden, cu, cu_pad, weight)

    x = hidden[:, None].clone().requires_grad_(True)
    out, bias = ours(x, None, packed_seq_params=_packed_params(cu, cu_pad))
    assert bias is None and out.shape == (total, 1, HIDDEN)
    torch.testing.assert_close(out[:, 0], ref, atol=1e-5, rtol=1e-5)
    assert float(ref.abs().max()) > 0.05 and not out[~_real_rows(cu, cu_pad), 0].any()
    (out[:, 0] * weight).sum().backward()
    torch.testing.assert_close(x.grad[:, 0], ref_hidden_grad, atol=1e-5, rtol=1e-5)
    expected = _hf_grads(hf)
    for name, param in ours.named_parameters():  # weight gradients sum ~160 float32 token terms: 5e-5
        torch.testing.assert_close(param.grad, expected[name], atol=5e-5, rtol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")
        assert float(param.grad.abs().max()) > 1e-3, name
    assert len(expected) == len(list(ours.named_parameters()))
    leaked = hf(hidden[None, :cu[-1]])[0] if cu_pad is None else None
    if leaked is not None:  # the whole pack as one sequence differs after the first sample
        assert float((leaked[cu[1]:] - ref[cu[1]:cu[-1]]).abs().max()) > 1e-3


def test_sbhd_columns_are_whole_sequences(world_of_one):
    """Without packed_seq_params each batch column [s, b, h] is one sequence (transformers on each column)."""
    ours, hf = _layers(world_of_one.pg_collection)
    hidden = torch.randn(2, 70, HIDDEN, generator=torch.Generator().manual_seed(6))
    out, _ = ours(hidden.transpose(0, 1).contiguous(), None)
    torch.testing.assert_close(out.transpose(0, 1), hf(hidden), atol=1e-5, rtol=1e-5)


def test_layer_in_a_transformer_layer_spec(world_of_one):
    """The hybrid stack's linear-attention layer: megatron-core's TransformerLayer built from our spec."""
    from megatron.core.transformer.spec_utils import build_module

    from megatron_pack.model.builder import local_block_spec
    from megatron_pack.model.linear_attention import PackedGatedDeltaNet, linear_attention_layer_spec

    config, _ = _configs()
    full = local_block_spec(1).layer_specs[0]
    layer = build_module(linear_attention_layer_spec(full), config=config, layer_number=1,
                         pg_collection=world_of_one.pg_collection)
    assert isinstance(layer.self_attention, PackedGatedDeltaNet)
    assert full.submodules.self_attention.module.__name__ == "SelfAttention"  # the full-attention spec untouched
    cu, cu_pad = [0, 150, 155], [0, 152, 160]
    hidden = torch.randn(160, 1, HIDDEN, generator=torch.Generator().manual_seed(4))
    packed, _ = layer(hidden, attention_mask=None, packed_seq_params=_packed_params(cu, cu_pad))
    alone, _ = layer(hidden[152:157], attention_mask=None, packed_seq_params=_packed_params([0, 5], None))
    torch.testing.assert_close(packed[152:157], alone, atol=1e-5, rtol=1e-5)


def test_hybrid_gpt_model_sample_after_a_long_one_equals_alone(world_of_one):
    """STYLE 24 on a whole model: three packed GDN layers then one full-attention layer (Qwen3.5's pattern) in
    megatron-core's GPTModel; a 5-token sample packed after a 150-token one gives its logits alone."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_pack.config.schema import Config, ModelConfig
    from megatron_pack.model.builder import local_block_spec, transformer_config_from
    from megatron_pack.model.linear_attention import PackedGatedDeltaNet, linear_attention_layer_spec
    from megatron_pack.model.rope import use_in_sequence_rope

    cfg = Config(model=ModelConfig(attention_backend="torch", num_layers=4, hidden_dropout=0.0))
    config = transformer_config_from(cfg)
    for name, value in (("linear_conv_kernel_dim", WIDTH), ("linear_key_head_dim", HEAD_DIM),
                        ("linear_value_head_dim", HEAD_DIM), ("linear_num_key_heads", KEY_HEADS),
                        ("linear_num_value_heads", VALUE_HEADS)):
        setattr(config, name, value)
    block = local_block_spec(4)
    full = block.layer_specs[0]
    block.layer_specs = [linear_attention_layer_spec(full)] * 3 + [full]
    torch.manual_seed(0)
    model = GPTModel(config=config, transformer_layer_spec=block, vocab_size=cfg.model.vocab_size,
                     max_sequence_length=cfg.model.seq_length, position_embedding_type="rope",
                     pg_collection=world_of_one.pg_collection)
    use_in_sequence_rope(model)
    assert sum(isinstance(m, PackedGatedDeltaNet) for m in model.modules()) == 3
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, cfg.model.vocab_size, (1, 160), generator=g)
    positions = torch.cat([torch.arange(152), torch.arange(8)])[None]
    packed = model(tokens, positions, None, packed_seq_params=_packed_params([0, 150, 155], [0, 152, 160]))
    alone = model(tokens[:, 152:157], positions[:, 152:157], None, packed_seq_params=_packed_params([0, 5], None))
    torch.testing.assert_close(packed[0, 152:157], alone[0], atol=1e-5, rtol=1e-5)
    joined = torch.cat([tokens[:, :150], tokens[:, 152:157]], dim=1)  # guard: one sequence, no boundary
    as_one = model(joined, torch.arange(155)[None], None, packed_seq_params=_packed_params([0, 155], None))
    assert float((as_one[0, 150:155] - alone[0]).abs().max()) > 1e-3


def test_checkpoint_layout_is_megatron_cores(world_of_one):
    """megatron-core's GDN sharded_state_dict: in_proj split into its six parts, conv1d into q, k, v."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    ours, _ = _layers(world_of_one.pg_collection)
    state = ours.sharded_state_dict(prefix="layers.0.self_attention.")
    params = {k for k in state if not k.endswith("_extra_state")}
    assert params == {f"layers.0.self_attention.{name}" for name, _ in ours.named_parameters()}
    assert all(isinstance(state[f"layers.0.self_attention.{n}"], ShardedTensorFactory)
               for n in ("in_proj.weight", "conv1d.weight"))


@pytest.mark.parametrize("requested,device,dtype,fla_installed,expected", [
    ("auto", "cpu", torch.bfloat16, True, "torch"),
    ("auto", "cuda", torch.bfloat16, True, "fla"),
    ("auto", "cuda", torch.float32, True, "torch"),
    ("auto", "cuda", torch.bfloat16, False, "torch"),
    ("torch", "cuda", torch.bfloat16, True, "torch"),
    ("fla", "cpu", torch.bfloat16, True, ValueError),
    ("fla", "cuda", torch.float32, True, ValueError),
    ("flash", "cpu", torch.float32, False, ValueError),
], ids=["auto_cpu", "auto_cuda_bf16", "auto_cuda_fp32", "auto_without_fla", "torch_forced", "fla_on_cpu_refused",
        "fla_fp32_refused", "unknown_refused"])
def test_kernel_choice(monkeypatch, requested, device, dtype, fla_installed, expected):
    """fla only on bfloat16/float16 CUDA tensors (its chunked kernel refuses float32), and only where it imports."""
    from megatron_pack.model import delta_rule

    monkeypatch.setattr(delta_rule, "_fla_chunk_gated_delta_rule", object() if fla_installed else None)
    if expected is ValueError:
        with pytest.raises(ValueError, match="kernel"):
            delta_rule.choose_kernel(requested, torch.device(device), dtype)
    else:
        assert delta_rule.choose_kernel(requested, torch.device(device), dtype) == expected


class _StandInFla:
    """What ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` computes with ``cu_seqlens`` (its varlen mode), written
    independently: inputs [1, T, H, d], every segment of ``cu_seqlens`` from a zero state, token by token (float64
    here); records each call's arguments. A CPU stand-in for the GPU kernel (fla needs CUDA and Triton)."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, g, beta, scale=None, cu_seqlens=None, use_qk_l2norm_in_kernel=False, **extra):
        # what fla's chunk_gated_delta_rule asserts (fla/ops/gated_delta_rule/chunk.py): one dtype for q, k, v; batch 1
        # and LongTensor boundaries in varlen mode; beta [B, T, H]
        assert q.dtype == k.dtype == v.dtype and q.size(0) == 1 and beta.dim() == 3
        assert cu_seqlens.dtype == torch.long and cu_seqlens.device == q.device
        self.calls.append({"cu_seqlens": cu_seqlens.tolist(), "l2norm": use_qk_l2norm_in_kernel, "extra": extra,
                           "shapes": [tuple(t.shape) for t in (q, k, v, g, beta)]})
        q, k, v, g, beta = (t[0] for t in (q, k, v, g, beta))
        scale = q.size(-1) ** -0.5 if scale is None else scale
        rows = []
        for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
            state = q.new_zeros(q.size(1), q.size(-1), v.size(-1))
            for t in range(start, end):
                state = state * g[t].exp()[:, None, None]
                delta = (v[t] - torch.einsum("hkv,hk->hv", state, k[t])) * beta[t][:, None]
                state = state + k[t][:, :, None] * delta[:, None, :]
                rows.append(torch.einsum("hkv,hk->hv", state, q[t] * scale))
        return torch.stack(rows)[None], None


@pytest.mark.parametrize("cu,cu_pad", CASES, ids=IDS)
def test_auto_dispatches_to_fla_where_it_imports_and_keeps_the_contract(monkeypatch, cu, cu_pad):
    """With fla importable and the tensors on CUDA in bfloat16 (``choose_kernel``'s own rule, asked as for such
    tensors: fla cannot run on a CPU), ``kernel='auto'`` calls fla's varlen kernel once, with the *padded* slot
    boundaries (zero-length slots dropped), queries and keys already L2-normalised (not again in the kernel), heads
    expanded, batch 1; the result is each sample's recurrence alone, padding rows zero and given no gradient."""
    from megatron_pack.model import delta_rule

    fla = _StandInFla()
    monkeypatch.setattr(delta_rule, "_fla_chunk_gated_delta_rule", fla)
    real_choice = delta_rule.choose_kernel
    monkeypatch.setattr(delta_rule, "choose_kernel",
                        lambda requested, device, dtype: real_choice(requested, torch.device("cuda"), torch.bfloat16))
    inputs = _kernel_inputs((cu_pad or cu)[-1])
    out = packed_gated_delta_rule(*inputs, cu, cu_pad, kernel="auto", use_qk_l2norm=True)
    total = (cu_pad or cu)[-1]
    assert fla.calls == [{"cu_seqlens": sorted(set(cu_pad or cu)), "l2norm": False, "extra": {},
                          "shapes": [(1, total, VALUE_HEADS, HEAD_DIM)] * 3 + [(1, total, VALUE_HEADS)] * 2}]
    ref = torch.zeros_like(out)
    for start, n in _samples(cu, cu_pad):
        ref[start:start + n] = _recurrence(*(t[start:start + n] for t in inputs))
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    assert not out[~_real_rows(cu, cu_pad)].any() and float(ref.abs().max()) > 0.1
    grads = torch.autograd.grad(out.square().sum(), inputs)
    assert all(not grad[~_real_rows(cu, cu_pad)].any() for grad in grads)
    torch.testing.assert_close(grads, torch.autograd.grad(ref.square().sum(), inputs), atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("installed", [True, False], ids=["fla_installed", "fla_absent"])
def test_fla_is_imported_guarded(monkeypatch, installed):
    """model/delta_rule.py imports fla's kernel when the package imports (the optional gpu extra) and is None
    otherwise; a fresh copy of the module is loaded with a stand-in package (or its absence) in ``sys.modules``."""
    import importlib.util
    import types

    from megatron_pack.model import delta_rule

    fla = _StandInFla()
    module = types.ModuleType("fla.ops.gated_delta_rule")
    module.chunk_gated_delta_rule = fla
    for name in ("fla", "fla.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name) if installed else None)
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", module if installed else None)
    spec = importlib.util.spec_from_file_location("_delta_rule_copy", delta_rule.__file__)
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)
    assert copy._fla_chunk_gated_delta_rule is (fla if installed else None)
    assert copy.choose_kernel("auto", torch.device("cuda"), torch.bfloat16) == ("fla" if installed else "torch")


# ---- context parallelism ---------------------------------------------------------------------------

PARALLEL_PACK = ([0, 150, 155, 164, 164, 164], [0, 152, 160, 172, 180, 180])
"""Short after long, padding, a pad_to_max_length tail slot and a fixed-length cu tail; slots divisible by 2*CP."""


def _parallel_worker(rank: int, world_size: int, tp: int, cp: int, sp: bool) -> dict:
    """This rank's output and gradients against transformers on each sample alone, both layers in float64 (but
    transformers' delta rule computes in float32, ~4e-6 here): the largest differences of the output and the input
    gradient, and of each parameter's gradient relative to its largest entry."""
    from megatron_pack.config.schema import Config, ParallelConfig
    from megatron_pack.model.cpu_compat import enable_cpu_compat_without_cuda
    from megatron_pack.parallel.comm import all_reduce
    from megatron_pack.parallel.cp import thd_partition_indices
    from megatron_pack.parallel.groups import initialize_parallel

    enable_cpu_compat_without_cuda()
    state = initialize_parallel(Config(parallel=ParallelConfig(
        tensor_model_parallel_size=tp, context_parallel_size=cp, sequence_parallel=sp)))
    ours, hf = _layers(state.pg_collection, tp=tp, tp_rank=state.tp_rank, sp=sp, dtype=torch.float64)
    cu, cu_pad = PARALLEL_PACK
    g = torch.Generator().manual_seed(3)
    hidden, weight = (torch.randn(cu_pad[-1], HIDDEN, generator=g, dtype=torch.float64) for _ in range(2))
    ref, ref_hidden_grad = _reference(hf, hidden, cu, cu_pad, weight)
    index = thd_partition_indices(torch.tensor(cu_pad), cp, state.cp_rank)
    if sp:  # sequence parallelism splits the (CP-local) rows evenly over TP
        index = index.chunk(tp)[state.tp_rank]
    x = hidden[index][:, None].clone().requires_grad_(True)
    out, _ = ours(x, None, packed_seq_params=_packed_params(cu, cu_pad))
    (out[:, 0] * weight[index]).sum().backward()
    result = {"out_err": (out[:, 0] - ref[index]).abs().max(),
              "grad_err": (x.grad[:, 0] - ref_hidden_grad[index]).abs().max(), "ref_max": ref[index].abs().max()}
    expected = _hf_grads(hf, tp, state.tp_rank)
    for name, param in ours.named_parameters():  # the step's DP x CP gradient all-reduce, by hand
        summed = all_reduce(param.grad.clone(), group=state.cp_group)  # error relative to the largest entry:
        result[f"param_err.{name}"] = (summed - expected[name]).abs().max() / expected[name].abs().max()
    return result


@pytest.mark.parametrize("tp,cp,sp", [(1, 2, False), (2, 1, False), (2, 1, True)], ids=["cp2", "tp2", "tp2_sp"])
def test_parallel_layouts_match_transformers(tmp_path, tp, cp, sp):
    """CP=2 (head split by all-to-all), TP=2 (heads split over TP), TP=2 with sequence parallelism, on gloo:
    each rank's rows, input gradients and (CP-summed) parameter gradients == transformers per sample."""
    results = spawn_world(_parallel_worker, tp * cp, tmp_path, tp, cp, sp)
    for rank, result in enumerate(results):
        assert float(result["ref_max"]) > 0.05, rank
        errors = {key: float(value) for key, value in result.items() if key.endswith("err") or "err." in key}
        assert len(errors) == 8 and max(errors.values()) < 2e-5, (rank, errors)
