"""gpt-oss in and out: a tiny random GptOssForCausalLM through our packed THD model, proved against transformers.

The folder (4 layers: windowed, full, windowed, full; sliding_window 8; a learnable sink per head; YaRN with factor 4
over an original context of 64 positions, truncate false; 4 experts, top 2; biases on q/k/v/o, the router and every
expert; clamp 7 and offset 1 in the experts' gate) is transformers' own model, every parameter drawn so that a
dropped bias, sink or clamp would show. One pack of a 47-token sample, a 20-token one and a 58-token one (windows
shorter than the samples) runs at world 1; each sample's logits must equal transformers' logits of the sample alone.
Each gpt-oss feature is checked to matter (transformers' logits change without it).
"""

from __future__ import annotations

import json

import pytest
import torch

VOCAB = 301


def _config(**extra):
    import transformers as T

    return T.GptOssConfig(**{**dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        max_position_embeddings=256, rope_theta=10000.0,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                      "original_max_position_embeddings": 64},
        bos_token_id=1, eos_token_id=2, pad_token_id=0), **extra})


def _folder(root) -> str:
    import transformers as T

    from _hf import save_tokenizer

    torch.manual_seed(0)
    model = T.GptOssForCausalLM(_config())
    with torch.no_grad():  # transformers starts the router, the sinks and the biases at 0: draw them all
        for name, param in model.named_parameters():
            scale = (1.0 if name.endswith(("sinks", "router.weight", "router.bias", "norm.weight"))
                     else 0.3 if "bias" in name else 0.1)  # matrices small: logits O(1), float32 agrees to 1e-5
            param.copy_(scale * torch.randn(param.shape))
    path = root / "gpt_oss"
    model.save_pretrained(path)
    save_tokenizer(path)
    return str(path)


def _samples() -> list[list[int]]:
    gen = torch.Generator().manual_seed(4)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() + [2] for n in (47, 20, 58)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return _folder(tmp_path_factory.mktemp("gpt_oss"))


def _packed_logits(folder: str, overrides: tuple[str, ...] = ()) -> list[torch.Tensor]:
    return packed_logits_world_1(folder, _samples(), VOCAB, overrides)


def packed_logits_world_1(folder: str, samples: list[list[int]], vocab: int, overrides: tuple[str, ...] = ()
                          ) -> list[torch.Tensor]:
    """Each sample's logits [n - 1, vocab] from one pack of ``samples`` at world 1 (padded to multiples of 4)."""
    from megatron_pack.config import load_config
    from megatron_pack.data.batches.thd import collate_thd
    from megatron_pack.model.builder import build_model
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.training.step import get_packed_seq_params

    batch = collate_thd([{"input_ids": ids, "loss_mask": [1] * len(ids)} for ids in samples], pack_size=160,
                        pad_multiple=4)
    cu, cu_pad = batch["cu_seqlens"].tolist(), batch["cu_seqlens_padded"].tolist()
    cfg = load_config([f"model.pretrained={folder}", "model.attention_backend=torch", "train.device=cpu", *overrides])
    try:
        model = build_model(cfg, initialize_parallel(cfg))
        with torch.no_grad():
            logits = model(batch["tokens"], batch["position_ids"], None, packed_seq_params=get_packed_seq_params(batch))
    finally:
        destroy_parallel(destroy_process_group=True)
    return [logits[0, cu_pad[s]:cu_pad[s] + cu[s + 1] - cu[s], :vocab] for s in range(len(cu) - 1)]


def test_packed_logits_equal_transformers_per_sample_at_world_1(folder):
    from _hf import hf_logits

    refs = hf_logits(folder, [ids[:-1] for ids in _samples()])
    assert all(len(ref) > 8 for ref in refs)  # every sample is longer than the window
    for s, (got, ref) in enumerate(zip(_packed_logits(folder), refs)):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5, msg=f"sample {s}")


LAYOUTS = {  # id: overrides of a 2-rank world (the biased experts stay whole under TP: expert TP 1, EP 2)
    "cp2": ("parallel.context_parallel_size=2",),
    "ep2": ("parallel.expert_model_parallel_size=2",),
    "tp2_sp_ep2": ("parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true",
                   "parallel.expert_model_parallel_size=2", "parallel.expert_tensor_parallel_size=1"),
}


def _worker(rank: int, world_size: int, folder: str) -> dict:
    from megatron_pack.config import load_config
    from megatron_pack.config.validate import validate
    from megatron_pack.data.batches.thd import collate_thd
    from megatron_pack.model.builder import build_model
    from megatron_pack.parallel.cp import slice_thd_batch
    from megatron_pack.parallel.groups import destroy_parallel, gather_full_logits, initialize_parallel
    from megatron_pack.training.step import get_packed_seq_params

    samples = [{"input_ids": ids, "loss_mask": [1] * len(ids)} for ids in _samples()]
    batch = collate_thd(samples, pack_size=128, pad_multiple=4)
    cu, cu_pad = batch["cu_seqlens"].tolist(), batch["cu_seqlens_padded"].tolist()
    out = {}
    for name, layout in LAYOUTS.items():
        cfg = load_config([f"model.pretrained={folder}", "model.attention_backend=torch", "train.device=cpu",
                           "peft.method=none", *layout])
        validate(cfg, world_size=world_size)
        pg = initialize_parallel(cfg)
        model = build_model(cfg, pg)
        local = slice_thd_batch(batch, pg.cp_size, pg.cp_rank)
        with torch.no_grad():
            logits = model(local["tokens"], local["position_ids"], None, packed_seq_params=get_packed_seq_params(batch))
        full = gather_full_logits(logits, batch["cu_seqlens_padded"], pg)[0, :, :VOCAB]
        for s in range(len(cu) - 1):
            out[f"{name}_{s}"] = full[cu_pad[s]:cu_pad[s] + cu[s + 1] - cu[s]].numpy()
        destroy_parallel()
    out.update(pipeline_logits(folder, [*_samples(), SHORT_AFTER_LONG], VOCAB))
    return out


SHORT_AFTER_LONG = [7, 19, 33, 2]
"""A 4-token sample after the 58-token one in the PP=2 pack: shorter than the window (8), which would reach back
into the long sample if it crossed the boundary."""


def pipeline_logits(folder: str, samples: list[list[int]], vocab: int) -> dict:
    """Each sample's logits from one pack at PP=2 (two layers a stage: megatron-core's forward-only schedule, the
    first stage's activations sent to the second; ``cli.verify.schedule_logits``), on the last stage; {} elsewhere."""
    from megatron_pack.cli.verify import build_chunks, schedule_logits
    from megatron_pack.config import load_config
    from megatron_pack.config.validate import validate
    from megatron_pack.data.batches.thd import collate_thd
    from megatron_pack.model.cpu_compat import enable_cpu_compat_without_cuda
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel

    batch = collate_thd([{"input_ids": ids, "loss_mask": [1] * len(ids)} for ids in samples], pack_size=160)
    cu = batch["cu_seqlens"].tolist()
    cfg = load_config([f"model.pretrained={folder}", "model.attention_backend=torch", "train.device=cpu",
                       "peft.method=none", "parallel.pipeline_model_parallel_size=2"])
    validate(cfg, world_size=2)
    enable_cpu_compat_without_cuda()
    pg = initialize_parallel(cfg)
    chunks = build_chunks(cfg, pg)
    layers = [layer.layer_number for layer in chunks[0].decoder.layers]
    logits, _ = schedule_logits(chunks, [batch], pg, 160)
    destroy_parallel()
    if logits is None:
        return {"pp2_layers": layers}
    return {"pp2_layers": layers, **{f"pp2_{s}": logits[0][cu[s]:cu[s + 1], :vocab].numpy() for s in range(len(cu) - 1)}}


def test_packed_logits_equal_transformers_per_sample_at_cp2_ep2_tp2_and_pp2(folder, tmp_path):
    """The same pack at CP=2, at EP=2 (two experts a rank) and at TP=2 with sequence parallelism and EP=2: every rank
    gives each sample transformers' logits of the sample alone. At PP=2 (layers 1-2 on rank 0, 3-4 on rank 1) the
    last stage gives them too, for a pack that also ends with a sample shorter than the window."""
    from _dist import spawn_world
    from _hf import hf_logits

    results = spawn_world(_worker, 2, tmp_path, folder, timeout_s=300)
    refs = hf_logits(folder, [ids[:-1] for ids in [*_samples(), SHORT_AFTER_LONG]])
    for rank, res in enumerate(results):
        for layout in LAYOUTS:
            for s, ref in enumerate(refs[:3]):
                torch.testing.assert_close(torch.as_tensor(res[f"{layout}_{s}"]), ref, atol=1e-5, rtol=1e-5,
                                           msg=f"rank {rank} {layout} sample {s}")
    assert [r["pp2_layers"].tolist() for r in results] == [[1, 2], [3, 4]]
    assert not any(k.startswith("pp2_") and k != "pp2_layers" for k in results[0])
    for s, ref in enumerate(refs):
        torch.testing.assert_close(torch.as_tensor(results[1][f"pp2_{s}"]), ref, atol=1e-5, rtol=1e-5,
                                   msg=f"pp2 sample {s}")


FEATURES = {  # id: transformers config change that removes one gpt-oss feature (its logits must then change)
    "window": dict(sliding_window=4096),
    "yarn": dict(rope_scaling=None),
    "yarn_truncate": dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True,
                       "original_max_position_embeddings": 64}),
    "clamp": dict(swiglu_limit=0.5),
}


@pytest.mark.parametrize("change", FEATURES.values(), ids=FEATURES.keys())
def test_each_gpt_oss_feature_changes_transformers_logits(folder, change):
    """Guard: the comparison above would fail if our model ignored any one of these."""
    from _hf import logit_change

    assert logit_change(folder, _config(**change), torch.tensor([_samples()[0][:-1]])) > 1e-3


TENSORS = {  # id: (HF tensor whose values are zeroed, must change transformers' logits)
    "sinks": "model.layers.0.self_attn.sinks",
    "router_bias": "model.layers.0.mlp.router.bias",
    "expert_up_bias": "model.layers.1.mlp.experts.gate_up_proj_bias",
    "expert_down_bias": "model.layers.1.mlp.experts.down_proj_bias",
    "o_proj_bias": "model.layers.2.self_attn.o_proj.bias",
}


@pytest.mark.parametrize("name", TENSORS.values(), ids=TENSORS.keys())
def test_each_gpt_oss_tensor_changes_transformers_logits(folder, name):
    import transformers as T

    ids = torch.tensor([_samples()[0][:-1]])
    model = T.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        ref = model(ids).logits
        model.get_parameter(name).zero_()
        other = model(ids).logits
    assert float((ref - other).abs().max()) > 1e-3


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_export_gives_back_the_folder_bit_for_bit_and_transformers_loads_it(folder, tmp_path, tp):
    """Through every transform and back (at TP=2 the experts' interleaved gate/up split per rank), then
    transformers loads the folder and gives the source's logits."""
    import transformers as T
    from safetensors.torch import load_file

    from megatron_pack.config import load_config
    from megatron_pack.model.hf.export import export_folder, shards_from_pretrained

    cfg = load_config([f"model.pretrained={folder}", "train.device=cpu"])
    shards = shards_from_pretrained(folder, cfg.model, tp=tp)
    assert shards[0]["decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"].shape == (2 * 48 // tp, 64)
    export_folder(output=tmp_path / "out", source=folder, model_cfg=cfg.model, shards=shards)
    want = load_file(f"{folder}/model.safetensors")
    got = {}
    for path in (tmp_path / "out").glob("*.safetensors"):
        got.update(load_file(path))
    assert sorted(got) == sorted(want)
    assert [k for k in got if not torch.equal(got[k], want[k])] == []
    ids = torch.tensor([_samples()[1][:-1]])
    with torch.no_grad():
        ref = T.AutoModelForCausalLM.from_pretrained(folder).eval()(ids).logits
        out = T.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()(ids).logits
    torch.testing.assert_close(out, ref, atol=0, rtol=0)


def test_the_folder_check_reads_stacked_experts(folder):
    """The folder check (before launch, headers only) knows the stacked expert tensors' shapes."""
    from megatron_pack.model.hf.folder_check import folder_problems
    from megatron_pack.model.hf.rules import hf_shapes

    shapes = hf_shapes(json.loads(open(f"{folder}/config.json").read()))
    assert shapes["model.layers.0.mlp.experts.gate_up_proj"] == (4, 64, 96)
    assert shapes["model.layers.0.mlp.experts.down_proj_bias"] == (4, 64)
    assert folder_problems(folder) == []


HUB_20B = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
           "attention_dropout": 0.0, "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64,
           "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096, "intermediate_size": 2880,
           "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
           "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
           "num_local_experts": 32, "pad_token_id": 199999, "rms_norm_eps": 1e-05,
           "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                            "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
           "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
           "tie_word_embeddings": False, "vocab_size": 201088}
"""openai/gpt-oss-20b config.json as published, less its quantization_config (the MXFP4 one is refused below)."""


def test_hub_config_becomes_model_keys():
    import math

    from megatron_pack.config.hf_config import derive_model_keys, refusal

    assert refusal(HUB_20B, "x") is None
    keys = derive_model_keys(HUB_20B)
    expected = dict(window_size=[127, 0], window_attn_skip_freq=2, softmax_type="learnable", num_experts=32,
                    moe_router_topk=4, moe_ffn_hidden_size=2880, moe_router_pre_softmax=False, add_qkv_bias=True,
                    add_bias_linear=True, activation="quick_geglu", glu_linear_offset=1.0, activation_clamp=7.0,
                    rope_scaling="yarn", rope_scaling_factor=32.0, rope_original_max_position_embeddings=4096,
                    rope_yarn_truncate=False, rotary_base=150000, kv_channels=64, num_query_groups=8,
                    untie_embeddings_and_output_weights=True)
    assert {k: keys[k] for k in expected} == expected
    assert keys["softmax_scale"] == pytest.approx((0.1 * math.log(32) + 1) ** 2 / 8)


MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.embed_tokens"]}


@pytest.mark.parametrize("change,fragment", [
    (dict(quantization_config={"quant_method": "bitsandbytes"}), "dequantise it with transformers and save it in bf16"),
    (dict(swiglu_alpha=1.5), "swiglu_alpha=1.5"),
    (dict(attention_bias=False), "attention_bias=false"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope_type 'dynamic' is not supported for gpt_oss"),
    (dict(layer_types=["full_attention", "sliding_attention"] * 12), "not every N-th layer full_attention"),
], ids=["other_quantisation", "alpha", "no_attention_bias", "dynamic_rope", "full_first"])
def test_what_gpt_oss_cannot_read_is_refused_in_one_line(change, fragment, tmp_path):
    from _hf import config_refusal

    message = config_refusal(tmp_path, {**HUB_20B, **change})
    assert fragment in message and "\n" not in message


@pytest.mark.parametrize("overrides,fragment", [
    (("parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"), "biased experts split over expert TP"),
], ids=["experts_over_tp"])
def test_what_the_layout_cannot_do_with_gpt_oss_is_refused_before_launch(folder, overrides, fragment):
    from megatron_pack.config import ConfigError, load_config
    from megatron_pack.config.validate import validate

    with pytest.raises(ConfigError) as info:  # load_config runs the rules it can; validate the world-size ones
        validate(load_config([f"model.pretrained={folder}", "train.device=cpu", *overrides]), world_size=2)
    assert any(fragment in line for line in str(info.value).splitlines())


LORA = {  # id: (peft.target_modules, adapters)
    "attention": ("[linear_qkv,linear_proj]", 4 * 2),
    "attention_and_experts": ("[linear_qkv,linear_proj,linear_fc1,linear_fc2]", 4 * (2 + 2 * 4)),
}


@pytest.mark.parametrize("targets,num_adapters", LORA.values(), ids=LORA.keys())
def test_lora_exports_to_peft_and_transformers_gives_our_logits(folder, tmp_path, targets, num_adapters):
    """LoRA on the attention (4 layers x 2 adapters), and on every expert's linear_fc1 / linear_fc2 too (peft's
    target_parameters on the stacked gate_up_proj, whose gate and up columns interleave, and down_proj); B drawn
    away from 0 so the adapters act: the peft folder the export writes, on transformers' GptOssForCausalLM, gives
    each sample our packed logits, and reads back to our adapter tensors exactly; the merged export (base plus
    adapters, in transformers' layout) gives peft's logits."""
    from _hf import peft_logits, spread_lora_outputs
    import transformers as T

    from megatron_pack.config import load_config
    from megatron_pack.data.batches.thd import collate_thd
    from megatron_pack.model.builder import build_model
    from safetensors.torch import load_file

    from megatron_pack.model.peft.export import export_adapter, export_merged, shards_from_peft
    from megatron_pack.model.peft.lora import adapter_state
    from megatron_pack.model.peft.meta import peft_meta
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.training.step import get_packed_seq_params

    batch = collate_thd([{"input_ids": ids, "loss_mask": [1] * len(ids)} for ids in _samples()], pack_size=128)
    cu = batch["cu_seqlens"].tolist()
    cfg = load_config([f"model.pretrained={folder}", "model.attention_backend=torch", "train.device=cpu",
                       "peft.method=lora", f"peft.target_modules={targets}", "peft.dropout=0"])
    try:
        model = build_model(cfg, initialize_parallel(cfg))
        spread_lora_outputs(model, scale=0.02, seed=None)
        with torch.no_grad():
            logits = model(batch["tokens"], batch["position_ids"], None, packed_seq_params=get_packed_seq_params(batch))
    finally:
        destroy_parallel(destroy_process_group=True)
    assert model.num_adapters == num_adapters
    ours = {k: v.detach() for k, v in adapter_state(model).items()}
    export_adapter(output=tmp_path / "adapter", shards=[ours], peft=peft_meta(cfg), source=folder, model_cfg=cfg.model)
    back = shards_from_peft(load_file(tmp_path / "adapter" / "adapter_model.safetensors"), "gpt_oss", cfg.model,
                            cfg.peft.target_modules, tp_rank=0, tp_size=1)
    assert sorted(back) == sorted(ours) and all(torch.equal(back[k], ours[k]) for k in ours)
    refs, tuned = peft_logits(folder, tmp_path / "adapter", _samples())
    for s, ref in enumerate(refs):
        torch.testing.assert_close(logits[0, cu[s]:cu[s + 1], :VOCAB], ref, atol=1e-5, rtol=1e-5, msg=f"sample {s}")
    export_merged(output=tmp_path / "merged", shards=[ours], peft=peft_meta(cfg), source=folder, base=folder,
                  model_cfg=cfg.model)  # base + (alpha / r) B A, written as transformers' layout
    merged = T.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        ids = torch.tensor([_samples()[1][:-1]])
        torch.testing.assert_close(merged(ids).logits, tuned(ids).logits, atol=1e-5, rtol=1e-5)


GRADS = {  # our parameter: transformers' (its gradient under the summed token loss of every sample must match)
    "decoder.layers.0.self_attention.core_attention.softmax_offset": "model.layers.0.self_attn.sinks",
    "decoder.layers.2.self_attention.linear_proj.bias": "model.layers.2.self_attn.o_proj.bias",
    "decoder.layers.1.mlp.router.bias": "model.layers.1.mlp.router.bias",
    "decoder.layers.3.mlp.experts.local_experts.2.linear_fc2.bias": "model.layers.3.mlp.experts.down_proj_bias[2]",
}


def test_gradients_of_sinks_and_biases_equal_transformers(folder):
    """A training step's backward at world 1 (EP 1: the biased experts' output is their own tensor, which
    megatron-core then changes in place): the gradients of a sink, an o_proj bias, a router bias and an expert's
    bias under the summed token loss equal transformers' summed over the samples run alone, in float64 (the
    reference carries no rounding of its own; the core's sink gradient against a plain-torch float64 loop:
    tests/unit/test_attention_reach.py)."""
    import transformers as T

    from megatron_pack.config import load_config
    from megatron_pack.data.batches.thd import collate_thd
    from megatron_pack.model.builder import build_model
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.training.step import get_packed_seq_params

    batch = collate_thd([{"input_ids": ids, "loss_mask": [1] * len(ids)} for ids in _samples()], pack_size=128)
    cfg = load_config([f"model.pretrained={folder}", "model.attention_backend=torch", "train.device=cpu"])
    try:
        model = build_model(cfg, initialize_parallel(cfg))
        losses = model(batch["tokens"], batch["position_ids"], None, packed_seq_params=get_packed_seq_params(batch),
                       labels=batch["labels"])  # per-token loss [1, T]
        (losses * batch["loss_mask"]).sum().backward()
    finally:
        destroy_parallel(destroy_process_group=True)
    ours = dict(model.named_parameters())
    hf = T.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, experts_implementation="eager").train()
    total = 0
    for ids in _samples():
        logits = hf(torch.tensor([ids[:-1]])).logits[0]
        total = total + torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum")
    total.backward()
    for name, hf_name in GRADS.items():
        base, _, expert = hf_name.partition("[")
        want = hf.get_parameter(base).grad
        want = want[int(expert[:-1])] if expert else want
        assert float(want.abs().max()) > 1e-4, hf_name  # guard: the parameter matters
        torch.testing.assert_close(ours[name].grad.double(), want, atol=1e-5, rtol=1e-5, msg=name)


def _mxfp4_folder(root) -> str:
    """A tiny gpt-oss folder as the Hub's are: its experts' gate_up_proj / down_proj stored MXFP4 (random FP4 codes,
    scales 2^-8..2^-4), everything else float32; FFN 64 (MXFP4 packs 32 values a block)."""
    import transformers as T
    from safetensors.torch import load_file, save_file

    from _hf import save_tokenizer

    torch.manual_seed(0)
    path = root / "gpt_oss_mxfp4"
    T.GptOssForCausalLM(_config(intermediate_size=64)).save_pretrained(path)
    gen = torch.Generator().manual_seed(1)
    tensors = {}
    for name, value in load_file(path / "model.safetensors").items():
        if name.endswith(("gate_up_proj", "down_proj")):
            experts, rows, cols = value.shape  # x @ W: [E, in, out]; MXFP4 stores [E, out, in / 32, 16]
            tensors[name + "_blocks"] = torch.randint(0, 256, (experts, cols, rows // 32, 16), generator=gen,
                                                      dtype=torch.uint8)
            tensors[name + "_scales"] = torch.randint(119, 124, (experts, cols, rows // 32), generator=gen,
                                                      dtype=torch.uint8)
        else:
            tensors[name] = (1.0 if name.endswith(("sinks", "router.weight", "router.bias", "norm.weight")) else
                             0.3 if "bias" in name else 0.1) * torch.randn(value.shape, generator=gen)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = MXFP4
    (path / "config.json").write_text(json.dumps(config))
    save_tokenizer(path)
    return str(path)


def test_an_mxfp4_folder_loads_dequantised_as_transformers_does_and_exports_plain(tmp_path):
    """The Hub's layout: our packed logits of each sample equal transformers' of the folder loaded with
    Mxfp4Config(dequantize=True) (1e-5); the folder check passes it; export writes plain tensors and a config.json
    without quantization_config, which transformers loads to the same logits."""
    import transformers as T

    from megatron_pack.config import load_config
    from megatron_pack.model.hf.export import export_folder, shards_from_pretrained
    from megatron_pack.model.hf.folder_check import folder_problems

    folder = _mxfp4_folder(tmp_path)
    assert folder_problems(folder) == []
    ref_model = T.AutoModelForCausalLM.from_pretrained(folder, quantization_config=T.Mxfp4Config(dequantize=True),
                                                       dtype=torch.float32).eval()
    with torch.no_grad():
        refs = [ref_model(torch.tensor([ids[:-1]])).logits[0] for ids in _samples()]
    assert float(ref_model.model.layers[0].mlp.experts.gate_up_proj.abs().max()) > 0  # guard: experts are read
    for s, (got, ref) in enumerate(zip(_packed_logits(folder), refs)):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5, msg=f"sample {s}")
    cfg = load_config([f"model.pretrained={folder}", "train.device=cpu"])
    export_folder(output=tmp_path / "out", source=folder, model_cfg=cfg.model,
                  shards=shards_from_pretrained(folder, cfg.model, tp=1))
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    plain = T.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(torch.tensor([_samples()[1][:-1]])).logits[0], refs[1], atol=0, rtol=0)


def test_mxfp4_without_transformers_integration_and_other_quantisations_are_refused_in_one_line(tmp_path, monkeypatch):
    from megatron_pack.config.hf_config import UnsupportedModel, families, pretrained_model_keys

    cases = {"mxfp4_no_integration": (MXFP4, "which is not installed; install it, or dequantise"),
             "fp8": ({"quant_method": "fp8"}, "dequantise it with transformers and save it in bf16")}
    monkeypatch.setattr(families, "mxfp4_integration", lambda: False)
    for case, (quantization, fragment) in cases.items():
        (tmp_path / "config.json").write_text(json.dumps({**HUB_20B, "quantization_config": quantization}))
        with pytest.raises(UnsupportedModel) as info:
            pretrained_model_keys(tmp_path)
        assert fragment in str(info.value) and "\n" not in str(info.value), case
