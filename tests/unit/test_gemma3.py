"""Gemma 3 (text) in and out: a tiny random Gemma3ForCausalLM through our packed THD model, proved against transformers.

The folder (4 layers: three windowed, then one full; sliding_window 8; local RoPE base 10000, global 1e6 with
linear scaling 8; query_pre_attn_scalar 24 != head_dim 16; tied embeddings; every norm weight drawn away from 0)
is transformers' own model. One pack of a 47-token sample, a 9-token one and a 30-token one (windows shorter than
the samples) runs at world 1, CP=2, TP=2 and PP=2 on gloo; each sample's logits must equal transformers' logits
of the sample alone. Each Gemma feature is checked to matter (transformers' logits change without it), the export gives back the
folder's tensors bit for bit, and LoRA adapters attach to every linear without changing the logits at init.
"""

from __future__ import annotations

import json

import pytest
import torch

from _dist import spawn_world

VOCAB = 301


def _config(**extra):
    import transformers as T

    return T.Gemma3TextConfig(**{**dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=8, sliding_window_pattern=4,
        rope_scaling={"rope_type": "linear", "factor": 8.0}, rope_local_base_freq=10000.0, rope_theta=1e6,
        max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0), **extra})


def _folder(root) -> str:
    import transformers as T

    from _hf import save_tokenizer

    torch.manual_seed(0)
    model = T.Gemma3ForCausalLM(_config())
    with torch.no_grad():  # Gemma's norms start at 0 (scale 1 + w): draw them so a dropped norm would show
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(0.3 * torch.randn(param.shape))
    path = root / "gemma3"
    model.save_pretrained(path)
    save_tokenizer(path)
    return str(path)


def _samples() -> list[list[int]]:
    gen = torch.Generator().manual_seed(4)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() + [2] for n in (47, 9, 30)]


def _worker(rank: int, world_size: int, folder: str) -> dict:
    import numpy as np

    from megatron_pack.config import load_config
    from megatron_pack.data.batches.thd import collate_thd
    from megatron_pack.model.builder import build_model
    from megatron_pack.parallel.cp import slice_thd_batch
    from megatron_pack.parallel.groups import destroy_parallel, gather_full_logits, initialize_parallel
    from megatron_pack.training.step import get_packed_seq_params

    samples = [{"input_ids": ids, "loss_mask": [1] * len(ids)} for ids in _samples()]
    batch = collate_thd(samples, pack_size=128, pad_multiple=4)
    cu, cu_pad = batch["cu_seqlens"].tolist(), batch["cu_seqlens_padded"].tolist()
    out = {}
    for name, layout in (("cp2", "parallel.context_parallel_size=2"), ("tp2", "parallel.tensor_model_parallel_size=2")):
        cfg = load_config([f"model.pretrained={folder}", "model.attention_backend=torch", "train.device=cpu", layout])
        pg = initialize_parallel(cfg)
        model = build_model(cfg, pg)
        local = slice_thd_batch(batch, pg.cp_size, pg.cp_rank)
        with torch.no_grad():
            logits = model(local["tokens"], local["position_ids"], None, packed_seq_params=get_packed_seq_params(batch))
        full = gather_full_logits(logits, batch["cu_seqlens_padded"], pg)[0, :, :VOCAB]
        for s in range(len(cu) - 1):
            out[f"{name}_{s}"] = full[cu_pad[s]:cu_pad[s] + cu[s + 1] - cu[s]].numpy()
        if name == "tp2":  # what a checkpoint saves: every post-norm, replicated (global shape = local shape)
            sharded = model.sharded_state_dict()
            post = [sharded[k] for k in sharded if "post_layernorm" in k]
            out["tp2_post_norms"] = np.array([[*t.global_shape, *t.local_shape] for t in post])
        destroy_parallel()
    from test_gpt_oss import SHORT_AFTER_LONG, pipeline_logits

    out.update(pipeline_logits(folder, [*_samples(), SHORT_AFTER_LONG], VOCAB))
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return _folder(tmp_path_factory.mktemp("gemma3"))


def test_packed_logits_equal_transformers_per_sample_at_cp2_tp2_and_pp2(folder, tmp_path):
    """Our CP=2 and TP=2 logits of each sample in the pack equal transformers' of the sample alone; the TP=2
    model's checkpoint description holds every post-norm. At PP=2 the second stage holds layers 3 (windowed) and 4
    (full, the other RoPE base): its layers count from 3, or layer 4 would be windowed with the local base; the
    pack there also ends with a sample shorter than the window after the 47-token one."""
    from test_gpt_oss import SHORT_AFTER_LONG

    from _hf import hf_logits

    results = spawn_world(_worker, 2, tmp_path, folder, timeout_s=300)
    res = results[0]
    refs = hf_logits(folder, [ids[:-1] for ids in [*_samples(), SHORT_AFTER_LONG]])
    # attention's and MLP's in each of 4 layers: global [layers 4, hidden 64], local [64] (replicated over TP)
    assert res["tp2_post_norms"].tolist() == [[4, 64, 64]] * 8
    for layout in ("cp2", "tp2"):
        for s, ref in enumerate(refs[:3]):
            torch.testing.assert_close(torch.as_tensor(res[f"{layout}_{s}"]), ref, atol=1e-4, rtol=1e-4,
                                       msg=f"{layout} sample {s}")
    assert [r["pp2_layers"].tolist() for r in results] == [[1, 2], [3, 4]]
    for s, ref in enumerate(refs):
        torch.testing.assert_close(torch.as_tensor(results[1][f"pp2_{s}"]), ref, atol=1e-5, rtol=1e-5,
                                   msg=f"pp2 sample {s}")


def test_packed_logits_equal_transformers_per_sample_at_world_1(folder):
    from test_gpt_oss import SHORT_AFTER_LONG, packed_logits_world_1

    from _hf import hf_logits

    samples = [*_samples(), SHORT_AFTER_LONG]
    refs = hf_logits(folder, [ids[:-1] for ids in samples])
    assert sum(len(ref) > 8 for ref in refs) == 3 and len(refs[-1]) < 8  # three longer than the window, one shorter
    for s, (got, ref) in enumerate(zip(packed_logits_world_1(folder, samples, VOCAB), refs)):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5, msg=f"sample {s}")


FEATURES = {  # id: transformers config change that removes one Gemma feature (its logits must then change)
    "window": dict(sliding_window=4096),
    "local_rope_base": dict(rope_local_base_freq=1e6),
    "linear_rope_scaling": dict(rope_scaling=None),
    "query_pre_attn_scalar": dict(query_pre_attn_scalar=16),
}


@pytest.mark.parametrize("change", FEATURES.values(), ids=FEATURES.keys())
def test_each_gemma_feature_changes_transformers_logits(folder, change):
    """Guard: the comparison above would fail if our model ignored any one of these."""
    from _hf import logit_change

    assert logit_change(folder, _config(**change), torch.tensor([_samples()[0][:-1]])) > 1e-3


def test_export_gives_back_the_folder_bit_for_bit(folder, tmp_path):
    from safetensors.torch import load_file

    from megatron_pack.config import load_config
    from megatron_pack.model.hf.export import export_folder, shards_from_pretrained

    cfg = load_config([f"model.pretrained={folder}", "train.device=cpu"])
    shards = shards_from_pretrained(folder, cfg.model, tp=2)
    assert any(k.endswith("self_attention.post_layernorm.weight") for k in shards[0])
    export_folder(output=tmp_path / "out", source=folder, model_cfg=cfg.model, shards=shards)
    want = load_file(f"{folder}/model.safetensors")
    got = {}
    for path in (tmp_path / "out").glob("*.safetensors"):
        got.update(load_file(path))
    assert sorted(got) == sorted(k for k in want if k != "lm_head.weight")  # tied: lm_head is the embedding
    assert all(torch.equal(got[k], want[k]) for k in got)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["sliding_window"] == 8


def test_lora_attaches_to_every_linear_and_starts_as_the_base(folder):
    from megatron_pack.config import load_config
    from megatron_pack.data.batches.thd import collate_thd
    from megatron_pack.model.builder import build_model
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.training.step import get_packed_seq_params

    batch = collate_thd([{"input_ids": ids, "loss_mask": [1] * len(ids)} for ids in _samples()], pack_size=128)
    logits = {}
    try:
        for method in ("none", "lora"):
            cfg = load_config([f"model.pretrained={folder}", "model.attention_backend=torch", "train.device=cpu",
                               f"peft.method={method}"])
            model = build_model(cfg, initialize_parallel(cfg))
            with torch.no_grad():
                logits[method] = model(batch["tokens"], batch["position_ids"], None,
                                       packed_seq_params=get_packed_seq_params(batch))
            destroy_parallel()
    finally:
        destroy_parallel(destroy_process_group=True)
    assert model.num_adapters == 4 * 4  # qkv, proj, fc1, fc2 of 4 layers
    assert not any(p.requires_grad for n, p in model.named_parameters() if "post_layernorm" in n)
    torch.testing.assert_close(logits["lora"], logits["none"], atol=0, rtol=0)


HUB_1B = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 1152,
          "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
          "head_dim": 256, "vocab_size": 262144, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
          "rope_theta": 1000000, "rope_local_base_freq": 10000, "rope_scaling": None, "sliding_window": 512,
          "sliding_window_pattern": 6, "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh",
          "final_logit_softcapping": None, "attn_logit_softcapping": None, "torch_dtype": "bfloat16"}
"""google/gemma-3-1b-it config.json as published (transformers 4.x spelling)."""


@pytest.mark.parametrize("hf,expected", [
    (HUB_1B, dict(window_size=[511, 0], window_attn_skip_freq=6, rotary_base=1000000, rotary_base_local=10000,
                  rope_scaling="none", softmax_scale=256 ** -0.5, untie_embeddings_and_output_weights=False,
                  activation="geglu", zero_centered_norm=True, post_norms=True, scale_embeddings=True)),
    ({**HUB_1B, "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window": 1024},
     dict(window_size=[1023, 0], rope_scaling="linear", rope_scaling_factor=8.0)),
], ids=["1b", "linear_rope_1024_window"])
def test_hub_config_becomes_model_keys(hf, expected):
    from megatron_pack.config.hf_config import derive_model_keys, refusal

    assert refusal(hf, "x") is None
    keys = derive_model_keys(hf)
    assert {k: keys[k] for k in expected} == expected


@pytest.mark.parametrize("change,fragment", [
    (dict(layer_types=["sliding_attention", "full_attention", "full_attention"] + ["sliding_attention"] * 23),
     "not every N-th layer full_attention"),
    (dict(final_logit_softcapping=30.0), "final_logit_softcapping=30.0"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 8.0}), "rope_type 'yarn' is not supported for gemma3_text"),
    (dict(hidden_activation="gelu"), "hidden_activation='gelu'"),
], ids=["irregular_pattern", "softcapping", "yarn", "exact_gelu"])
def test_what_gemma3_cannot_read_is_refused_in_one_line(change, fragment, tmp_path):
    from megatron_pack.config.hf_config import UnsupportedModel, pretrained_model_keys

    (tmp_path / "config.json").write_text(json.dumps({**HUB_1B, **change}))
    with pytest.raises(UnsupportedModel) as info:
        pretrained_model_keys(tmp_path)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_12b_recipe_validates_for_a_gpu_host_with_transformer_engine(tmp_path):
    """The recipe's layout passes the TE rules too (windows under CP need cp_comm_type=a2a, which it sets)."""
    from test_recipes import _GEMMA3_12B_TEXT

    from megatron_pack.config import load_config
    from megatron_pack.config.host import Host
    from megatron_pack.config.validate import validate

    folder = tmp_path / "gemma-3-12b-it-text"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(_GEMMA3_12B_TEXT))
    cfg = load_config(["experiment=gemma3_12b_sft", "data.input=train.jsonl", f"model.pretrained={folder}",
                       "data.tokenizer=byte"], world_size=8)
    assert (cfg.model.window_size, cfg.model.window_attn_skip_freq, cfg.model.rope_scaling) == ([1023, 0], 6, "linear")
    validate(cfg, world_size=8, host=Host(gpu=True, transformer_engine=True, transformer_engine_version="2.9.0"))
