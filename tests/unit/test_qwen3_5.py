"""Qwen3.5 text, dense and MoE, in and out: tiny random Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM folders
(tests/_qwen3_5.py) through our packed THD model, proved against transformers.

A pack of a 47-, a 9- and a 30-token sample must give each sample's logits as transformers gives them for the sample
alone (float32), in a world of one and in a 2-rank world at CP=2, TP=2, TP=2 with sequence parallelism and PP=2 (the
MoE stack also at EP=2); a 5-token sample packed after a 150-token one must give its logits alone exactly (STYLE 24:
the recurrent state and the conv1d tail restart at the boundary); each Qwen3.5 feature is checked to change
transformers' logits (the comparison would see it dropped); the export gives the folder back bit for bit at TP=1 and
TP=2, and transformers loads it. LoRA (the MoE stack's experts through peft's target_parameters too) exports to peft
and transformers + PeftModel gives our logits, at world 1 and (MoE) read into CP=2, EP=2 and TP=2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _dist import spawn_world
from _qwen3_5 import LAYER_TYPES, VOCAB
from _qwen3_5 import make_dense_folder as _folder
from _qwen3_5 import make_moe_folder as _moe_folder
from _qwen3_5 import samples as _samples
from _qwen3_5 import text_config as _config


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return _folder(tmp_path_factory.mktemp("qwen3_5"))


def _packed_logits(model, batch) -> torch.Tensor:
    from megatron_pack.training.step import get_packed_seq_params

    with torch.no_grad():
        return model(batch["tokens"], batch["position_ids"], None,
                     packed_seq_params=get_packed_seq_params(batch))[0, :, :VOCAB]


@pytest.fixture
def world_of_one_model(folder):
    """build(overrides) -> our model of ``folder`` in a world of one (groups torn down after the test)."""
    from megatron_pack.config import load_config
    from megatron_pack.model.builder import build_model
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel

    def build(*overrides):
        cfg = load_config([f"model.pretrained={folder}", "model.attention_backend=torch", "train.device=cpu",
                           *overrides])
        destroy_parallel()
        return build_model(cfg, initialize_parallel(cfg))

    yield build
    destroy_parallel(destroy_process_group=True)


def test_packed_logits_equal_transformers_per_sample(folder, world_of_one_model):
    """World of one: each sample's logits in the pack equal transformers' of the sample alone (1e-5, float32)."""
    from _hf import hf_logits

    from megatron_pack.data.batches.thd import collate_thd
    from megatron_pack.model.linear_attention import PackedGatedDeltaNet

    model = world_of_one_model()
    kinds = [type(layer.self_attention).__name__ for layer in model.decoder.layers]
    assert kinds == ["PackedGatedDeltaNet"] * 3 + ["SelfAttention"]
    assert sum(isinstance(m, PackedGatedDeltaNet) for m in model.modules()) == 3
    samples = _samples()
    batch = collate_thd([{"input_ids": ids, "loss_mask": [1] * len(ids)} for ids in samples], pack_size=128,
                        pad_multiple=4)
    logits = _packed_logits(model, batch)
    cu, cu_pad = batch["cu_seqlens"].tolist(), batch["cu_seqlens_padded"].tolist()
    refs = hf_logits(folder, [ids[:-1] for ids in samples])
    assert len(refs) == 3 and cu_pad[1] > 0
    for s, ref in enumerate(refs):
        torch.testing.assert_close(logits[cu_pad[s]:cu_pad[s] + cu[s + 1] - cu[s]], ref, atol=1e-5, rtol=1e-5,
                                   msg=f"sample {s}")


def test_sample_after_a_long_one_gives_its_logits_alone(world_of_one_model):
    """STYLE 24 on the whole model: a 5-token sample packed after a 150-token one, exactly as alone."""
    from megatron_pack.data.batches.thd import collate_thd

    model = world_of_one_model()
    long, short = _samples((150, 5), seed=7)
    # both packs of one size (the same GEMM shapes): the short sample's rows may then not differ by a bit
    pack = collate_thd([{"input_ids": ids, "loss_mask": [1] * len(ids)} for ids in (long, short)], pack_size=160,
                       pad_multiple=8, pad_to_max_length=True)
    alone = collate_thd([{"input_ids": short, "loss_mask": [1] * len(short)}], pack_size=160, pad_multiple=8,
                        pad_to_max_length=True)
    start = int(pack["cu_seqlens_padded"][1])
    packed, single = _packed_logits(model, pack)[start:start + 5], _packed_logits(model, alone)[:5]
    torch.testing.assert_close(packed, single, atol=0, rtol=0)
    joined = collate_thd([{"input_ids": long[:-1] + short, "loss_mask": [1] * (len(long) - 1 + len(short))}],
                         pack_size=160)
    as_one = _packed_logits(model, joined)[150:155]  # guard: without the boundary the short sample's logits differ
    assert float((as_one - single).abs().max()) > 1e-3


LAYOUTS = {  # id: the parallel layout of a 2-rank world
    "cp2": ["parallel.context_parallel_size=2"],
    "tp2": ["parallel.tensor_model_parallel_size=2"],
    "tp2_sp": ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"],
    "pp2": ["parallel.pipeline_model_parallel_size=2"],  # layers 0-1 (linear) and 2-3 (linear, full attention)
}


MOE_LAYOUTS = {  # id: a 2-rank layout of the Qwen3.5-MoE stack (experts whole per rank at EP=2, split at TP=2)
    "cp2": ["parallel.context_parallel_size=2"],
    "tp2_sp": ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"],
    "ep2": ["parallel.expert_model_parallel_size=2"],
    "pp2": ["parallel.pipeline_model_parallel_size=2"],
}
MOE_LORA_LAYOUTS = {  # id: a 2-rank layout the Qwen3.5-MoE adapters (exported at world 1) are read into
    "cp2_lora": ["parallel.context_parallel_size=2"],
    "ep2_lora": ["parallel.expert_model_parallel_size=2"],
    "tp2_sp_lora": ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"],
}


def _layout_logits(cfg, state, batch, adapter=None):
    """The pack's whole logits [T, V] on the last stage (None elsewhere), through verify's schedule; with
    ``adapter``, this rank's part of a peft adapter folder read into the model first (``load_adapter``)."""
    from megatron_pack.cli.verify import build_chunks, schedule_logits
    from megatron_pack.config.hf_config import read_hf_config
    from megatron_pack.model.peft.export import load_adapter

    chunks = build_chunks(cfg, state)
    if adapter is not None:
        filled = load_adapter(chunks[0], adapter, read_hf_config(cfg.model.pretrained)["model_type"], cfg.model,
                              cfg.peft.target_modules, tp_rank=state.tp_rank, tp_size=state.tp_size,
                              ep_rank=state.ep_rank, ep_size=state.pg_collection.ep.size(), etp_rank=state.etp_rank,
                              etp_size=state.pg_collection.expt_tp.size())
        assert filled > 0
    logits, _ = schedule_logits(chunks, [batch], state, seq_length=128)
    return None if logits is None else logits[0]


def _layout_worker(rank: int, world_size: int, folder: str, moe_folder: str, moe_adapter: str) -> dict:
    """Each layout's logits of every sample of the pack, through megatron-core's forward-only schedule (as verify
    runs it: pipeline stages, TP, CP and EP gathered), on the ranks of the last stage: the dense stack's
    (``LAYOUTS``), the MoE stack's (``moe_`` + ``MOE_LAYOUTS``) and the MoE stack's with LoRA (``moe_`` +
    ``MOE_LORA_LAYOUTS``)."""
    from megatron_pack.config import load_config
    from megatron_pack.data.batches.thd import collate_thd
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel

    samples = [{"input_ids": ids, "loss_mask": [1] * len(ids)} for ids in _samples()]
    batch = collate_thd(samples, pack_size=128, pad_multiple=4)
    cu, cu_pad = batch["cu_seqlens"].tolist(), batch["cu_seqlens_padded"].tolist()
    lora = ["peft.method=lora", f"peft.target_modules={MOE_LORA_TARGETS}", "peft.dropout=0"]
    runs = [(name, folder, layout, None) for name, layout in LAYOUTS.items()]
    runs += [(f"moe_{name}", moe_folder, layout, None) for name, layout in MOE_LAYOUTS.items()]
    runs += [(f"moe_{name}", moe_folder, layout + lora, moe_adapter) for name, layout in MOE_LORA_LAYOUTS.items()]
    out = {}
    for name, path, layout, adapter in runs:
        cfg = load_config([f"model.pretrained={path}", "train.device=cpu", *layout])
        logits = _layout_logits(cfg, initialize_parallel(cfg), batch, adapter)
        if logits is not None:
            for s in range(len(cu) - 1):
                out[f"{name}_{s}"] = logits[cu_pad[s]:cu_pad[s] + cu[s + 1] - cu[s], :VOCAB].numpy()
        destroy_parallel()
    return out


@pytest.fixture(scope="module")
def layout_results(folder, moe_folder, moe_lora, tmp_path_factory) -> list[dict]:
    """One 2-rank gloo world runs every layout of both stacks (``_layout_worker``): one dict per rank."""
    results = spawn_world(_layout_worker, 2, tmp_path_factory.mktemp("layouts"), folder, moe_folder,
                          moe_lora["adapter"], timeout_s=300)
    assert len(results) == 2
    return results


def _check_layouts(results, refs, names, pp_names=()):
    """Every rank of the last stage of each layout gives each sample the reference logits (1e-5)."""
    held = {(rank, name) for rank, res in enumerate(results) for name in names if f"{name}_0" in res}
    assert held == {(r, name) for r in (0, 1) for name in names if name not in pp_names} | {
        (1, name) for name in pp_names}
    for rank, name in sorted(held):
        for s, ref in enumerate(refs):
            torch.testing.assert_close(torch.as_tensor(results[rank][f"{name}_{s}"]), ref, atol=1e-5, rtol=1e-5,
                                       msg=f"rank {rank} {name} sample {s}")


def test_packed_logits_equal_transformers_per_sample_at_cp2_tp2_and_pp2(folder, layout_results):
    """One 2-rank gloo world: at CP=2 (the linear layers trade the sequence split for a head split), TP=2, TP=2 with
    sequence parallelism and PP=2 (each stage builds its layers' kinds from their global index), every rank of the
    last stage gives each sample transformers' logits of the sample alone."""
    from _hf import hf_logits

    refs = hf_logits(folder, [ids[:-1] for ids in _samples()])
    assert len(refs) == 3
    _check_layouts(layout_results, refs, list(LAYOUTS), pp_names=("pp2",))


FEATURES = {  # id: transformers config change that removes one Qwen3.5 feature (its logits must then change)
    "partial_rotary": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                            "partial_rotary_factor": 1.0}),
    "hybrid_pattern": dict(layer_types=["linear_attention"] * 2 + ["full_attention"] * 2),
}


@pytest.mark.parametrize("change", FEATURES.values(), ids=FEATURES.keys())
def test_each_qwen3_5_feature_changes_transformers_logits(folder, change):
    """Guard: the comparison above would fail if our model ignored any one of these (the norms' centring and the
    output gate are exercised by the drawn weights: a dropped one changes every logit)."""
    from _hf import logit_change

    assert logit_change(folder, _config(**change), torch.tensor([_samples()[0][:-1]])) > 1e-3


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_export_gives_back_the_folder_bit_for_bit(folder, tmp_path, tp):
    """Every tensor of the folder through our layout (TP shards) and back, bit for bit; transformers loads it."""
    import transformers as T
    from safetensors.torch import load_file

    from megatron_pack.config import load_config
    from megatron_pack.model.hf.export import export_folder, shards_from_pretrained

    cfg = load_config([f"model.pretrained={folder}", "train.device=cpu"])
    shards = shards_from_pretrained(folder, cfg.model, tp=tp)
    assert any(k.endswith("self_attention.in_proj.weight") for k in shards[0])
    export_folder(output=tmp_path / "out", source=folder, model_cfg=cfg.model, shards=shards)
    want = load_file(f"{folder}/model.safetensors")
    got = {}
    for path in (tmp_path / "out").glob("*.safetensors"):
        got.update(load_file(path))
    assert sorted(got) == sorted(want) and len(got) > 40
    assert all(torch.equal(got[k], want[k]) for k in got)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["layer_types"] == LAYER_TYPES
    T.AutoModelForCausalLM.from_pretrained(tmp_path / "out")


LORA_TARGETS = "[linear_qkv,linear_proj,linear_fc1,linear_fc2,in_proj,out_proj]"


def test_lora_on_every_projection_exports_to_peft_and_transformers_gives_our_logits(folder, tmp_path):
    """LoRA on every linear, the Gated DeltaNet's in_proj / out_proj by name too (16 adapters), B drawn away from 0 so
    the adapters act: the peft folder export writes, on transformers' Qwen3_5ForCausalLM, gives each sample our packed
    logits (q_proj's adapter rows hold each head's query then gate rows, in_proj's split into in_proj_qkv/z/b/a)."""
    from _hf import peft_logits, spread_lora_outputs
    from safetensors.torch import load_file

    from megatron_pack.config import load_config
    from megatron_pack.data.batches.thd import collate_thd
    from megatron_pack.model.builder import build_model
    from megatron_pack.model.peft.export import export_adapter, peft_tensors, shards_from_peft
    from megatron_pack.model.peft.lora import adapter_state
    from megatron_pack.model.peft.meta import peft_meta
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.training.step import get_packed_seq_params

    batch = collate_thd([{"input_ids": ids, "loss_mask": [1] * len(ids)} for ids in _samples()], pack_size=128)
    cu = batch["cu_seqlens"].tolist()
    cfg = load_config([f"model.pretrained={folder}", "train.device=cpu", "peft.method=lora",
                       f"peft.target_modules={LORA_TARGETS}", "peft.dropout=0"])
    try:
        model = build_model(cfg, initialize_parallel(cfg))
        spread_lora_outputs(model)
        with torch.no_grad():
            logits = model(batch["tokens"], batch["position_ids"], None, packed_seq_params=get_packed_seq_params(batch))
    finally:
        destroy_parallel(destroy_process_group=True)
    assert model.num_adapters == 2 + 3 * 2 + 4 * 2  # qkv, proj (1 full layer); in, out (3 linear); fc1, fc2 (4)
    export_adapter(output=tmp_path / "adapter", shards=[{k: v.detach() for k, v in adapter_state(model).items()}],
                   peft=peft_meta(cfg), source=folder, model_cfg=cfg.model)
    targets = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["target_modules"]
    assert {"q_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "down_proj"} <= set(targets)
    written = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    tp2 = [shards_from_peft(written, "qwen3_5_text", cfg.model, cfg.peft.target_modules, tp_rank=r, tp_size=2)
           for r in range(2)]  # the adapters as TP=2 ranks hold them, and back: bit for bit
    back = peft_tensors(tp2, "qwen3_5_text", cfg.model, cfg.peft.target_modules)
    assert sorted(back) == sorted(written) and all(torch.equal(back[k], written[k]) for k in written)
    refs, tuned = peft_logits(folder, tmp_path / "adapter", _samples())
    for s, ref in enumerate(refs):
        torch.testing.assert_close(logits[0, cu[s]:cu[s + 1], :VOCAB], ref, atol=1e-5, rtol=1e-5, msg=f"sample {s}")


HUB_TEXT = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4,
            "head_dim": 256, "vocab_size": 248320, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
            "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
            "linear_num_key_heads": 16, "linear_num_value_heads": 32, "full_attention_interval": 4,
            "layer_types": LAYER_TYPES * 2, "tie_word_embeddings": False, "hidden_act": "silu",
            "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,  # no MTP head built (as transformers)
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                                "mrope_section": [11, 11, 10], "mrope_interleaved": True}}
"""A Qwen3.5 text stack's config.json (the Hub folders' text_config, eight layers) as transformers 5 writes it."""


HUB_MOE_TEXT = {**{k: v for k, v in HUB_TEXT.items() if k != "intermediate_size"},
                "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text", "hidden_size": 2048,
                "num_attention_heads": 16, "num_key_value_heads": 2,
                "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
                "shared_expert_intermediate_size": 512, "router_aux_loss_coef": 0.001}
"""A Qwen3.5-MoE text stack's config.json (transformers' default Qwen3_5MoeTextConfig sizes, eight layers): no
intermediate_size, the experts' and the shared expert's widths."""


@pytest.mark.parametrize("hf,expected", [
    (HUB_TEXT, dict(full_attention_interval=4, rotary_percent=0.25, rotary_base=10000000, attention_output_gate=True,
                    qk_layernorm=True, zero_centered_norm=True, linear_num_key_heads=16, linear_num_value_heads=32,
                    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, kv_channels=256,
                    untie_embeddings_and_output_weights=True)),
    ({k: v for k, v in HUB_TEXT.items() if k != "layer_types"}, dict(full_attention_interval=4)),
    (HUB_MOE_TEXT, dict(num_experts=256, moe_router_topk=8, moe_ffn_hidden_size=512, moe_router_pre_softmax=False,
                        moe_shared_expert_ffn_hidden_size=512, moe_shared_expert_gate=True, full_attention_interval=4,
                        attention_output_gate=True)),
], ids=["text_config", "interval_without_layer_types", "moe_text_config"])
def test_hub_config_becomes_model_keys(hf, expected):
    from megatron_pack.config.hf_config import derive_model_keys, refusal

    assert refusal(hf, "x") is None
    keys = derive_model_keys(hf)
    assert {k: keys[k] for k in expected} == expected


@pytest.mark.parametrize("change,fragment", [
    (dict(layer_types=["linear_attention", "full_attention", "full_attention"] + ["linear_attention"] * 5),
     "not every N-th layer full_attention"),
    (dict(model_type="qwen3_5", architectures=["Qwen3_5ForConditionalGeneration"]),
     "without vision_config and image_token_id"),
    (dict(attention_bias=True), "attention_bias=true"),
    (dict(layer_types=["sliding_attention"] * 8), "layer_types ['sliding_attention'] is not supported"),
], ids=["irregular_pattern", "vlm_without_vision", "attention_bias", "sliding"])
def test_what_qwen3_5_cannot_read_is_refused_in_one_line(change, fragment, tmp_path):
    from _hf import config_refusal

    message = config_refusal(tmp_path, {**HUB_TEXT, **change})
    assert fragment in message and "\n" not in message


@pytest.mark.parametrize("overrides,fragment", [
    (["model.attention_backend=te"], "built on the torch backend only"),
    (["parallel.tensor_model_parallel_size=2", "parallel.context_parallel_size=2"],
     "model.linear_num_key_heads (2) must be divisible"),
], ids=["te_backend", "heads_over_tp_cp"])
def test_what_the_hybrid_stack_cannot_run_is_refused_before_launch(folder, overrides, fragment):
    from megatron_pack.config import load_config
    from megatron_pack.config.schema import ConfigError

    with pytest.raises(ConfigError) as info:
        load_config([f"model.pretrained={folder}", "train.device=cpu", *overrides])
    assert fragment in str(info.value)


RECIPES = {  # recipe: (folder it names, its config.json at transformers' default sizes, world size, TP, CP, EP)
    "qwen3_5_text_sft": ("models/qwen3_5-text", {**HUB_TEXT, "num_hidden_layers": 32, "layer_types": LAYER_TYPES * 8},
                         8, 2, 2, 1),
    "qwen3_5_moe_text_sft": ("models/qwen3_5-moe-text", {**HUB_MOE_TEXT, "num_hidden_layers": 40,
                                                         "layer_types": LAYER_TYPES * 10}, 32, 2, 2, 16),
}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_recipe_builds_the_hybrid_stack_at_its_layout_and_states_its_memory_estimate(tmp_path, recipe):
    """configs/experiment/<recipe>.yaml at its world size on a folder of transformers' default sizes: the hybrid keys
    come from config.json, the Gated DeltaNet heads split over TP x CP, and the header states what ``train --check``
    estimates per rank, its Gated DeltaNet layers counted as such (more than if every layer were full attention)."""
    from dataclasses import replace

    from megatron_pack.config import load_config
    from megatron_pack.config.loader import config_dir
    from megatron_pack.training.memory_estimate import estimate_memory

    name, hub, world, tp, cp, ep = RECIPES[recipe]
    folder = tmp_path / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(hub))
    cfg = load_config([f"experiment={recipe}", f"model.pretrained={folder}", "data.tokenizer=byte",
                       "data.input=train.jsonl"], world_size=world)
    m, par = cfg.model, cfg.parallel
    assert (m.num_layers, m.full_attention_interval, m.rotary_percent, m.attention_output_gate) == (
        hub["num_hidden_layers"], 4, 0.25, True)
    assert (par.tensor_model_parallel_size, par.context_parallel_size, par.sequence_parallel,
            par.expert_model_parallel_size) == (tp, cp, True, ep)
    assert m.linear_num_key_heads % (tp * cp) == 0
    est = estimate_memory(cfg, world)
    gib = lambda v: f"{v / 2 ** 30:.2f}"  # noqa: E731
    header = " ".join(line.lstrip("# ") for line in (config_dir() / "experiment" / f"{recipe}.yaml").read_text()
                      .splitlines())
    assert (f"params {gib(est.params)}, grads {gib(est.grads)}, optimizer {gib(est.optimizer)}, activations "
            f"{gib(est.activations)}") in header and f"total {gib(est.total)} GiB" in header
    assert est.total < 80 * 2 ** 30  # an 80 GB GPU
    as_full = estimate_memory(replace(cfg, model=replace(m, full_attention_interval=None)), world)
    assert est.activations > as_full.activations  # the Gated DeltaNet's conv1d window and states are counted


def test_a_checkpoint_of_the_hybrid_stack_reads_back_as_the_model(world_of_one_model, tmp_path):
    """The layers hold different tensors, so megatron-core checkpoints them one by one (hetereogenous_dist_checkpoint;
    stacked over layers, a save failed), and its Gated DeltaNet splits in_proj / conv1d into named parts: the reader
    export and verify use gives back every parameter of the model, bit for bit."""
    from megatron_pack.training.checkpoint import read_full_model, save_checkpoint
    from megatron_pack.training.resharding import sharded_state

    model = world_of_one_model()
    path = save_checkpoint(tmp_path / "ckpt", 1, sharded_state=sharded_state([model], {}), rank_state={},
                           meta={"tensor_model_parallel_size": 1})
    full, params = read_full_model(path), dict(model.named_parameters())
    assert "decoder.layers.0.self_attention.in_proj.weight" in params and len(params) > 40
    assert sorted(full) == sorted(params)
    assert all(torch.equal(full[n], params[n]) for n in params)


def test_step_flops_count_the_linear_attention_layers():
    """The tiny model's 3 Gated DeltaNet layers and 1 gated full attention, counted by hand (flops.py's formulas):
    one 8-token sample."""
    from megatron_pack.config.hf_config import derive_model_keys
    from megatron_pack.config.schema import ModelConfig
    from megatron_pack.training.flops import forward_flops

    keys = derive_model_keys({**_config().to_dict(), "architectures": ["Qwen3_5ForCausalLM"]})
    m = ModelConfig(**{k: v for k, v in keys.items() if k in ModelConfig.__dataclass_fields__})
    h, a, g, f, n, v = 64, 64, 32, 96, 8, VOCAB
    mlp = 2 * 3 * h * f
    full = 2 * (h * (2 * a + 2 * g) + a * h) + mlp  # q and its gate, k, v; o_proj
    qk, vv, hv = 2 * 8, 4 * 8, 4
    linear = 2 * h * (2 * qk + 2 * vv + 2 * hv) + 2 * vv * h + 2 * 4 * (2 * qk + vv) + 6 * hv * 8 * 8 + mlp
    assert forward_flops(m, n, n * n) == full * n + 2 * a * n * n + 3 * linear * n + 2 * h * v * n


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_parameter_count_of_the_memory_estimate_is_the_models(folder, world_of_one_model, tp):
    """train --check's parameter count (memory_estimate.stage_params) of the hybrid stack equals the built model's at
    TP=1; at TP=2 the Gated DeltaNet's per-head tensors and the gated linear_qkv halve (the norms stay whole)."""
    from megatron_pack.config import load_config
    from megatron_pack.training.memory_estimate import layer_params, stage_params

    model = world_of_one_model()
    cfg = load_config([f"model.pretrained={folder}", "train.device=cpu", f"parallel.tensor_model_parallel_size={tp}"])
    if tp == 1:
        assert stage_params(cfg, 0) == sum(p.numel() for p in model.parameters())
    full = [layer for layer in model.decoder.layers if not hasattr(layer.self_attention, "A_log")][0]
    linear = model.decoder.layers[0]
    norms = {"full": 2 * 64 + 2 * 16, "linear": 2 * 64 + 8}
    for kind, layer in (("full", full), ("linear", linear)):
        whole = sum(p.numel() for p in layer.parameters())
        assert layer_params(cfg, tp, linear=kind == "linear") == (whole - norms[kind]) // tp + norms[kind], kind


def test_a_folder_still_holding_the_mtp_head_is_refused_in_one_line(folder, tmp_path):
    """config.json's mtp_num_hidden_layers is read as transformers' Qwen3_5ForCausalLM reads it (no MTP head);
    its tensors, where a folder still holds them, are named by the folder check rather than dropped."""
    import shutil

    from safetensors.torch import load_file, save_file

    from megatron_pack.model.hf.folder_check import folder_problems

    shutil.copytree(folder, tmp_path / "m")
    assert folder_problems(tmp_path / "m") == []  # guard: the folder itself passes
    tensors = load_file(tmp_path / "m" / "model.safetensors")
    save_file({**tensors, "mtp.fc.weight": torch.zeros(64, 128)}, str(tmp_path / "m" / "model.safetensors"),
              metadata={"format": "pt"})
    problems = folder_problems(tmp_path / "m")
    assert len(problems) == 1 and "mtp.fc.weight" in problems[0] and "\n" not in problems[0]


# ---- Qwen3.5-MoE text: the same hybrid layers, a MoE block with a gated shared expert in every layer ----

@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory) -> str:
    return _moe_folder(tmp_path_factory.mktemp("qwen3_5_moe"))


def test_moe_packed_logits_equal_transformers_per_sample(moe_folder):
    """World of one: Qwen3_5MoeForCausalLM's hybrid layers with 4 experts (top 2) and a gated shared expert."""
    from _hf import hf_logits

    from megatron_pack.config import load_config
    from megatron_pack.data.batches.thd import collate_thd
    from megatron_pack.model.builder import build_model
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel

    cfg = load_config([f"model.pretrained={moe_folder}", "train.device=cpu"])
    assert (cfg.model.num_experts, cfg.model.moe_router_topk, cfg.model.full_attention_interval) == (4, 2, 4)
    samples = _samples()
    batch = collate_thd([{"input_ids": ids, "loss_mask": [1] * len(ids)} for ids in samples], pack_size=128,
                        pad_multiple=4)
    try:
        model = build_model(cfg, initialize_parallel(cfg))
        logits = _packed_logits(model, batch)
    finally:
        destroy_parallel(destroy_process_group=True)
    cu, cu_pad = batch["cu_seqlens"].tolist(), batch["cu_seqlens_padded"].tolist()
    for s, ref in enumerate(hf_logits(moe_folder, [ids[:-1] for ids in samples])):
        torch.testing.assert_close(logits[cu_pad[s]:cu_pad[s] + cu[s + 1] - cu[s]], ref, atol=1e-5, rtol=1e-5,
                                   msg=f"sample {s}")


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_moe_export_gives_back_the_folder_bit_for_bit(moe_folder, tmp_path, tp):
    import transformers as T
    from safetensors.torch import load_file

    from megatron_pack.config import load_config
    from megatron_pack.model.hf.export import export_folder, shards_from_pretrained

    cfg = load_config([f"model.pretrained={moe_folder}", "train.device=cpu"])
    shards = shards_from_pretrained(moe_folder, cfg.model, tp=tp)
    export_folder(output=tmp_path / "out", source=moe_folder, model_cfg=cfg.model, shards=shards)
    want, got = load_file(f"{moe_folder}/model.safetensors"), {}
    for path in (tmp_path / "out").glob("*.safetensors"):
        got.update(load_file(path))
    assert sorted(got) == sorted(want) and any(".mlp.experts.3.down_proj" in k for k in got)
    assert all(torch.equal(got[k], want[k]) for k in got)
    T.AutoModelForCausalLM.from_pretrained(tmp_path / "out")


def test_moe_packed_logits_equal_transformers_per_sample_at_cp2_tp2_ep2_and_pp2(moe_folder, layout_results):
    """The 2-rank world of the dense layouts (``layout_results``): the MoE stack at CP=2 (the Gated DeltaNet's
    all-to-all beside the routed experts), TP=2 with sequence parallelism (experts split over TP), EP=2 (two whole
    experts per rank, tokens dispatched across ranks) and PP=2 gives each sample transformers' logits alone."""
    from _hf import hf_logits

    refs = hf_logits(moe_folder, [ids[:-1] for ids in _samples()])
    _check_layouts(layout_results, refs, [f"moe_{name}" for name in MOE_LAYOUTS], pp_names=("moe_pp2",))


MOE_LORA_TARGETS = LORA_TARGETS
"""Every projection, the experts' linear_fc1 / linear_fc2 (and the shared expert's) included."""


@pytest.fixture(scope="module")
def moe_lora(moe_folder, tmp_path_factory) -> dict:
    """LoRA on every projection of the MoE stack at world 1, B drawn away from 0: the pack's logits and the peft
    folder ``export.adapter`` writes (``adapter``), with the number of adapters."""
    from _hf import spread_lora_outputs
    from megatron_pack.config import load_config
    from megatron_pack.data.batches.thd import collate_thd
    from megatron_pack.model.builder import build_model
    from megatron_pack.model.peft.export import export_adapter, peft_tensors
    from megatron_pack.model.peft.lora import adapter_state
    from megatron_pack.model.peft.meta import peft_meta
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.training.step import get_packed_seq_params

    batch = collate_thd([{"input_ids": ids, "loss_mask": [1] * len(ids)} for ids in _samples()], pack_size=128)
    cfg = load_config([f"model.pretrained={moe_folder}", "train.device=cpu", "peft.method=lora",
                       f"peft.target_modules={MOE_LORA_TARGETS}", "peft.dropout=0"])
    cu = batch["cu_seqlens"].tolist()
    try:
        model = build_model(cfg, initialize_parallel(cfg))
        spread_lora_outputs(model)
        logits = model(batch["tokens"], batch["position_ids"], None,
                       packed_seq_params=get_packed_seq_params(batch))[0, :, :VOCAB]
        samples = [logits[cu[s]:cu[s + 1]] for s in range(len(cu) - 1)]
        sum((x * w).sum() for x, w in zip(samples, _grad_weights())).backward()
    finally:
        destroy_parallel(destroy_process_group=True)
    adapters = adapter_state(model)
    adapter = tmp_path_factory.mktemp("qwen3_5_moe_lora") / "adapter"
    export_adapter(output=adapter, shards=[{k: v.detach() for k, v in adapters.items()}],
                   peft=peft_meta(cfg), source=moe_folder, model_cfg=cfg.model)
    grads = peft_tensors([{k: v.grad for k, v in adapters.items()}], "qwen3_5_moe_text", cfg.model,
                         cfg.peft.target_modules)
    return {"adapter": str(adapter), "num_adapters": model.num_adapters, "grads": grads,
            "logits": [x.detach() for x in samples]}


def _grad_weights() -> list[torch.Tensor]:
    """A fixed random weight per sample's logits: the scalar both models differentiate, sum(logits x weight)."""
    gen = torch.Generator().manual_seed(5)
    return [torch.randn(len(ids) - 1, VOCAB, generator=gen) for ids in _samples()]


@pytest.fixture(scope="module")
def moe_peft_logits(moe_folder, moe_lora) -> list[torch.Tensor]:
    """transformers' Qwen3_5MoeForCausalLM with the exported adapter folder loaded by peft: each sample's logits
    (guarded: the adapters change every sample's logits)."""
    from _hf import peft_logits

    return peft_logits(moe_folder, moe_lora["adapter"], _samples())[0]


def test_moe_lora_on_attention_linear_attention_and_experts_exports_to_peft(moe_folder, moe_lora, moe_peft_logits):
    """LoRA on the gated attention, the Gated DeltaNet's in_proj / out_proj, every expert and the shared expert
    (48 adapters): the export names the experts' 3D parameters in ``target_parameters`` (peft's ParamWrapper) and
    transformers + PeftModel gives each sample our packed logits at world 1; read back at TP=2 and out again, the
    folder's tensors are bit for bit the same."""
    from safetensors.torch import load_file

    from megatron_pack.config import load_config
    from megatron_pack.model.peft.export import peft_tensors, shards_from_peft

    # per layer: in_proj, out_proj (3 linear) or linear_qkv, linear_proj (1 full); 4 experts x 2; shared expert x 2
    assert moe_lora["num_adapters"] == 3 * 2 + 2 + 4 * (4 * 2 + 2)
    config = json.loads((Path(moe_lora["adapter"]) / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert {"q_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "gate_proj", "up_proj",
            "down_proj"} <= set(config["target_modules"])
    written = load_file(Path(moe_lora["adapter"]) / "adapter_model.safetensors")
    assert written["base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight"].shape == (4 * 32, 64)
    cfg = load_config([f"model.pretrained={moe_folder}", "train.device=cpu", "peft.method=lora",
                       f"peft.target_modules={MOE_LORA_TARGETS}", "peft.dropout=0"])
    tp2 = [shards_from_peft(written, "qwen3_5_moe_text", cfg.model, cfg.peft.target_modules, tp_rank=r, tp_size=2)
           for r in range(2)]
    back = peft_tensors(tp2, "qwen3_5_moe_text", cfg.model, cfg.peft.target_modules)
    assert sorted(back) == sorted(written) and all(torch.equal(back[k], written[k]) for k in written)
    for s, ref in enumerate(moe_peft_logits):
        torch.testing.assert_close(moe_lora["logits"][s][:, :VOCAB], ref, atol=1e-5, rtol=1e-5, msg=f"sample {s}")


FUSED_PARTS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("in_proj_qkv", "in_proj_z", "in_proj_b",
                                                                          "in_proj_a"))
"""transformers' linears one of ours fuses: our one lora_A is each part's, so its gradient is the sum of theirs."""


def test_moe_lora_gradients_equal_peft(moe_folder, moe_lora):
    """The adapters' gradients of sum(logits x weight) over the pack (ours, exported to peft's names) equal peft's on
    transformers over each sample alone: every expert's A and B through the ParamWrapper's 3D parameters, the Gated
    DeltaNet's in_proj parts, the gated attention and the shared expert (a fused lora_A: the sum of its parts')."""
    import transformers as T
    from peft import PeftModel

    model = PeftModel.from_pretrained(T.AutoModelForCausalLM.from_pretrained(moe_folder), moe_lora["adapter"],
                                      is_trainable=True)
    sum((model(torch.tensor([ids[:-1]])).logits[0] * w).sum() for ids, w in zip(_samples(), _grad_weights())).backward()
    ref = {n.replace(".default", ""): p.grad for n, p in model.named_parameters() if "lora_" in n}
    ours = moe_lora["grads"]
    assert sorted(ours) == sorted(ref) and any("mlp.experts.base_layer.lora_A" in k for k in ours)
    for name, grad in ours.items():
        module = name.split(".lora_")[0].rsplit(".", 1)[-1]
        parts = next((g for g in FUSED_PARTS if module in g), (module,)) if ".lora_A." in name else (module,)
        want = sum(ref[name.replace(f".{module}.", f".{part}.")] for part in parts)
        scale = float(want.abs().max())
        assert scale > 1e-3, name  # guard: every adapter gets a gradient
        assert float((grad - want).abs().max()) <= 1e-5 * scale, name  # float32 sums in another order


def test_moe_lora_read_into_cp2_ep2_and_tp2_gives_peft_logits(moe_peft_logits, layout_results):
    """The adapter folder read into each 2-rank layout (``load_adapter``: each EP rank its experts' adapters, each TP
    rank its rows; the Gated DeltaNet's adapted in_proj under CP's all-to-all) gives peft's logits of every sample."""
    _check_layouts(layout_results, moe_peft_logits, [f"moe_{name}" for name in MOE_LORA_LAYOUTS])
