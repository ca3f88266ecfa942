"""Qwen3.5 and Qwen3-VL as vision-language models (issue 44 items 1, 4, 6), proved against transformers.

Tiny random folders of each family (``tests/_vlm3.py``: Qwen3.5 keeps its hybrid pattern, one Gated DeltaNet and one
gated full-attention layer; Qwen3-VL has DeepStack from two vision blocks into decoder layers 0 and 1), packs of
three samples (two images, none, one) built from transformers' image processor and ``get_rope_index`` per sample:

1. interleaved M-RoPE: our angles equal transformers' rotary embedding (``recomposition_frequencies``) on random
   positions, at the Hub's sizes and the tiny ones (Qwen3.5: partial rotary); megatron-core's contiguous layout
   does not (guard);
2. packed logits equal transformers' of each sample alone in a world of one (1e-5, float32), and in a 2-rank world
   at CP=2, TP=2 with sequence parallelism and PP=2 through verify's forward-only schedule; DeepStack changes the
   logits (the comparison would see it dropped), and a DeepStack layer off the first stage is refused in one line;
3. the default ``model.freeze_vision`` trains the mergers (DeepStack's too) and nothing else of the tower.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import _vlm3 as W
from _dist import spawn_world

DENSE = ("qwen3_5", "qwen3_vl")
MOE = ("qwen3_5_moe", "qwen3_vl_moe")
ALL = DENSE + MOE
PAD = 4  # 2 x CP for CP=2, CP x TP for TP=2 with SP


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("vlm3")
    # the MoE folder of seed 0 emits the image placeholder as its second greedy token (not comparable: our packs read
    # it as an image token); seed 2's first four tokens are text
    return {family: str(W.make_folder(root, family, seed=2 if family in MOE else 0)) for family in ALL}


@pytest.fixture(scope="module")
def packs(folders) -> dict:
    """family -> (the pack, transformers' logits of each sample alone)."""
    out = {}
    for family, folder in folders.items():
        samples = W.samples(folder)
        out[family] = (W.reference_pack(samples, PAD), [W.reference_logits(folder, s) for s in samples])
    return out


HUB_QWEN3_VL_8B = {  # Qwen3-VL-8B-Instruct's config.json as published (transformers 4.57's spelling)
    "architectures": ["Qwen3VLForConditionalGeneration"], "image_token_id": 151655, "model_type": "qwen3_vl",
    "text_config": {"attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
                    "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 12288,
                    "max_position_embeddings": 262144, "model_type": "qwen3_vl_text", "num_attention_heads": 32,
                    "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
                    "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
                    "rope_theta": 5000000, "vocab_size": 151936},
    "tie_word_embeddings": False, "video_token_id": 151656, "vision_end_token_id": 151653,
    "vision_start_token_id": 151652,
    "vision_config": {"deepstack_visual_indexes": [8, 16, 24], "depth": 27, "hidden_act": "gelu_pytorch_tanh",
                      "hidden_size": 1152, "in_channels": 3, "intermediate_size": 4304, "model_type": "qwen3_vl",
                      "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": 4096, "patch_size": 16,
                      "spatial_merge_size": 2, "temporal_patch_size": 2}}


HUB_QWEN3_VL_30B_A3B = {**HUB_QWEN3_VL_8B, "architectures": ["Qwen3VLMoeForConditionalGeneration"],
                        "model_type": "qwen3_vl_moe",
                        "text_config": {**HUB_QWEN3_VL_8B["text_config"], "model_type": "qwen3_vl_moe_text",
                                        "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
                                        "num_attention_heads": 32, "num_key_value_heads": 4, "num_experts": 128,
                                        "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                                        "decoder_sparse_step": 1, "mlp_only_layers": []},
                        "vision_config": {**HUB_QWEN3_VL_8B["vision_config"], "out_hidden_size": 2048}}
"""Qwen3-VL-30B-A3B-Instruct's config.json (its sizes over the 8B's)."""


def hub_qwen3_5(moe: bool = False) -> dict:
    """A Qwen3.5 (``moe``: Qwen3.5-MoE) vision-language config.json (the text stack of test_qwen3_5's HUB_TEXT /
    HUB_MOE_TEXT under text_config)."""
    from test_qwen3_5 import HUB_MOE_TEXT, HUB_TEXT

    text = {k: v for k, v in (HUB_MOE_TEXT if moe else HUB_TEXT).items() if k != "architectures"}
    arch = "Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"
    return {"architectures": [arch], "model_type": "qwen3_5_moe" if moe else "qwen3_5", "image_token_id": 248056,
            "video_token_id": 248057, "vision_start_token_id": 248053, "vision_end_token_id": 248054,
            "tie_word_embeddings": False, "text_config": text,
            "vision_config": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                              "out_hidden_size": 4096, "patch_size": 16, "spatial_merge_size": 2,
                              "temporal_patch_size": 2, "num_position_embeddings": 2304, "model_type": "qwen3_5"}}


@pytest.mark.parametrize("family", ALL)
def test_hub_config_becomes_model_keys(family):
    from megatron_pack.config.hf_config import derive_model_keys, refusal

    hf = (hub_qwen3_5(family == "qwen3_5_moe") if family.startswith("qwen3_5") else
          HUB_QWEN3_VL_30B_A3B if family == "qwen3_vl_moe" else HUB_QWEN3_VL_8B)
    assert refusal(hf, "x") is None
    keys = derive_model_keys(hf)
    want = (dict(mrope_section=[11, 11, 10], mrope_interleaved=True, rotary_percent=0.25, deepstack_layers=0,
                 full_attention_interval=4, image_token_id=248056, kv_channels=256,
                 num_experts=256 if family == "qwen3_5_moe" else None) if family.startswith("qwen3_5") else
            dict(mrope_section=[24, 20, 20], mrope_interleaved=True, rotary_percent=1.0, deepstack_layers=3,
                 qk_layernorm=True, image_token_id=151655, rotary_base=5000000,
                 num_experts=128 if family == "qwen3_vl_moe" else None,
                 moe_ffn_hidden_size=768 if family == "qwen3_vl_moe" else None))
    assert {k: keys[k] for k in want} == want


def test_a_text_config_under_a_vision_model_type_is_refused_in_one_line():
    from test_qwen3_5 import HUB_TEXT

    from megatron_pack.config.hf_config import refusal

    message = refusal({**HUB_TEXT, "model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"]}, "x")
    assert "without vision_config and image_token_id" in message and "qwen3_5_text" in message
    assert "\n" not in message


ROPE_CASES = {  # id: (transformers config kwargs of the text model, module)
    "qwen3_vl_hub": (dict(head_dim=128, rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                                         "mrope_section": [24, 20, 20], "mrope_interleaved": True}),
                     "qwen3_vl"),
    "qwen3_5_hub": (dict(head_dim=256, rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                                        "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                                                        "mrope_interleaved": True}), "qwen3_5"),
    "qwen3_vl_tiny": (dict(head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                         "mrope_section": [2, 3, 3], "mrope_interleaved": True}),
                      "qwen3_vl"),
}


@pytest.mark.parametrize("case", ROPE_CASES.values(), ids=ROPE_CASES.keys())
def test_interleaved_mrope_equals_transformers(case):
    import transformers as T
    from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding

    from megatron_pack.model.cpu_compat import enable_cpu_compat_without_cuda
    from megatron_pack.model.vlm import interleaved_mrope

    enable_cpu_compat_without_cuda()
    kwargs, module = case
    if module == "qwen3_vl":
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding as Rope
        config = T.Qwen3VLTextConfig(hidden_size=64, num_attention_heads=4, **kwargs)
    else:
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding as Rope
        config = T.Qwen3_5TextConfig(hidden_size=64, num_attention_heads=4, **kwargs)
    params = config.rope_parameters
    positions = torch.randint(0, 4000, (3, 1, 57), generator=torch.Generator().manual_seed(2))
    cos, sin = Rope(config)(torch.zeros(1, dtype=torch.float32), positions)  # [1, T, rotary dims]
    ours = MultimodalRotaryEmbedding(kv_channels=kwargs["head_dim"],
                                     rotary_percent=params.get("partial_rotary_factor", 1.0),
                                     rotary_base=int(params["rope_theta"]))
    angles = interleaved_mrope(positions, ours.inv_freq, params["mrope_section"])  # [T, 1, 1, rotary dims]
    assert angles.shape == (57, 1, 1, cos.shape[-1])
    torch.testing.assert_close(angles[:, 0, 0].cos(), cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(angles[:, 0, 0].sin(), sin[0], atol=1e-6, rtol=0)
    contiguous = ours(positions, params["mrope_section"])  # megatron-core's Qwen2.5-VL layout: not the same
    assert float((contiguous[:, 0, 0].cos() - cos[0]).abs().max()) > 1e-2


def _our_logits(folder: str, *batches: dict) -> torch.Tensor | list[torch.Tensor]:
    """Our model of ``folder`` in a world of one: each batch's logits [T, V'] (one batch: its logits alone); a batch
    may be a function of the logits so far (greedy decoding)."""
    from megatron_pack.config import load_config
    from megatron_pack.model.builder import build_model
    from megatron_pack.model.vlm import mrope_positions, vlm_decoder_input
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.training.step import get_packed_seq_params

    cfg = load_config([f"model.pretrained={folder}", "model.attention_backend=torch", "train.device=cpu"])
    out = []
    try:
        model = build_model(cfg, initialize_parallel(cfg))
        with torch.no_grad():
            for batch in batches:
                batch = batch(out) if callable(batch) else batch
                decoder_input = vlm_decoder_input(model, batch, 1, 0, torch.device("cpu"))
                out.append(model(None, mrope_positions(batch, "cpu"), None, decoder_input=decoder_input,
                                 packed_seq_params=get_packed_seq_params(batch))[0])
    finally:
        destroy_parallel(destroy_process_group=True)
    return out[0] if len(out) == 1 else out


def _assert_samples(logits: torch.Tensor, batch: dict, refs: list[torch.Tensor], what: str) -> None:
    cu_pad = batch["cu_seqlens_padded"].tolist()
    assert len(refs) == 3 and sum(len(r) for r in refs) > 70
    for s, ref in enumerate(refs):
        torch.testing.assert_close(logits[cu_pad[s]:cu_pad[s] + len(ref), :W.VOCAB], ref, atol=1e-5, rtol=1e-5,
                                   msg=f"{what} sample {s}")


@pytest.mark.parametrize("family", ALL)
def test_packed_logits_equal_transformers_per_sample(folders, packs, family):
    """World of one: the pack's images through the tower, the features (and DeepStack's) at the image tokens, the
    interleaved M-RoPE rows: each sample's logits as transformers gives them for the sample alone."""
    batch, refs = packs[family]
    assert batch["image_grid_thw"].shape[0] == 3
    _assert_samples(_our_logits(folders[family], batch), batch, refs, family)


def test_qwen3_vl_moe_reads_the_hubs_stacked_experts(folders, packs, tmp_path):
    """The Hub's Qwen3-VL-MoE folders stack the experts as [E, H, 2F] / [E, F, H] (transformers 5 saves its modules'
    [E, 2F, H] / [E, H, F], read above): the same logits from that folder, in transformers and in ours."""
    batch, refs = packs["qwen3_vl_moe"]
    hub = W.hub_orientation(folders["qwen3_vl_moe"], tmp_path / "hub")
    theirs = [W.reference_logits(hub, s) for s in W.samples(hub)]
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(theirs, refs))
    _assert_samples(_our_logits(str(hub), batch), batch, refs, "hub")


def test_deepstack_changes_the_logits(folders, packs, monkeypatch):
    """Guard: without the DeepStack additions the Qwen3-VL logits at and after the images move."""
    import megatron_pack.model.vlm as vlm

    batch, refs = packs["qwen3_vl"]
    tower_output = vlm.image_features
    monkeypatch.setattr(vlm, "image_features", lambda *a: (tower_output(*a)[0], []))
    logits = _our_logits(folders["qwen3_vl"], batch)
    assert float((logits[:len(refs[0]), :W.VOCAB] - refs[0]).abs().max()) > 1e-3


def test_deepstack_off_the_first_stage_and_under_full_recompute_is_refused_in_one_line(folders):
    from megatron_pack.config import load_config
    from megatron_pack.config.schema import ConfigError

    with pytest.raises(ConfigError) as err:
        load_config([f"model.pretrained={folders['qwen3_vl']}", "train.device=cpu",
                     "parallel.pipeline_model_parallel_size=4"])
    message = str(err.value)
    assert "parallel.pipeline_model_parallel_size (4)" in message and "layers 0..1" in message
    load_config([f"model.pretrained={folders['qwen3_vl']}", "train.device=cpu",
                 "parallel.pipeline_model_parallel_size=2"])  # 2 layers a stage: DeepStack's on the first
    with pytest.raises(ConfigError) as err:
        load_config([f"model.pretrained={folders['qwen3_vl']}", "train.device=cpu", "model.recompute_granularity=full"])
    assert "model.recompute_granularity" in str(err.value) and "DeepStack" in str(err.value)


LAYOUTS = {  # id: the parallel layout of a 2-rank world
    "cp2": ["parallel.context_parallel_size=2"],
    "tp2_sp": ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"],
    "pp2": ["parallel.pipeline_model_parallel_size=2"],
}


MOE_LAYOUTS = {**LAYOUTS, "ep2": ["parallel.expert_model_parallel_size=2"]}


def _layout_worker(rank: int, world_size: int, folders: dict, batches: dict, middle: dict) -> dict:
    """Each family's and layout's logits of the pack through megatron-core's forward-only schedule (verify's), on
    the last stage's ranks, and verify's comparison with transformers at CP=2; then the loss and gradients of
    both packs at DP=2 and at CP=2 (``_gradients``)."""
    from megatron_pack.cli.verify import _load_reference, build_chunks, compare_with_transformers, schedule_logits
    from megatron_pack.config import load_config
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel

    out = {}
    for family, folder in folders.items():
        batch = batches[family]
        for name, layout in (LAYOUTS if family in DENSE else MOE_LAYOUTS).items():
            cfg = load_config([f"model.pretrained={folder}", "train.device=cpu", *layout])
            state = initialize_parallel(cfg)
            logits, _ = schedule_logits(build_chunks(cfg, state), [batch], state, seq_length=512)
            if logits is not None:
                out[f"{family}/{name}"] = logits[0][:, :W.VOCAB].numpy()
            if logits is not None and name == "cp2" and rank == 0:  # verify.reference=transformers' comparison
                result = compare_with_transformers(logits[0], batch, _load_reference(folder)[0], W.VOCAB, 0)
                out[f"{family}/verify"] = [result.max_logit_diff, int(result.passed(1e-5)), len(result.samples)]
            destroy_parallel()
        out.update(_gradients(rank, family, folder, [batch, middle[family]]))
    return out


def _gradients(rank: int, family: str, folder: str, batches: list[dict]) -> dict:
    """Loss and every parameter's gradient (the whole tower's, model.freeze_vision=false) of both packs through the
    trainer's ``forward_step`` under megatron-core DDP and ``finalize_model_grads``, at DP=2 (each rank both packs)
    and at CP=2, on rank 0; and each CP=2 rank's image tokens per pack."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    from megatron_pack.config import load_config
    from megatron_pack.model.builder import build_model
    from megatron_pack.parallel.cp import slice_thd_batch
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.training.step import forward_step

    out = {}
    for name, layout in (("dp2", []), ("cp2", ["parallel.context_parallel_size=2"])):
        cfg = load_config([f"model.pretrained={folder}", "train.device=cpu", "model.freeze_vision=false", *layout])
        state = initialize_parallel(cfg)
        model = build_model(cfg, state)
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, average_in_collective=False, overlap_grad_reduce=False), model,
            pg_collection=state.pg_collection)
        ddp.zero_grad_buffer()
        loss, count = torch.zeros((), dtype=torch.float64), torch.zeros(())
        for batch in batches:
            output, loss_fn = forward_step(iter([batch]), ddp)
            loss_sum, num, _ = loss_fn(output)
            loss_sum.backward()
            loss, count = loss + loss_sum.detach().double(), count + num
        finalize_model_grads([ddp], num_tokens=count.to(torch.float32).clone(), pg_collection=state.pg_collection)
        torch.distributed.all_reduce(loss, group=state.dp_cp_group)
        torch.distributed.all_reduce(count, group=state.dp_cp_group)
        if rank == 0:
            out[f"{family}/{name}/loss"] = float(loss) / float(count)
            out.update({f"{family}/{name}/grad/{n}": p.main_grad.numpy().copy() for n, p in model.named_parameters()})
        if name == "cp2":
            out[f"{family}/cp2/image_tokens"] = [int((slice_thd_batch(b, 2, state.cp_rank)["tokens"] == 5).sum())
                                                 for b in batches]
        destroy_parallel()
    return out


def test_packed_logits_equal_transformers_at_cp2_tp2_and_pp2(folders, packs, tmp_path):
    """A 2-rank gloo world: at CP=2 (the images in the whole pack's embeddings and DeepStack rows, then the zigzag
    slice), TP=2 with sequence parallelism (then the SP scatter), PP=2 (tower and DeepStack layers on stage 0) and,
    for the MoE families, EP=2, every rank of the last stage gives each sample transformers' logits alone."""
    results = world2(folders, packs, tmp_path)
    for family in ALL:
        batch, refs = packs[family]
        held = [(rank, name) for rank, res in enumerate(results) for name in MOE_LAYOUTS if f"{family}/{name}" in res]
        ep = [] if family in DENSE else ["ep2"]  # the MoE families at EP=2 too
        assert held == [(0, n) for n in ["cp2", "tp2_sp", *ep]] + [(1, n) for n in ["cp2", "tp2_sp", "pp2", *ep]]
        for rank, name in held:
            _assert_samples(torch.as_tensor(results[rank][f"{family}/{name}"]), batch, refs, f"{family} {name} r{rank}")
        worst, passed, num_samples = results[0][f"{family}/verify"].tolist()
        assert num_samples == 3 and passed == 1 and worst <= 1e-5  # verify's transformers reference, at CP=2


_WORLD: dict = {}


def world2(folders, packs, tmp_path) -> list[dict]:
    """The 2-rank world's results (run once for the module's tests)."""
    if not _WORLD:
        import _vlm as V

        batches = {family: packs[family][0] for family in ALL}
        text = "the answer is the answer is hello world what colour"  # an image in the middle chunks of CP=2
        middle = {family: W.reference_pack([W.encode(folder, [text, V.make_image(32, 32, 4), text + " is it"])], PAD)
                  for family, folder in folders.items()}
        _WORLD["results"] = spawn_world(_layout_worker, 2, tmp_path, folders, batches, middle, timeout_s=300)
    return _WORLD["results"]


@pytest.mark.parametrize("family", ALL)
def test_loss_and_every_gradient_equal_at_cp2_and_dp2(folders, packs, family, tmp_path):
    """The trainer's step at CP=2 (a pack whose image sits in the middle chunks: rank 0's slice has no image token,
    its DeepStack rows are zeros and it still enters every collective) gives the loss and every gradient (the whole
    tower's, DeepStack's mergers included; the MoE families' every expert and router) of DP=2 with each rank the
    whole packs (relative 1e-5)."""
    results = world2(folders, packs, tmp_path)[0]
    assert [int(n) for n in world2(folders, packs, tmp_path)[0][f"{family}/cp2/image_tokens"]][1] == 0
    assert int(world2(folders, packs, tmp_path)[1][f"{family}/cp2/image_tokens"][1]) > 0
    dp, cp = (results[f"{family}/{name}/loss"] for name in ("dp2", "cp2"))
    assert abs(float(cp) - float(dp)) <= 1e-5 * abs(float(dp))
    names = [k.split("/grad/")[1] for k in results if k.startswith(f"{family}/dp2/grad/")]
    assert any("deepstack_merger_list" in n for n in names) == family.startswith("qwen3_vl")
    worst, nonzero = 0.0, 0
    for n in names:
        want, got = (torch.as_tensor(results[f"{family}/{layout}/grad/{n}"]) for layout in ("dp2", "cp2"))
        # relative to the tensor's largest entry, or to 1e-4 for a tensor of tinier gradients (Qwen3.5-MoE's dt_bias:
        # 2e-5, whose CP path sums in another order: 3e-10 apart)
        worst = max(worst, float((got - want).abs().max() / want.abs().max().clamp_min(1e-4)))
        nonzero += float(want.abs().max()) > 0
    assert nonzero == len(names) > 40 and worst <= 1e-5


def test_freeze_vision_trains_the_mergers_only(folders):
    from megatron_pack.config import load_config
    from megatron_pack.model.builder import build_model
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel

    cfg = load_config([f"model.pretrained={folders['qwen3_vl']}", "train.device=cpu"])
    try:
        tower = build_model(cfg, initialize_parallel(cfg)).vision_model
    finally:
        destroy_parallel(destroy_process_group=True)
    trainable = sorted({n.split(".")[0] for n, p in tower.named_parameters() if p.requires_grad})
    assert trainable == ["deepstack_merger_list", "merger"]
    assert any(not p.requires_grad for n, p in tower.named_parameters() if n.startswith("blocks."))


def _tensors(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(Path(folder).glob("*.safetensors")) for k, v in load_file(f).items()}


def _rules_spelling(src, dst):
    """``src`` re-saved in the spelling our rules use (``model.layers.*``, ``visual.*``), as a converted folder may
    be."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    renamed = {k.replace("model.language_model.", "model.").replace("model.visual.", "visual."): v
               for k, v in _tensors(src).items()}
    save_file(renamed, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _our_greedy(folder, prompt: list[int], pixels: torch.Tensor, grid: torch.Tensor, steps: int) -> list[int]:
    """Greedy tokens of our packed model (world 1), the whole sequence again at each step, M-RoPE rows from
    transformers' ``get_rope_index``."""
    ids = list(prompt)

    def step(logits_so_far: list) -> dict:  # the sequence with the last step's greedy token
        if logits_so_far:
            ids.append(int(logits_so_far[-1][len(ids) - 1, :W.VOCAB].argmax()))
        full = torch.tensor([ids + [2]])
        rope = W.reference_model(folder).model.get_rope_index(full, (full == 5).to(torch.int32), image_grid_thw=grid)
        return W.reference_pack([{"input_ids": ids + [2], "pixel_values": pixels, "image_grid_thw": grid,
                                  "mrope": rope[0][:, 0]}])

    last = _our_logits(str(folder), *[step] * steps)
    ids.append(int((last[-1] if isinstance(last, list) else last)[len(ids) - 1, :W.VOCAB].argmax()))
    return ids[len(prompt):]


IMAGE_SEED = 9


def _generate(folder) -> tuple:
    """Greedy tokens from an image and a question through the folder's own image processor and chat template (and
    the prompt's ids, pixels and grid)."""
    import transformers as T

    import _vlm as V

    tok, proc = T.AutoTokenizer.from_pretrained(folder), T.AutoImageProcessor.from_pretrained(folder)
    model = T.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what"}]}],
                                   tokenize=False, add_generation_prompt=True)
    pixels = proc(images=[V.make_image(64, 96, IMAGE_SEED)], return_tensors="pt")
    text = text.replace("<|image_pad|>", "<|image_pad|>" * (int(pixels["image_grid_thw"][0].prod()) // 4))
    ids = tok(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(input_ids=ids, mm_token_type_ids=(ids == 5).to(torch.int32),
                             pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                             max_new_tokens=4, do_sample=False)
    return out[0, ids.shape[1]:].tolist(), ids[0].tolist(), pixels["pixel_values"], pixels["image_grid_thw"]


@pytest.mark.parametrize("family", ALL)
def test_export_is_bit_exact_from_either_spelling_and_transformers_generates_from_an_image(folders, family, tmp_path):
    """``megatron-pack export`` of the folder (transformers' module names, the Hub's) and of the same tensors in our
    rules' spelling (Qwen3-VL-MoE: and with the experts stacked as the Hub does, which the export writes): every tensor
    (the tower's, DeepStack's mergers) back bit for bit under the module names, the processor, chat template and
    tokenizer beside them; transformers generates from an image with the export as with the source, and our packed
    model's greedy tokens are transformers'."""
    from megatron_pack.cli.export import main

    sources = [folders[family], _rules_spelling(folders[family], tmp_path / "rules")]
    if family == "qwen3_vl_moe":  # the experts as the Hub stacks them; transformers' own orientation exports to it
        sources.append(W.hub_orientation(folders[family], tmp_path / "hub"))
        assert _tensors(sources[2]).keys() == _tensors(sources[0]).keys()
        assert sum(v.shape != _tensors(sources[0])[k].shape for k, v in _tensors(sources[2]).items()) == 2 * 4
    source = _tensors(sources[-1] if family == "qwen3_vl_moe" else sources[0])
    assert any(k.startswith("model.language_model.layers.") for k in source)
    for i, src in enumerate(sources):
        out = tmp_path / f"out{i}"
        assert main([f"model.pretrained={src}", f"output={out}"]) == 0
        exported = _tensors(out)
        assert sorted(exported) == sorted(source) and all(torch.equal(exported[k], source[k]) for k in source)
        for name in ("preprocessor_config.json", "chat_template.jinja", "tokenizer.json"):
            assert (out / name).read_bytes() == (Path(folders[family]) / name).read_bytes(), name
    tokens, prompt, pixels, grid = _generate(tmp_path / "out0")
    assert len(tokens) == 4 and tokens == _generate(folders[family])[0]
    # and our model's greedy tokens, up to a generated image placeholder (which our packs read as an image token)
    steps = tokens.index(5) if 5 in tokens else len(tokens)
    assert steps >= 2 and _our_greedy(folders[family], prompt, pixels, grid, steps) == tokens[:steps]


LORA = {"qwen3_5": "[linear_qkv,linear_proj,linear_fc1,linear_fc2,in_proj,out_proj]",
        "qwen3_vl": "[linear_qkv,linear_proj,linear_fc1,linear_fc2]"}
LORA.update(qwen3_5_moe=LORA["qwen3_5"], qwen3_vl_moe=LORA["qwen3_vl"])
NUM_ADAPTERS = {"qwen3_5": 2 + 2 + 2 * 2, "qwen3_vl": 4 * 4,  # qwen3_5: in/out (linear), qkv/proj (full), fc1/fc2 x 2
                "qwen3_5_moe": 2 + 2 + 2 * (4 * 2 + 2),  # ... and per layer 4 experts x 2, the shared expert's 2
                "qwen3_vl_moe": 4 * (2 + 4 * 2)}  # per layer qkv/proj, 4 experts x 2
ADAPTED_MODULES = {"qwen3_5": 5 + 4 + 2 * 3, "qwen3_vl": 4 * (4 + 3),  # transformers' modules peft adapts: q/k/v/o,
                   "qwen3_5_moe": 5 + 4 + 2 * (3 + 2),  # in_proj_qkv/z/b/a + out_proj, gate/up/down (the shared
                   "qwen3_vl_moe": 4 * (4 + 2)}  # expert's), and the experts module with its nested base_layer


@pytest.mark.parametrize("family", ALL)
def test_lora_exports_to_peft_and_transformers_gives_our_logits(folders, packs, family, tmp_path):
    """LoRA on the language model (Qwen3.5: the Gated DeltaNet's in_proj / out_proj by name too; the MoE families:
    every expert through peft's ``target_parameters`` on transformers' ``mlp.experts`` module, Qwen3.5-MoE's shared
    expert as linears), B drawn away from 0: the peft folder the export writes, on transformers' VLM class, loads
    every tensor and gives each sample of the pack (images included) our packed logits, and adapts nothing of the
    tower; read back at TP=2 and out again, the folder's tensors are bit for bit the same. Qwen3-VL-MoE from the Hub's
    orientation ([E, H, 2F] on file; transformers' module is [E, 2F, H] either way, which peft's ParamWrapper
    adapts)."""
    from _hf import spread_lora_outputs
    import json

    from peft import PeftModel
    from safetensors.torch import load_file

    from megatron_pack.config import load_config
    from megatron_pack.model.builder import build_model
    from megatron_pack.model.peft.export import export_adapter, peft_tensors, shards_from_peft
    from megatron_pack.model.peft.lora import adapter_state
    from megatron_pack.model.peft.meta import peft_meta
    from megatron_pack.model.vlm import mrope_positions, vlm_decoder_input
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.training.step import get_packed_seq_params

    folder, (batch, refs) = folders[family], packs[family]
    if family == "qwen3_vl_moe":  # the experts as the Hub stacks them (same logits: test_qwen3_vl_moe_reads_...)
        folder = str(W.hub_orientation(folder, tmp_path / "hub"))
    cfg = load_config([f"model.pretrained={folder}", "train.device=cpu", "peft.method=lora",
                       f"peft.target_modules={LORA[family]}", "peft.dropout=0"])
    try:
        model = build_model(cfg, initialize_parallel(cfg))
        spread_lora_outputs(model)
        with torch.no_grad():
            logits = model(None, mrope_positions(batch, "cpu"), None, packed_seq_params=get_packed_seq_params(batch),
                           decoder_input=vlm_decoder_input(model, batch, 1, 0, torch.device("cpu")))[0]
    finally:
        destroy_parallel(destroy_process_group=True)
    assert model.num_adapters == NUM_ADAPTERS[family]
    export_adapter(output=tmp_path / "adapter", shards=[{k: v.detach() for k, v in adapter_state(model).items()}],
                   peft=peft_meta(cfg), source=folder, model_cfg=cfg.model)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    if family.startswith("qwen3_5"):
        assert "in_proj_qkv" in config["target_modules"] and "in_proj_z" in config["target_modules"]
    assert config["target_parameters"] == (["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
                                           if family in MOE else None)
    written = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    if family in MOE:  # E r rows of A over H (gate_up_proj) or F (down_proj); B [2F, r E]
        ffn, r = 32 if family == "qwen3_5_moe" else 16, config["r"]
        stem = "base_model.model.model.language_model.layers.1.mlp.experts."
        assert written[stem + "base_layer.lora_A.weight"].shape == (4 * r, 64)
        assert written[stem + "base_layer.lora_B.weight"].shape == (2 * ffn, r * 4)
        assert written[stem + "lora_A.weight"].shape == (4 * r, ffn)
    tp2 = [shards_from_peft(written, family, cfg.model, cfg.peft.target_modules, tp_rank=r, tp_size=2)
           for r in range(2)]
    back = peft_tensors(tp2, family, cfg.model, cfg.peft.target_modules)
    assert sorted(back) == sorted(written) and all(torch.equal(back[k], written[k]) for k in written)
    tuned = PeftModel.from_pretrained(W.reference_model(folder), tmp_path / "adapter").eval()
    try:
        adapted = {n.split(".lora_")[0] for n, _ in tuned.named_parameters() if "lora_" in n}
        assert len(adapted) == ADAPTED_MODULES[family] and not any("visual" in n for n in adapted)
        loaded = {k.replace(".default", ""): v for k, v in tuned.state_dict().items() if "lora_" in k}
        assert sorted(loaded) == sorted(written) and all(torch.equal(loaded[k], written[k]) for k in written)
        samples = W.samples(folder)
        cu_pad = batch["cu_seqlens_padded"].tolist()
        for s, sample in enumerate(samples):
            ref = W.reference_logits(folder, sample, tuned)
            assert float((ref - refs[s]).abs().max()) > 1e-3  # guard: the adapters act
            torch.testing.assert_close(logits[cu_pad[s]:cu_pad[s] + len(ref), :W.VOCAB], ref, atol=1e-5, rtol=1e-5,
                                       msg=f"sample {s}")
    finally:
        tuned.unload()  # the cached reference model without adapters again


@pytest.mark.parametrize("family", DENSE)
def test_collate_mrope_rows_equal_transformers_rope_index(folders, family):
    """The VLM batch's M-RoPE rows (``data/batches/vlm.py``, Qwen2.5-VL's rule for still images) are what Qwen3-VL's
    and Qwen3.5's ``get_rope_index`` give each sample: images at (p, p + i, p + j), text after at p + max(h, w) / 2."""
    from megatron_pack.data.batches.vlm import sample_mrope_positions

    samples = W.samples(folders[family])
    assert sum(s["image_grid_thw"].shape[0] for s in samples) == 3
    for sample in samples:
        ids = torch.tensor(sample["input_ids"])
        starts = [int(i) for i in torch.nonzero(ids == 5).flatten() if i == 0 or ids[i - 1] != 5]
        images = [{"start": a, "grid": g.tolist()} for a, g in zip(starts, sample["image_grid_thw"])]
        ours = sample_mrope_positions(len(ids), images, merge_size=2)
        assert torch.equal(torch.from_numpy(ours), sample["mrope"])


def test_a_qwen3_5_folder_with_mtp_tensors_is_refused_by_the_folder_check(folders, tmp_path):
    """The Hub's Qwen3.5 folders may still hold the multi-token-prediction head (``mtp.*``), which neither transformers
    nor we build: the folder check names them (as for the text family) instead of dropping them silently."""
    from safetensors.torch import save_file

    from megatron_pack.model.hf.folder_check import folder_problems

    folder = _rules_spelling(folders["qwen3_5"], tmp_path / "mtp")
    tensors = _tensors(folder)
    assert folder_problems(folder) == []
    save_file({**tensors, "mtp.fc.weight": torch.zeros(64, 128)}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    problems = folder_problems(folder)
    assert len(problems) == 1 and "mtp.fc.weight" in problems[0], problems


@pytest.mark.parametrize("family", ALL)
def test_memory_estimate_counts_the_tower_as_transformers_builds_it(family):
    """``train --check``'s tower share (``training/vision_memory.py``): every parameter of transformers' tower, and
    the ones ``model.freeze_vision`` trains (the merger, DeepStack's mergers)."""
    import transformers as T

    from megatron_pack.training.vision_memory import vision_params, vision_trainable_params

    config = W.hf_config(family)
    tower = getattr(T, config.vision_config.__class__.__name__.replace("Config", "Model"))(config.vision_config)
    vc = config.vision_config.to_dict()
    merger = sum(p.numel() for n, p in tower.named_parameters() if n.startswith(("merger.", "deepstack_merger_list.")))
    assert vision_params(vc) == sum(p.numel() for p in tower.parameters())
    assert vision_trainable_params(vc, frozen=True) == merger > 0


@pytest.mark.parametrize("override", ["model.deepstack_layers=2", "model.mrope_interleaved=true"])
def test_the_multimodal_keys_without_a_vision_model_are_refused_in_one_line(override):
    """They would do nothing on a text model: refused, naming the key."""
    from megatron_pack.config import load_config
    from megatron_pack.config.schema import ConfigError

    with pytest.raises(ConfigError) as err:
        load_config(["train.device=cpu", override])
    assert f"{override.split('=')[0]} (" in str(err.value) and "vision-language model.pretrained" in str(err.value)
