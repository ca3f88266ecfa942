"""Tiny random Hugging Face model folders for the HF-boundary tests (no network).

``make_family(root, family)`` builds a transformers model from a small config with a fixed seed,
saves it with ``save_pretrained(max_shard_size=...)`` (several shards + the index) and a tiny BPE
tokenizer (``tokenizers`` library) with a generation_config.json beside it. The five families of
issue 12:

| id            | what it exercises                                      |
|---------------|--------------------------------------------------------|
| llama_rope    | Llama, GQA (4 heads, 2 groups), rope_scaling llama3    |
| llama_tied    | Llama with tie_word_embeddings                         |
| qwen2_bias    | Qwen2: QKV bias                                        |
| qwen3_qknorm  | Qwen3: q_norm / k_norm, explicit head_dim != H / heads |
| mistral       | Mistral, sliding_window null                           |

Vocabulary 301 is odd on purpose: at TP=2 it is padded to 302 and the pad row must vanish again.
Biases and norm weights are randomised (save_pretrained's init sets them to 0 / 1, which would
hide a mapping that drops or swaps them).
"""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("llama_rope", "llama_tied", "qwen2_bias", "qwen3_qknorm", "mistral")
VOCAB = 301
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1,
               eos_token_id=2, pad_token_id=0)


def hf_config(family: str, num_layers: int = 2):
    import transformers as T

    if num_layers != 2:
        return type(hf_config(family))(**{**hf_config(family).to_dict(), "num_hidden_layers": num_layers})

    if family == "llama_rope":
        return T.LlamaConfig(**_COMMON, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    if family == "llama_tied":
        return T.LlamaConfig(**_COMMON, tie_word_embeddings=True)
    if family == "qwen2_bias":
        return T.Qwen2Config(**_COMMON, rope_theta=1000000.0)
    if family == "qwen3_qknorm":
        return T.Qwen3Config(**_COMMON, head_dim=24)
    if family == "mistral":
        return T.MistralConfig(**_COMMON, sliding_window=None)
    if family == "qwen3_moe":  # not in FAMILIES: the MoE case of the command-line matrix
        return T.Qwen3MoeConfig(**_COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                norm_topk_prob=True)
    raise ValueError(family)


def _randomise(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen) if "norm" in name
                        else 0.2 * torch.randn(p.shape, generator=gen))


CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


def bpe_tokenizer(path: Path, corpus: list[str], specials: list[str], vocab_size: int, chat_template: str, *,
                  eos: str, pad: str, bos: str | None = None):
    """A tiny byte-level BPE tokenizer trained on ``corpus * 20`` with ``specials`` first (ids 0, 1, ...),
    saved with ``chat_template`` to ``path``; returns the ``PreTrainedTokenizerFast``. Every tiny tokenizer of
    the tests (text, VLM model, VLM data) is this one with its own corpus, specials and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus * 20, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=pad,
                                   **({"bos_token": bos} if bos else {}))
    fast.chat_template = chat_template
    fast.save_pretrained(path)
    return fast


def save_tokenizer(path: Path) -> None:
    bpe_tokenizer(path, ["hello world", "what is two plus two", "four", "the answer is", "system user assistant"],
                  ["<pad>", "<s>", "</s>"], 290, CHAT_TEMPLATE, bos="<s>", eos="</s>", pad="<pad>")


def larger_tokenizer(path: Path, vocab_size: int = 361):
    """A byte-level BPE of ``vocab_size`` ids (up to about 400), larger than the families' vocabulary of 301: the
    corpus is 300 made-up words, which gives more merges than ``save_tokenizer``'s (issue 43's tokenizer larger
    than the model)."""
    import random

    gen = random.Random(0)
    words = ["".join(gen.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(gen.randint(3, 8))) for _ in range(300)]
    corpus = [" ".join(words[i:i + 10]) for i in range(0, 300, 10)] + ["what is two plus two", "the answer is"]
    return bpe_tokenizer(path, corpus, ["<pad>", "<s>", "</s>"], vocab_size, CHAT_TEMPLATE, bos="<s>", eos="</s>",
                         pad="<pad>")


def make_family(root: Path | str, family: str, *, seed: int = 0, dtype=torch.float32,
                max_shard_size: str = "60KB", name: str | None = None, num_layers: int = 2) -> Path:
    """A saved tiny model folder ``root/<name or family>`` (several safetensors shards + index + tokenizer)."""
    import transformers as T

    path = Path(root) / (name or family)
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(hf_config(family, num_layers)).to(dtype)
    _randomise(model, seed + 1)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    T.GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0, temperature=0.7, do_sample=True).save_pretrained(path)
    save_tokenizer(path)
    return path


def hf_logits(folder: Path | str, samples: list[list[int]]) -> list[torch.Tensor]:
    """transformers' float32 logits [n, V] for each sample run alone (the reference)."""
    import transformers as T

    model = T.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return [model(torch.tensor([ids])).logits[0].float() for ids in samples]


# --- running the CLI on a folder made with make_family (the fine-tune tests share these) ---

def prepare_in(root: Path, args: list[str]) -> None:
    """``megatron-pack prepare ARGS`` in-process, with ``root`` as the working folder."""
    import os

    from megatron_pack.cli.prepare import main as prepare_main

    cwd = os.getcwd()
    os.chdir(root)
    try:
        assert prepare_main(list(args)) == 0
    finally:
        os.chdir(cwd)


def torchrun_train(root: Path, args: list[str], *, timeout: int = 400) -> str:
    """``torchrun --standalone --nproc-per-node 2 -m megatron_pack.train ARGS`` in ``root``, on the session's world
    of 2 ranks (``tests/_train_world.py``); its output (asserts exit 0)."""
    from _train_world import run_in_world

    return run_in_world(root, {"train": ["train", *args]}, timeout=timeout)["train"]


def torchrun_train_cases(root: Path, cases: dict[str, list[str]], *, timeout: int = 600) -> dict:
    """Every ``megatron-pack train`` run of ``cases`` (name -> arguments), in their order, in ``root`` on the
    session's world of 2 ranks (``tests/_train_world.py``: the agent's and the ranks' start-up paid once a session);
    each case's output (both ranks' stdout and stderr)."""
    from _train_world import run_in_world

    return run_in_world(root, {name: ["train", *argv] for name, argv in cases.items()}, timeout=timeout)


def cli(root: Path, *args: str, timeout: int = 300) -> tuple[int, str]:
    """``megatron-pack ARGS`` in ``root``: exit code and output."""
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "megatron_pack.cli.main", *args], cwd=root, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return proc.returncode, proc.stdout + proc.stderr


def packed_logits(root: Path, args: list[str], weights: Path, samples: list[list[int]]) -> list[torch.Tensor]:
    """Our logits [n - 1, VOCAB] per sample, all in one THD pack, from the checkpoint ``weights``
    (a run folder's checkpoints/ or one step) of the run configured by ``args`` (TP=1, one process).
    Sample ``s`` gives the logits of its tokens ``s[:-1]``; pad-vocabulary columns are dropped."""
    import os

    from megatron_pack.cli.verify import load_model_weights, single_process_config
    from megatron_pack.config import load_config
    from megatron_pack.data.batches.thd import collate_thd
    from megatron_pack.model.builder import build_model
    from megatron_pack.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_pack.training.step import get_packed_seq_params

    cwd = os.getcwd()
    os.chdir(root)
    try:
        cfg = single_process_config(load_config(list(args)))
        state = initialize_parallel(cfg)
        try:
            model = build_model(cfg, state)
            load_model_weights(model, weights)
            model.eval()
            batch = collate_thd([{"input_ids": s, "loss_mask": [1] * len(s)} for s in samples], pack_size=256)
            with torch.no_grad():
                logits = model(batch["tokens"], batch["position_ids"], None,
                               packed_seq_params=get_packed_seq_params(batch))[0]
        finally:
            destroy_parallel(destroy_process_group=True)
    finally:
        os.chdir(cwd)
    cu = batch["cu_seqlens_padded"].tolist()
    return [logits[cu[i]:cu[i] + len(s) - 1, :VOCAB] for i, s in enumerate(samples)]


def docs_tiny_llama(work: Path | str) -> Path:
    """``work/models/tiny-llama`` made by running docs/models.md's snippet as written ("A tiny folder for
    `experiment=pretrained_tiny`"), so the tests prove the folder the docs tell people to build."""
    return docs_tiny_folder(work, "pretrained_tiny", "tiny-llama")


def docs_tiny_folder(work: Path | str, recipe: str, name: str) -> Path:
    """``work/models/<name>``, made by running the snippet of docs/models.md's section "A tiny folder for
    `experiment=<recipe>`" as written, in ``work``."""
    import os
    import re

    doc = (Path(__file__).resolve().parents[1] / "docs" / "models.md").read_text(encoding="utf-8")
    section = doc.split(f"## A tiny folder for `experiment={recipe}`", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    cwd = os.getcwd()
    try:
        os.chdir(work)
        torch.manual_seed(0)
        exec(compile(code, "docs/models.md", "exec"), {})
    finally:
        os.chdir(cwd)
    return Path(work) / "models" / name


class MemoryPacks:
    """An in-memory packed dataset: what ``megatron-pack verify`` reads (packs of samples, the plan's metadata),
    for a spawned world that verifies without a prepared folder. The first 3 ids of a sample are prompt."""

    plan_dir = "in-memory packs"

    def __init__(self, packs: list[list[list[int]]], *, pack_size: int, pad_multiple: int):
        self.packs = [[{"input_ids": ids, "loss_mask": [0] * 3 + [1] * (len(ids) - 3), "sample_id": 10 * p + i}
                       for i, ids in enumerate(pack)] for p, pack in enumerate(packs)]
        self.metadata = {"pack_size": pack_size, "pad_seq_to_mult": pad_multiple, "pad_id": 0}

    def __len__(self) -> int:
        return len(self.packs)

    def __getitem__(self, index: int) -> list[dict]:
        return self.packs[index]


def logit_change(folder: Path | str, config, ids: torch.Tensor) -> float:
    """The largest change of transformers' logits of ``ids`` when the folder's model is loaded with ``config``
    instead of its own config.json (the family tests' guard: a feature whose removal changes nothing proves nothing)."""
    import transformers as T

    with torch.no_grad():
        ref = T.AutoModelForCausalLM.from_pretrained(folder).eval()(ids).logits
        other = T.AutoModelForCausalLM.from_pretrained(folder, config=config).eval()(ids).logits
    return float((ref - other).abs().max())


def config_refusal(folder: Path, hf: dict) -> str:
    """The message ``pretrained_model_keys`` refuses a folder with config.json ``hf`` with (fails if it reads it)."""
    import json

    import pytest

    from megatron_pack.config.hf_config import UnsupportedModel, pretrained_model_keys

    (folder / "config.json").write_text(json.dumps(hf))
    with pytest.raises(UnsupportedModel) as info:
        pretrained_model_keys(folder)
    return str(info.value)


def spread_lora_outputs(model, *, scale: float = 0.05, seed: int | None = 3) -> None:
    """Fill every LoRA B (``linear_out``, zero at initialisation) of ``model`` with ``scale`` x N(0, 1) draws, so
    that the adapters change the logits (a test comparing adapted logits would pass vacuously with B = 0)."""
    from megatron_pack.model.peft.lora import adapter_state

    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    with torch.no_grad():
        for name, param in adapter_state(model).items():
            if "linear_out" in name:
                param.copy_(scale * torch.randn(param.shape, generator=gen))


def peft_logits(folder: Path | str, adapter: Path | str, samples: list[list[int]]):
    """transformers' causal LM of ``folder`` with the peft ``adapter`` folder loaded: ``(each sample's logits on
    ids[:-1], the PeftModel)``; guarded: the adapters change every sample's logits by more than 1e-3 (a check of
    our logits against these would pass vacuously with adapters that do nothing)."""
    import transformers as T
    from peft import PeftModel

    base = T.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        plain = [base(torch.tensor([ids[:-1]])).logits[0] for ids in samples]
        tuned = PeftModel.from_pretrained(base, adapter).eval()
        refs = [tuned(torch.tensor([ids[:-1]])).logits[0] for ids in samples]
    assert all(float((ref - p).abs().max()) > 1e-3 for ref, p in zip(refs, plain)), "the adapters do not act"
    return refs, tuned
