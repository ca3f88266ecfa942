"""Sliding windows and attention sinks of the THD core (``model/attention_reach.py``, ``thd_attention``).

The reference is a float64 loop written from the rule alone ("the query at position p of a sample reads that
sample's keys max(0, p - left)..p, plus one sink logit per head"), sharing no code with the kernel. Windows
(left 7: 8 keys) are shorter than the samples (20-60 tokens), so a window measured from the pack's start, one
that crossed into the previous sample, or none at all changes the answer; each case checks that it does.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _dist import spawn_world
from megatron_pack.model.attention import thd_attention
from megatron_pack.parallel.cp import thd_partition_indices

torch.use_deterministic_algorithms(True)
LEFT = 7  # window (7, 0): 8 keys, transformers' sliding_window=8


def _reference(q, k, v, cu, cu_pad, left=None, sink=None):
    """float64 attention of every real query row, one query and one key at a time; padded rows stay 0."""
    q, k, v = q.double(), k.double(), v.double()
    rep, scale = q.size(1) // k.size(1), 1.0 / math.sqrt(q.size(-1))
    out = torch.zeros(q.shape, dtype=torch.float64)
    rows = []
    for s in range(len(cu) - 1):
        for p in range(cu[s + 1] - cu[s]):
            lo = 0 if left is None else max(0, p - left)
            keys = [cu_pad[s] + j for j in range(lo, p + 1)]
            rows.append(torch.stack([_one_query(q[cu_pad[s] + p, h], k[keys, h // rep], v[keys, h // rep], scale,
                                                None if sink is None else sink[h]) for h in range(q.size(1))]))
            out = out.index_put((torch.tensor([cu_pad[s] + p]),), rows[-1][None])
    return out


def _one_query(q, k, v, scale, sink):
    logits = k @ q * scale
    if sink is not None:
        logits = torch.cat([logits, sink.double().reshape(1)])
    probs = torch.softmax(logits, dim=0)[:k.size(0)]
    return probs @ v


def _pack(lengths, pad=0):
    cu, cu_pad = [0], [0]
    for n in lengths:
        cu.append(cu[-1] + n)
        cu_pad.append(cu_pad[-1] + n + pad)
    return cu, cu_pad


def _qkv(total, heads=4, kv_heads=2, dim=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(total, h, dim, generator=g, dtype=dtype) for h in (heads, kv_heads, kv_heads)]


CASES = {  # id: (sample lengths, padding after each, sink)
    "window_three_samples": ([20, 45, 33], 0, None),
    "short_after_long": ([50, 5], 0, None),          # the second sample is shorter than the window
    "long_after_short_padded": ([6, 41, 23], 3, None),  # padded slots between samples
    "sink_learnable_window": ([20, 37], 0, "learnable"),
    "sink_off_by_one_window": ([33, 21], 2, "off-by-one"),
    "long_sample_in_blocks": ([300, 20], 1, "learnable"),  # 300 queries: read in blocks of 128 (attention.py)
}


def _sink(kind, heads=4):
    if kind is None:
        return None
    if kind == "off-by-one":
        return torch.zeros(heads)
    return torch.tensor([-1.0, 0.5, 2.0, 0.0])


@pytest.mark.parametrize("lengths,pad,sink_kind", CASES.values(), ids=CASES.keys())
def test_window_matches_float64_reference(lengths, pad, sink_kind):
    cu, cu_pad = _pack(lengths, pad)
    q, k, v = _qkv(cu_pad[-1])
    sink = _sink(sink_kind)
    out = thd_attention(q, k, v, cu, cu_pad, window_size=(LEFT, 0), sink=sink)
    torch.testing.assert_close(out.double(), _reference(q, k, v, cu, cu_pad, LEFT, sink), atol=2e-6, rtol=1e-5)
    full = thd_attention(q, k, v, cu, cu_pad, sink=sink)
    first = list(range(min(lengths[0], LEFT + 1)))  # rows whose window reaches the sample's start: unchanged
    torch.testing.assert_close(out[first], full[first], atol=1e-6, rtol=1e-5)
    assert float((out - full).abs().max()) > 1e-2  # the window changed the answer (the case is not vacuous)


@pytest.mark.parametrize("lengths,pad", [([50, 5], 0), ([60, 9], 1), ([23, 12, 30], 2)],
                         ids=["shorter_than_window", "one_past_window", "three_samples"])
def test_window_never_crosses_a_boundary_nor_starts_at_the_pack(lengths, pad):
    """Every sample in the pack equals itself alone (a window measured from the pack's start, or one that read
    the previous sample's keys, would differ); the later samples sit far from the pack's start."""
    cu, cu_pad = _pack(lengths, pad)
    q, k, v = _qkv(cu_pad[-1], seed=3)
    out = thd_attention(q, k, v, cu, cu_pad, window_size=(LEFT, 0), sink=_sink("learnable"))
    for s, n in enumerate(lengths):
        rows = slice(cu_pad[s], cu_pad[s + 1])
        alone = thd_attention(q[rows], k[rows], v[rows], [0, n], [0, n + pad], window_size=(LEFT, 0),
                              sink=_sink("learnable"))
        torch.testing.assert_close(out[rows], alone, atol=0, rtol=0)
    leaky = _leaky_window(q, k, v, cu, cu_pad)  # what crossing the boundary would give: different
    second = slice(cu_pad[1], cu_pad[1] + min(lengths[1], LEFT))
    assert float((leaky[second] - out[second]).abs().max()) > 1e-2


def _leaky_window(q, k, v, cu, cu_pad):
    """The wrong attention a pack-wide window gives (keys p-left..p of the pack, whatever sample they are in)."""
    return thd_attention(q, k, v, [0, cu_pad[-1]], [0, cu_pad[-1]], window_size=(LEFT, 0), sink=_sink("learnable"))


def test_sink_gradients_match_float64_reference():
    """d/d(q, k, v, sink) of the windowed, sunk attention equal the float64 reference's, and gradcheck passes."""
    cu, cu_pad = _pack([21, 9], 1)
    q, k, v = (t.requires_grad_() for t in _qkv(cu_pad[-1], dtype=torch.float64))
    sink = torch.tensor([-1.0, 0.5, 2.0, 0.0], dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    got = torch.autograd.grad((thd_attention(q, k, v, cu, cu_pad, window_size=(LEFT, 0), sink=sink) * grad_out).sum(),
                              (q, k, v, sink))
    want = torch.autograd.grad((_reference(q, k, v, cu, cu_pad, LEFT, sink) * grad_out).sum(), (q, k, v, sink))
    for name, a, b in zip("qkvs", got, want):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9, msg=f"grad of {name}")
    assert float(got[3].abs().min()) > 1e-4  # every head's sink received a gradient
    small = [t.detach()[:6].clone().requires_grad_() for t in (q, k, v)] + [sink.detach().clone().requires_grad_()]
    assert torch.autograd.gradcheck(
        lambda a, b, c, d: thd_attention(a, b, c, [0, 4, 5], [0, 5, 6], window_size=(2, 0), sink=d), small)


@pytest.mark.parametrize("cp,cu,cu_pad", [(2, [0, 37, 48, 70], [0, 40, 52, 76]), (4, [0, 37, 48, 70], [0, 40, 56, 80]),
                                          (2, [0, 290, 301], [0, 292, 304])], ids=["cp2", "cp4", "cp2_blocks"])
def test_cp_zigzag_rows_use_global_positions(cp, cu, cu_pad):
    """Each rank's zigzag queries read the keys their global positions allow: equal to the full pack's rows
    (each sample padded to a multiple of 2*CP; a 290-token sample puts 146 queries of a rank in two blocks)."""
    q, k, v = _qkv(cu_pad[-1], seed=cp)
    full = thd_attention(q, k, v, cu, cu_pad, window_size=(LEFT, 0), sink=_sink("learnable"))
    for rank in range(cp):
        rows = thd_partition_indices(torch.tensor(cu_pad), cp, rank)
        local = thd_attention(q[rows], k, v, cu, cu_pad, query_index=rows, window_size=(LEFT, 0),
                              sink=_sink("learnable"))
        torch.testing.assert_close(local, full[rows], atol=1e-6, rtol=1e-5)
    assert float(full.abs().sum(dim=(1, 2)).gt(0).sum()) == cu[-1]


def test_bad_windows_and_sinks_name_the_problem():
    q, k, v = _qkv(8)
    with pytest.raises(ValueError, match="window_size"):
        thd_attention(q, k, v, [0, 8], [0, 8], window_size=(3, 2))
    with pytest.raises(ValueError, match="one logit per query head"):
        thd_attention(q, k, v, [0, 8], [0, 8], sink=torch.zeros(3))


HF_VOCAB = 301


def _mistral_window_folder(root) -> str:
    """A tiny random Mistral with sliding_window=LEFT+1 (transformers' own model, saved with a tokenizer)."""
    import transformers as T

    from _hf import save_tokenizer

    torch.manual_seed(0)
    config = T.MistralConfig(vocab_size=HF_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                             rms_norm_eps=1e-6, sliding_window=LEFT + 1, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = T.MistralForCausalLM(config)
    with torch.no_grad():  # norms away from 1 so a dropped norm would show
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.3 * torch.randn(param.shape))
    path = root / "mistral_window"
    model.save_pretrained(path)
    save_tokenizer(path)
    return str(path)


def _hf_samples() -> list[list[int]]:
    gen = torch.Generator().manual_seed(4)
    return [torch.randint(3, HF_VOCAB, (n,), generator=gen).tolist() + [2] for n in (47, 9, 30)]


def _mistral_cp2_logits(folder: str) -> dict:
    """Our CP=2 THD forward of the Mistral folder on one pack of ``_hf_samples``: each sample's logits."""
    from megatron_pack.config import load_config
    from megatron_pack.data.batches.thd import collate_thd
    from megatron_pack.model.builder import build_model
    from megatron_pack.parallel.cp import slice_thd_batch
    from megatron_pack.parallel.groups import destroy_parallel, gather_full_logits, initialize_parallel
    from megatron_pack.training.step import get_packed_seq_params

    cfg = load_config([f"model.pretrained={folder}", "model.attention_backend=torch",
                       "parallel.context_parallel_size=2", "train.device=cpu"])
    assert cfg.model.window_size == [LEFT, 0]
    pg = initialize_parallel(cfg)
    model = build_model(cfg, pg)
    samples = [{"input_ids": ids, "loss_mask": [1] * len(ids)} for ids in _hf_samples()]
    batch = collate_thd(samples, pack_size=128, pad_multiple=4)
    local = slice_thd_batch(batch, pg.cp_size, pg.cp_rank)
    with torch.no_grad():
        logits = model(local["tokens"], local["position_ids"], None, packed_seq_params=get_packed_seq_params(batch))
    full = gather_full_logits(logits, batch["cu_seqlens_padded"], pg)[0, :, :HF_VOCAB]
    destroy_parallel()
    cu, cu_pad = batch["cu_seqlens"].tolist(), batch["cu_seqlens_padded"].tolist()
    return {f"mistral{s}": full[cu_pad[s]:cu_pad[s] + cu[s + 1] - cu[s]].numpy() for s in range(len(cu) - 1)}


def _model_worker(rank: int, world_size: int, folder: str) -> dict:
    """The tiny GPTModel (layer 1 windowed, layer 2 full, learnable sinks) at CP=1 and CP=2 on the same pack;
    then the Mistral folder with a window at CP=2."""
    import torch.distributed as dist

    import numpy as np

    from _dist import full_param
    from _packs import random_packs
    from megatron_pack.config.schema import Config, ModelConfig, ParallelConfig, TrainConfig
    from megatron_pack.data.batches.thd import collate_thd
    from megatron_pack.model.builder import build_model
    from megatron_pack.parallel.cp import slice_thd_batch
    from megatron_pack.parallel.groups import destroy_parallel, gather_full_logits, initialize_parallel
    from megatron_pack.training.step import get_packed_seq_params

    samples = random_packs(11, 1, samples=(3, 4), length=(20, 60))[0]
    batch = collate_thd(samples, pack_size=256, pad_multiple=4)
    out = {"cu_seqlens": batch["cu_seqlens"].numpy(), "cu_seqlens_padded": batch["cu_seqlens_padded"].numpy()}
    for name, cp, tp, window in (("cp1", 1, 1, [LEFT, 0]), ("cp2", 2, 1, [LEFT, 0]), ("tp2", 1, 2, [LEFT, 0]),
                                 ("full", 1, 1, None)):
        cfg = Config(model=ModelConfig(attention_backend="torch", window_size=window,
                                       window_attn_skip_freq=2 if window else None, softmax_type="learnable"),
                     train=TrainConfig(seed=1234), parallel=ParallelConfig(context_parallel_size=cp, tensor_model_parallel_size=tp))
        pg = initialize_parallel(cfg)
        model = build_model(cfg, pg)
        local = slice_thd_batch(batch, pg.cp_size, pg.cp_rank)
        args = (local["tokens"], local["position_ids"], None)
        losses = model(*args, packed_seq_params=get_packed_seq_params(batch), labels=local["labels"])
        (losses * local["loss_mask"]).sum().backward()
        with torch.no_grad():
            logits = model(*args, packed_seq_params=get_packed_seq_params(batch))
        out[f"{name}_logits"] = gather_full_logits(logits, batch["cu_seqlens_padded"], pg)[0].numpy()
        for pname, param in model.named_parameters():
            grad = param.grad.detach().clone()
            if cp > 1:
                dist.all_reduce(grad, group=pg.cp_group)
            out[f"{name}_grad_{pname}"] = full_param(grad, param, pg).numpy()  # TP shards gathered
        if name == "tp2":  # the checkpoint sees each rank's sink logits as its slice of the global [heads]
            sharded = model.sharded_state_dict()
            sinks = [sharded[k] for k in sharded if k.endswith("softmax_offset")]
            out["tp2_sink_shards"] = np.array([[*t.global_shape, *t.global_offset, *t.local_shape] for t in sinks])
        if name == "cp1":  # each sample alone through the same model
            for s, sample in enumerate(samples):
                alone = collate_thd([sample], pack_size=len(sample["input_ids"]) - 1)
                with torch.no_grad():
                    out[f"alone{s}"] = model(alone["tokens"], alone["position_ids"], None,
                                             packed_seq_params=get_packed_seq_params(alone))[0].numpy()
        destroy_parallel()
    return {**out, **_mistral_cp2_logits(folder)}


def test_model_cp2_equals_cp1_samples_alone_and_transformers(tmp_path):
    """GPTModel with windows and learnable sinks: CP=2 and TP=2 logits and gradients (the sinks' included) equal
    CP=1's;
    each sample's logits in the pack equal the sample alone; the window changes the logits. A Mistral folder
    with sliding_window=8, packed at CP=2, gives transformers' logits of each sample alone (the first sample is
    longer than the window, the second shorter, after it)."""
    from _hf import hf_logits

    folder = _mistral_window_folder(tmp_path)
    res = spawn_world(_model_worker, 2, tmp_path, folder, timeout_s=300)[0]
    refs = hf_logits(folder, [ids[:-1] for ids in _hf_samples()])
    import transformers as T

    no_window = T.AutoModelForCausalLM.from_pretrained(folder, sliding_window=None).eval()
    with torch.no_grad():
        first_full = no_window(torch.tensor([_hf_samples()[0][:-1]])).logits[0]
    assert float((first_full - refs[0]).abs().max()) > 1e-3  # transformers' window matters for this sample
    for s, ref in enumerate(refs):
        torch.testing.assert_close(torch.as_tensor(res[f"mistral{s}"]), ref, atol=1e-4, rtol=1e-4)
    for layout in ("cp2", "tp2"):
        torch.testing.assert_close(res[f"{layout}_logits"], res["cp1_logits"], atol=1e-5, rtol=1e-5)
    grads = [k[len("cp1_grad_"):] for k in res if k.startswith("cp1_grad_")]
    sinks = [g for g in grads if g.endswith("softmax_offset")]
    assert len(sinks) == 2 and all(abs(res["cp1_grad_" + g]).min() > 0 for g in sinks)
    # rank 0's sink shards: global [layers 2, heads 4], at (layer, head 0), 2 heads long
    assert res["tp2_sink_shards"].tolist() == [[2, 4, 0, 0, 2], [2, 4, 1, 0, 2]]
    for layout in ("cp2", "tp2"):  # TP=2: the sink logits split over ranks with the heads, gathered back
        for g in grads:
            torch.testing.assert_close(res[f"{layout}_grad_{g}"], res["cp1_grad_" + g], atol=1e-6, rtol=1e-5,
                                       msg=f"{layout} {g}")
    cu, cu_pad = res["cu_seqlens"].tolist(), res["cu_seqlens_padded"].tolist()
    assert max(b - a for a, b in zip(cu, cu[1:])) > 2 * LEFT  # windows shorter than the samples
    for s in range(len(cu) - 1):
        n = cu[s + 1] - cu[s]
        torch.testing.assert_close(res["cp1_logits"][cu_pad[s]:cu_pad[s] + n], res[f"alone{s}"][:n],
                                   atol=1e-5, rtol=1e-5)
    assert abs(res["full_logits"] - res["cp1_logits"]).max() > 1e-3


def _cfg(backend="auto", cp=1, comm="p2p", **model):
    from megatron_pack.config.schema import Config, ModelConfig, ParallelConfig

    return Config(model=ModelConfig(attention_backend=backend, num_query_groups=4, **model),
                  parallel=ParallelConfig(context_parallel_size=cp, cp_comm_type=comm))


TE_CASES = {  # id: (te version, cp, cp_comm_type, model keys, backend, fragments of the one problem; () = passes)
    "sink_te_2_7": ("2.7.1", 1, "p2p", {"softmax_type": "learnable"}, "auto",
                    ("model.softmax_type (learnable) needs Transformer Engine >= 2.8.0, but 2.7.1 is installed",)),
    "sink_te_2_8": ("2.8.0", 1, "p2p", {"softmax_type": "learnable"}, "te", ()),
    "window_te_cp2_p2p": ("2.9.0", 2, "p2p", {"window_size": [7, 0]}, "te",
                          ("model.window_size ([7, 0]) with Transformer Engine under context parallelism",
                           "set parallel.cp_comm_type=a2a")),
    "sink_te_cp2_allgather": ("2.9.0", 2, "allgather", {"softmax_type": "off-by-one"}, "auto",
                              ("model.softmax_type (off-by-one) with Transformer Engine", "model.attention_backend=torch")),
    "window_te_cp2_a2a": ("2.9.0", 2, "a2a", {"window_size": [7, 0], "softmax_type": "learnable"}, "te", ()),
    "window_torch_cp2_p2p": ("2.7.1", 2, "p2p", {"window_size": [7, 0], "softmax_type": "learnable"}, "torch", ()),
}


@pytest.mark.parametrize("te_version,cp,comm,model,backend,fragments", TE_CASES.values(), ids=TE_CASES.keys())
def test_te_path_refuses_what_it_cannot_do_before_launch(te_version, cp, comm, model, backend, fragments):
    from megatron_pack.config.host import Host
    from megatron_pack.config.schema import ConfigError
    from megatron_pack.config.validate import validate

    host = Host(gpu=True, transformer_engine=True, transformer_engine_version=te_version)
    cfg = _cfg(backend, cp, comm, **model)
    validate(cfg, world_size=cp)  # the config alone is fine: only this host's TE path refuses it
    if not fragments:
        validate(cfg, world_size=cp, host=host)
        return
    with pytest.raises(ConfigError) as err:
        validate(cfg, world_size=cp, host=host)
    problems = [p for p in err.value.problems if "model.window_size" in p or "model.softmax_type" in p]
    assert len(problems) == 1 and all(f in problems[0] for f in fragments), err.value.problems


FIELD_CASES = {  # id: (model keys, fragment of the problem; None = valid)
    "window_ok": ({"window_size": [7, 0], "window_attn_skip_freq": 2}, None),
    "window_right_refused": ({"window_size": [7, 3]}, "model.window_size ([7, 3]) must be [left, 0]"),
    "window_negative": ({"window_size": [-1, 0]}, "model.window_size ([-1, 0]) must be [left, 0] with left >= 0"),
    "window_one_number": ({"window_size": [7]}, "model.window_size ([7]) must be [left, 0]"),
    "skip_without_window": ({"window_attn_skip_freq": 2}, "model.window_size is null"),
    "skip_one": ({"window_size": [7, 0], "window_attn_skip_freq": 1}, "model.window_attn_skip_freq (1) must be"),
    "softmax_unknown": ({"softmax_type": "sparsemax"}, "model.softmax_type"),
}


@pytest.mark.parametrize("model,fragment", FIELD_CASES.values(), ids=FIELD_CASES.keys())
def test_window_and_sink_keys_are_validated(model, fragment):
    from megatron_pack.config.schema import ConfigError, ModelConfig

    if fragment is None:
        ModelConfig(**model)
        return
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        ModelConfig(**model)


def test_transformer_config_carries_windows_and_sinks():
    from megatron_pack.model.builder import transformer_config_from

    config = transformer_config_from(_cfg("torch", window_size=[7, 0], window_attn_skip_freq=6,
                                          softmax_type="learnable"))
    assert (config.window_size, config.window_attn_skip_freq, config.softmax_type) == ((7, 0), 6, "learnable")


@pytest.mark.parametrize("window,expected", [(4096, [4095, 0]), (None, None)], ids=["v0.1", "v0.3"])
def test_mistral_sliding_window_becomes_model_window_size(window, expected):
    from megatron_pack.config.hf_config import derive_model_keys

    hf = {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
          "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
          "rope_theta": 10000.0, "sliding_window": window}
    keys = derive_model_keys(hf)
    assert keys["window_size"] == expected and keys["window_attn_skip_freq"] is None
    assert keys["softmax_type"] == "vanilla"


def test_long_windowed_sample_is_read_in_blocks(monkeypatch):
    """A 300-token sample under a window of 8 runs as blocks of 128 queries, each reading at most 128 + 7 keys
    (the guard that the block path of the cases above ran)."""
    import megatron_pack.model.attention as attention

    calls = []
    real = attention._sequence_attention
    monkeypatch.setattr(attention, "_sequence_attention",
                        lambda q, k, *a, **kw: calls.append((q.size(0), k.size(0))) or real(q, k, *a, **kw))
    q, k, v = _qkv(321)
    thd_attention(q, k, v, [0, 300, 320], [0, 301, 321], window_size=(LEFT, 0))
    assert calls == [(128, 128), (128, 135), (44, 51), (20, 20)]


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(0, 40), min_size=1, max_size=4), left=st.integers(0, 12),
       cp=st.sampled_from([1, 2, 4]), sink=st.booleans())
def test_any_pack_equals_its_samples_alone_at_any_cp(lengths, left, cp, sink):
    """Property: with any lengths, window and CP, each sample's rows equal the sample alone (bit for bit at
    CP=1), and every CP rank's zigzag rows equal the full pack's."""
    mult = 2 * cp if cp > 1 else 1
    cu, cu_pad = [0], [0]
    for n in lengths:
        cu.append(cu[-1] + n)
        cu_pad.append(cu_pad[-1] + max(mult, -(-n // mult) * mult))
    q, k, v = _qkv(cu_pad[-1], seed=left)
    kwargs = {"window_size": (left, 0), "sink": _sink("learnable") if sink else None}
    full = thd_attention(q, k, v, cu, cu_pad, **kwargs)
    for s, n in enumerate(lengths):
        rows = slice(cu_pad[s], cu_pad[s + 1])
        alone = thd_attention(q[rows], k[rows], v[rows], [0, n], [0, cu_pad[s + 1] - cu_pad[s]], **kwargs)
        torch.testing.assert_close(full[rows], alone, atol=0, rtol=0)
    for rank in range(cp if cp > 1 else 0):
        rows = thd_partition_indices(torch.tensor(cu_pad), cp, rank)
        torch.testing.assert_close(thd_attention(q[rows], k, v, cu, cu_pad, query_index=rows, **kwargs), full[rows],
                                   atol=1e-6, rtol=1e-5)


def test_packed_window_and_sink_equal_transformers_gpt_oss_attention_per_sample():
    """transformers' gpt-oss attention (its eager kernel with ``module.sinks``, its sliding-window mask function
    with sliding_window=8) on each sample alone equals our packed rows: the window and sink conventions are
    transformers', not only our reference's."""
    from types import SimpleNamespace

    from transformers.masking_utils import sliding_window_causal_mask_function
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    cu, cu_pad = _pack([45, 6, 28], 2)
    q, k, v = _qkv(cu_pad[-1], dtype=torch.float64, seed=9)
    sinks = torch.tensor([-1.0, 0.5, 2.0, 0.0], dtype=torch.float64)
    out = thd_attention(q, k, v, cu, cu_pad, window_size=(LEFT, 0), sink=sinks)
    module = SimpleNamespace(num_key_value_groups=2, sinks=sinks, training=False)
    allowed = sliding_window_causal_mask_function(LEFT + 1)
    for s in range(len(cu) - 1):
        n, start = cu[s + 1] - cu[s], cu_pad[s]
        idx = torch.arange(n)
        mask = allowed(0, 0, idx[:, None], idx[None, :])
        bias = torch.zeros(n, n, dtype=torch.float64).masked_fill(~mask, float("-inf"))
        rows = slice(start, start + n)
        ref, _ = eager_attention_forward(module, *(t[rows].transpose(0, 1)[None] for t in (q, k, v)), bias[None, None],
                                         scaling=1.0 / math.sqrt(q.size(-1)))
        torch.testing.assert_close(out[rows], ref[0], atol=1e-12, rtol=1e-10)
    assert int(mask.sum()) < n * (n + 1) // 2  # the last sample (28 tokens) is longer than the window


@pytest.mark.parametrize("override,agrees", [("model.window_size=[7,0]", False), ("model.softmax_type=learnable", False),
                                             ("model.window_size=[4095,0]", True)],
                         ids=["window_on_full_model", "sink_on_vanilla_model", "mistral_own_window"])
def test_a_pretrained_folder_decides_windows_and_sinks(tmp_path, override, agrees):
    """A window or sink typed on the command line must agree with model.pretrained's config.json (a Mistral with
    sliding_window=4096 here): it never silently changes a pretrained model's attention."""
    import json

    from megatron_pack.config import load_config
    from megatron_pack.config.schema import ConfigError

    hf = {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "vocab_size": 320, "hidden_size": 64,
          "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "rope_theta": 10000.0, "sliding_window": 4096 if agrees or "softmax" in override else None}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    argv = [f"model.pretrained={tmp_path}", override]
    if agrees:
        assert load_config(argv).model.window_size == [4095, 0]
        return
    with pytest.raises(ConfigError, match="contradicts"):
        load_config(argv)
