"""Model construction: backend choice, TransformerConfig mapping, norms, CPU compat, process groups.

Models are built in-process in a world of one (a private HashStore group, no env vars), torn
down by the ``world_of_one`` fixture so no other test sees the groups.
"""

from __future__ import annotations

import pytest
import torch

from megatron_pack.config.schema import Config, ConfigError, ModelConfig, ParallelConfig, TrainConfig
from megatron_pack.model import builder
from megatron_pack.model.norms import SequenceParallelNorm

torch.use_deterministic_algorithms(True)


def _cfg(**model) -> Config:
    return Config(model=ModelConfig(**{"attention_backend": "torch", **model}))


@pytest.mark.parametrize("requested,te_ok,cuda,mode,expected", [
    ("torch", True, True, "thd", "torch"),
    ("auto", True, True, "thd", "te"),
    ("auto", False, True, "thd", "torch"),
    ("auto", True, False, "thd", "torch"),
    ("te", True, True, "thd", "te"),
    ("auto", True, True, "pack_causal", "torch"),
], ids=["torch_forced", "auto_gpu_te", "auto_no_te", "auto_no_cuda", "te_available", "pack_causal_forces_torch"])
def test_choose_backend(monkeypatch, requested, te_ok, cuda, mode, expected):
    monkeypatch.setattr(builder, "te_import_error", lambda: None if te_ok else "ImportError: no TE")
    assert builder.choose_backend(requested, attention_mode=mode, on_gpu=cuda) == expected


@pytest.mark.parametrize("te_ok,cuda,match", [
    (False, True, r"model.attention_backend \('te'\) needs Transformer Engine.*ImportError"),
    (True, False, r"this run's device is the CPU.*set model.attention_backend=torch"),
], ids=["te_missing", "cuda_missing"])
def test_te_backend_unavailable_is_a_clear_error(monkeypatch, te_ok, cuda, match):
    monkeypatch.setattr(builder, "te_import_error", lambda: None if te_ok else "ImportError: no TE")
    with pytest.raises(ValueError, match=match):
        builder.choose_backend("te", on_gpu=cuda)


def test_pack_causal_with_te_is_refused():
    with pytest.raises(ValueError, match="verify.attention=pack_causal exists only in the torch attention"):
        builder.choose_backend("te", attention_mode="pack_causal")


@pytest.mark.parametrize("overrides,parallel,expected", [
    ({}, {}, {"normalization": "RMSNorm", "gated_linear_unit": True, "num_query_groups": 2, "kv_channels": 16,
              "calculate_per_token_loss": True, "add_bias_linear": False, "params_dtype": torch.float32,
              "use_cpu_initialization": True, "sequence_parallel": False, "context_parallel_size": 1}),
    ({"normalization": "LayerNorm", "activation": "gelu", "num_query_groups": None}, {},
     {"normalization": "LayerNorm", "gated_linear_unit": False, "num_query_groups": 4}),
    ({"calculate_per_token_loss": False, "kv_channels": 8}, {}, {"calculate_per_token_loss": False, "kv_channels": 8}),
    ({}, {"tensor_model_parallel_size": 2, "context_parallel_size": 2, "sequence_parallel": True},
     {"tensor_model_parallel_size": 2, "context_parallel_size": 2, "sequence_parallel": True}),
], ids=["tiny_defaults", "layernorm_gelu_mha", "no_per_token_loss", "tp2_cp2_sp"])
def test_transformer_config_from(overrides, parallel, expected):
    cfg = Config(model=ModelConfig(**overrides), parallel=ParallelConfig(**parallel))
    tc = builder.transformer_config_from(cfg)
    for key, value in expected.items():
        assert getattr(tc, key) == value, key
    assert tc.activation_func is (torch.nn.functional.silu if tc.gated_linear_unit else torch.nn.functional.gelu)


def test_vocab_not_divisible_by_tp_names_the_fix():
    """validate()'s rule (config/validate.py), kept as the builder's backstop for Python-built configs."""
    cfg = Config(model=ModelConfig(vocab_size=385), parallel=ParallelConfig(tensor_model_parallel_size=2))
    with pytest.raises(ConfigError, match=r"model.vocab_size \(385\).*set model.vocab_size=386"):
        builder._check_divisibility(cfg)


@pytest.mark.parametrize("normalization,reference", [
    ("RMSNorm", torch.nn.RMSNorm), ("LayerNorm", torch.nn.LayerNorm)], ids=["rmsnorm", "layernorm"])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["no_sp", "sp"])
def test_sequence_parallel_norm(normalization, reference, sequence_parallel):
    cfg = Config(model=ModelConfig(normalization=normalization),
                 parallel=ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=sequence_parallel))
    tc = builder.transformer_config_from(cfg)
    norm = SequenceParallelNorm(tc, 64, eps=1e-5)
    ref = reference(64, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        ref.weight.copy_(norm.weight)
    x = torch.randn(5, 1, 64)
    torch.testing.assert_close(norm(x), ref(x), atol=1e-6, rtol=1e-5)
    assert len(list(norm.parameters())) == (2 if normalization == "LayerNorm" else 1)
    assert all(p.sequence_parallel is sequence_parallel for p in norm.parameters())


@pytest.fixture
def world_of_one():
    from megatron_pack.parallel.groups import destroy_parallel

    yield
    destroy_parallel(destroy_process_group=True)


def test_initialize_parallel_world_of_one(world_of_one):
    from megatron_pack.parallel.groups import initialize_parallel

    state = initialize_parallel(Config())
    assert (state.world_size, state.tp_size, state.cp_size, state.dp_size, state.dims.dp_cp) == (1, 1, 1, 1, 1)
    assert (state.pp_rank, state.pp_size, state.pp_group.size(), state.is_first_stage, state.is_last_stage) == (
        0, 1, 1, True, True)
    assert state.backend == "gloo" and state.device.type == "cpu"
    assert state.pg_collection.cp.size() == 1 and hasattr(state.pg_collection, "dp_cp")
    with pytest.raises(RuntimeError, match="destroy_parallel"):
        initialize_parallel(Config())


@pytest.mark.parametrize("parallel,match", [
    ({"pipeline_model_parallel_size": 2}, "pipeline_model_parallel_size"),
    ({"context_parallel_size": 2}, r"world size \(1\)"),
    ({"sequence_parallel": True}, "sequence_parallel"),
], ids=["pp2", "cp2_in_world_of_one", "sp_without_tp"])
def test_initialize_parallel_rejects_bad_layouts(world_of_one, parallel, match):
    """validate()'s layout rules, raised before any process group starts."""
    import torch.distributed as dist

    from megatron_pack.parallel.groups import initialize_parallel

    with pytest.raises(ConfigError, match=match):
        initialize_parallel(ParallelConfig(**parallel))
    assert not dist.is_initialized()


def test_initialize_parallel_state_is_one_typed_layout(world_of_one):
    """ParallelState carries the degrees (ParallelDims) and the groups, expert groups included."""
    from megatron_pack.parallel.dims import ParallelDims
    from megatron_pack.parallel.groups import initialize_parallel

    state = initialize_parallel(Config())
    assert isinstance(state.dims, ParallelDims) and state.dims == ParallelDims.from_config(Config(), world_size=1)
    # each degree has one home (dims); the state keeps only the public size names of DESIGN.md
    assert not any(hasattr(state, name) for name in ("describe", "num_dp_cp_ranks", "sequence_parallel"))
    assert state.pg_collection.ep.size() == 1 and state.pg_collection.expt_dp.size() == 1


def test_build_trainer_distributed_optimizer_on_cpu(world_of_one):
    """On CPU the flag builds megatron-core's distributed optimizer, as on a GPU: DDP's buffers are laid out for
    it (gradients reduce-scattered)."""
    from megatron_pack.config.schema import DDPConfig
    from megatron_pack.data.batches.protocol import BatchList
    from megatron_pack.parallel.groups import initialize_parallel
    from megatron_pack.training.loop import build_trainer
    cfg = Config(ddp=DDPConfig(use_distributed_optimizer=True))
    trainer = build_trainer(cfg, state=initialize_parallel(cfg), loader=BatchList([]))
    assert [type(o).__name__ for o in trainer.optimizer.parts] == ["DistributedOptimizer"]
    assert trainer.model.ddp_config.use_distributed_optimizer is True
    assert trainer.model_chunks == [trainer.model]  # one chunk per rank at PP=1; .model is the first


def test_build_model_local_spec_and_thd_forward(world_of_one):
    from megatron_pack.data.batches.thd import collate_thd
    from megatron_pack.model.attention import ThdCoreAttention
    from megatron_pack.parallel.groups import initialize_parallel
    from megatron_pack.training.step import get_packed_seq_params

    cfg = _cfg(normalization="LayerNorm")
    state = initialize_parallel(cfg)
    model = builder.build_model(cfg, state)
    broken = builder.build_model(cfg, state, attention_mode="pack_causal")
    assert model.attention_backend == "torch"
    cores = [m for m in model.modules() if isinstance(m, ThdCoreAttention)]
    assert len(cores) == 2 and all(c.mode == "thd" for c in cores)
    assert sum(isinstance(m, SequenceParallelNorm) for m in model.modules()) == 5
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())

    samples = [{"input_ids": list(range(3, 3 + n)) + [2], "loss_mask": [0] * 3 + [1] * (n - 2)} for n in (9, 6, 12)]
    batch = collate_thd(samples, pack_size=64, pad_multiple=4)
    args = (batch["tokens"], batch["position_ids"], None)
    logits = model(*args, packed_seq_params=get_packed_seq_params(batch))
    assert logits.shape == (1, batch["tokens"].shape[1], cfg.model.vocab_size)
    wrong = broken(*args, packed_seq_params=get_packed_seq_params(batch))
    first = slice(0, 9)  # the first sample sees nothing before it even in the broken model
    torch.testing.assert_close(wrong[0, first], logits[0, first], atol=1e-5, rtol=1e-5)
    assert float((wrong[0, 12:18] - logits[0, 12:18]).abs().max()) > 1e-3


def test_build_model_same_seed_same_weights(world_of_one):
    from megatron_pack.parallel.groups import initialize_parallel

    cfg = _cfg()
    state = initialize_parallel(cfg)
    a, b = builder.build_model(cfg, state), builder.build_model(cfg, state)
    c = builder.build_model(Config(model=cfg.model, train=TrainConfig(seed=7)), state)
    pairs = list(zip(a.parameters(), b.parameters(), c.parameters()))
    assert all(torch.equal(x, y) for x, y, _ in pairs)
    assert any(not torch.equal(x, z) for x, _, z in pairs)


def test_cpu_compat_refuses_cuda_hosts(monkeypatch):
    from megatron_pack.model import cpu_compat

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="GPU path must not use it"):
        cpu_compat.enable_cpu_compat()


def test_cpu_rng_tracker_forks_a_named_cpu_stream():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    from megatron_pack.model.cpu_compat import cpu_compat_enabled, enable_cpu_compat

    enable_cpu_compat()
    assert cpu_compat_enabled() and torch.cuda.current_device() == "cpu"
    model_parallel_cuda_manual_seed(5, tp_rank=0, ep_rank=0, etp_rank=0)
    torch.manual_seed(0)
    outside_before = torch.get_rng_state()
    with get_cuda_rng_tracker().fork():
        first = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outside_before)  # the default stream is untouched
    with get_cuda_rng_tracker().fork():
        second = torch.rand(3)
    assert not torch.equal(first, second)  # the named stream advanced
    model_parallel_cuda_manual_seed(5, tp_rank=0, ep_rank=0, etp_rank=0)
    with get_cuda_rng_tracker().fork():
        assert torch.equal(torch.rand(3), first)  # and is reproducible from its seed


def test_cuda_graphs_need_the_te_backend():
    cfg = _cfg(cuda_graph_impl="local")
    with pytest.raises(ValueError, match=r"model.cuda_graph_impl \('local'\) needs the Transformer Engine backend"):
        builder._check_cuda_graphs(cfg, "torch")
    builder._check_cuda_graphs(cfg, "te")


@pytest.mark.parametrize("env,deterministic,backend,expected", [
    (None, True, "te", "0"),
    ("0", True, "te", "0"),
    (None, False, "te", None),
    (None, True, "torch", None),
], ids=["te_sets_env", "te_env_already_0", "te_not_deterministic", "torch_untouched"])
def test_deterministic_te_env(monkeypatch, env, deterministic, backend, expected):
    monkeypatch.delenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", raising=False)
    if env is not None:
        monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", env)
    builder._deterministic_te_env(Config(train=TrainConfig(deterministic=deterministic)), backend)
    import os

    assert os.environ.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO") == expected


def test_deterministic_te_env_conflict_names_the_fix(monkeypatch):
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1")
    with pytest.raises(ValueError, match="set train.deterministic=false"):
        builder._deterministic_te_env(Config(), "te")


@pytest.mark.parametrize("value,spelled", [("p2p", "p2p"), ("a2a", "a2a"), ("allgather", "all_gather"),
                                           ("a2a+p2p", "a2a+p2p")], ids=["p2p", "a2a", "allgather", "a2a+p2p"])
def test_cp_comm_type_spelling_covers_every_choice(value, spelled):
    from megatron_pack.config.choices import CP_COMM_TYPES

    assert value in CP_COMM_TYPES and len(CP_COMM_TYPES) == 4  # the table above is the whole list
    assert builder.te_cp_comm_type(value) == spelled  # megatron-core / TE spelling


def test_cp_comm_type_outside_the_list_is_refused():
    with pytest.raises(ValueError, match=r"parallel.cp_comm_type \('ring'\)"):
        builder.te_cp_comm_type("ring")


def test_sbhd_batches_attend_causally_per_row(world_of_one):
    """Without packed_seq_params (a plain [b, s] batch) every row is one causal sequence."""
    from megatron_pack.data.batches.thd import collate_thd
    from megatron_pack.parallel.groups import initialize_parallel
    from megatron_pack.training.step import get_packed_seq_params

    cfg = _cfg()
    state = initialize_parallel(cfg)
    model = builder.build_model(cfg, state)
    tokens = torch.randint(3, 380, (2, 10), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(10).expand(2, 10)
    logits = model(tokens, positions, None)
    for row in range(2):
        sample = {"input_ids": tokens[row].tolist() + [2], "loss_mask": [1] * 11}
        batch = collate_thd([sample], pack_size=16)
        alone = model(batch["tokens"], batch["position_ids"], None, packed_seq_params=get_packed_seq_params(batch))
        torch.testing.assert_close(logits[row], alone[0], atol=1e-5, rtol=1e-5)


def test_apex_wgrad_fusion_only_with_cuda_and_apex(monkeypatch):
    assert builder.apex_wgrad_fusion_available() is False  # this CPU host
    assert builder.transformer_config_from(Config()).gradient_accumulation_fusion is False
    assert builder.apex_wgrad_fusion_available(on_gpu=True) is False  # a GPU run but no apex extension
