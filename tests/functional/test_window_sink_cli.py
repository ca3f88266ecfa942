"""gpt-oss and Gemma 3 on the command line, as a user runs them (issue 45 items 4 and 5).

Each family's tiny random folder (window 8, shorter than every sample; gpt-oss's learnable sinks, biased experts,
YaRN; Gemma's local and global layers, four norms, tied embeddings: ``_window_families.py``) carries a tiny tokenizer
with the family's special tokens and chat template, written after the Hub's (gpt-oss's harmony template with its
channels; Gemma 3's ``<start_of_turn>`` template):

1. ``prepare`` renders chat records through the template, and ``inspect DIR sample=I`` shows which tokens carry loss
   (docs/data.md "Chat templates of gpt-oss and Gemma 3"): harmony's last assistant turn from its analysis channel
   (the ``thinking`` field) to ``<|return|>``, earlier turns' final channel with ``<|end|>`` (marked template);
   Gemma's answer, ``<end_of_turn>``, the newline and the ``<eos>`` appended.
2. ``megatron-pack verify verify.reference=transformers`` at CP=2 (torchrun, 2 ranks) passes for both: each pack's
   logits equal transformers' of each sample alone.
3. ``megatron-pack train`` 2 steps at CP=2 (DP=1, two micro-batches a step) and at CP=1 (DP=2) on the same plan:
   the same losses and the same updated weights (1e-5).
4. ``megatron-pack export`` of the CP=2 run's checkpoint: transformers loads it, and ``generate`` (greedy) gives the
   tokens our model gives from the checkpoint.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _user_path import ok, refused, write_jsonl  # noqa: E402
from _window_families import family_folder, harmony  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

FAMILIES = ("gpt_oss", "gemma3")
PACK = {"gpt_oss": 1024, "gemma3": 256}
"""Pack sizes: a harmony sample is about 290 tokens (its system message), a Gemma one 40-80: three or more a pack."""
TRAIN = ["train.train_iters=2", "train.global_batch_size=2", "train.lr_warmup_iters=1", "logging.tensorboard=false",
         "train.adam_eps=1e-4"]
"""AdamW's first step moves a weight by lr * g / (|g| + eps): about lr whatever g's size, so with eps 1e-8 a
gradient near 0 whose last bits differ with the reduction order (CP=2 sums a sample's keys in two halves) moved
gpt-oss's weights up to 2.6e-5 apart (of steps of 3.3e-3); eps 1e-4 keeps such steps proportional to g."""
PROMPT = "what is two plus two"


def _records(family: str) -> list[dict]:
    out = []
    for i in range(16):
        answer = " ".join(["the answer is four"] * (1 + i % 4))
        turn = {"role": "assistant", "content": answer}
        if family == "gpt_oss":
            turn["thinking"] = " ".join(["let me add two and two"] * (1 + i % 3))
        system = [{"role": "system", "content": "be brief"}] if i % 2 else []
        out.append({"messages": [*system, {"role": "user", "content": PROMPT + " hello world" * (i % 3)}, turn]})
    return out


def _run(family: str) -> list[str]:
    return [f"model.pretrained={family}", f"data.dataset_dir=ds_{family}", "model.attention_backend=torch",
            "train.device=cpu"]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """Both folders, their data prepared for CP=2, then one job on the session's torchrun world: verify at CP=2 and
    train at CP=2 and CP=1 for each family; each run's checkpoint exported."""
    root = tmp_path_factory.mktemp("window_sink_cli")
    for family in FAMILIES:
        family_folder(root, family)
        write_jsonl(root / f"{family}.jsonl", _records(family))
        ok(root, "prepare", *_run(family), "data=files", f"data.input={family}.jsonl", "parallel=cp2",
           f"packing.packed_sequence_size={PACK[family]}", "data.tokenize_workers=1")
    cases = {}
    for family in FAMILIES:
        cases[f"verify_{family}"] = ["verify", *_run(family), "parallel=cp2", "verify.reference=transformers",
                                     "verify.num_packs=2"]
        for cp in (2, 1):
            cases[f"{family}_cp{cp}"] = ["train", *_run(family), f"parallel=cp{cp}", *TRAIN,
                                         f"train.output_dir=runs/{family}_cp{cp}"]
    from _train_world import run_in_world

    outputs = run_in_world(root, cases, timeout=500)
    for family in FAMILIES:
        for cp in (2, 1):
            ok(root, "export", f"checkpoint=runs/{family}_cp{cp}/checkpoints", f"output=exports/{family}_cp{cp}")
    return root, outputs



SYSTEM = ("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: "
          "2024-06\nCurrent date: 2025-08-05\n\nReasoning: medium\n\n# Valid channels: analysis, commentary, final. "
          "Channel must be included for every message.<|end|>")
SHOWN = {  # family: sample 1 (system "be brief", one user turn, the answer) as inspect shows it, loss in [[...]]
    "gpt_oss": SYSTEM + "<|start|>developer<|message|># Instructions\n\nbe brief\n\n<|end|><|start|>user<|message|>"
               "what is two plus two hello world<|end|><|start|>assistant[[<|channel|>analysis<|message|>let me add "
               "two and two let me add two and two<|end|><|start|>assistant<|channel|>final<|message|>the answer is "
               "four the answer is four<|return|>]]\n",
    "gemma3": "<bos><start_of_turn>user\nbe brief\n\nwhat is two plus two hello world<end_of_turn>\n<start_of_turn>"
              "model\n[[the answer is four the answer is four<end_of_turn>\n<eos>]]\n",
}
MULTI_TURN = [{"role": "user", "content": "hello world"},
              {"role": "assistant", "thinking": "count the apples", "content": "hello world"},
              {"role": "user", "content": PROMPT},
              {"role": "assistant", "thinking": "let me add two and two", "content": "the answer is four"}]
MULTI_SHOWN = (SYSTEM + "<|start|>user<|message|>hello world<|end|><|start|>assistant[[<|channel|>final<|message|>"
               "hello world<|end|>]]<|start|>user<|message|>what is two plus two<|end|><|start|>assistant[[<|channel|>"
               "analysis<|message|>let me add two and two<|end|><|start|>assistant<|channel|>final<|message|>the "
               "answer is four<|return|>]]\n")
"""Harmony with ``{% generation %}`` markers: the first turn's final channel and ``<|end|>`` carry loss, its
reasoning is not rendered (the template drops the analysis channel of every turn but the last)."""


@pytest.mark.parametrize("family", FAMILIES)
def test_inspect_shows_which_tokens_of_the_family_template_carry_loss(work, family):
    root, _ = work
    shown = ok(root, "inspect", f"ds_{family}", "sample=1")
    assert shown.endswith(SHOWN[family]), shown[-1500:]


def test_harmony_with_markers_trains_every_turn_and_equals_the_template_as_shipped_on_one_turn(work):
    """Multi-turn harmony needs the markers (the template as shipped ends the last turn with ``<|return|>`` and
    earlier ones with ``<|end|>``, so the text of a prefix is not a prefix of the text: refused in one line, exit
    2); on one turn both templates give the same ids and loss."""
    root, _ = work
    (root / "harmony_marked.jinja").write_text(harmony(marked=True))
    write_jsonl(root / "multi.jsonl", [{"messages": MULTI_TURN}])
    write_jsonl(root / "one.jsonl", [_records("gpt_oss")[1]])
    common = [*_run("gpt_oss")[:1], "data=files", "packing.packed_sequence_size=512", "data.tokenize_workers=1"]
    ok(root, "prepare", *common, "data.input=multi.jsonl", "data.dataset_dir=ds_multi",
       "data.chat_template=harmony_marked.jinja")
    assert ok(root, "inspect", "ds_multi", "sample=0").endswith(MULTI_SHOWN)
    line = refused(root, "prepare", *common, "data.input=multi.jsonl", "data.dataset_dir=ds_refused")
    assert "multi.jsonl: line 1: chat template of gpt_oss is not prefix-stable at message 1" in line
    assert "add {% generation %} markers to the template" in line
    ok(root, "prepare", *common, "data.input=one.jsonl", "data.dataset_dir=ds_one_marked",
       "data.chat_template=harmony_marked.jinja")
    assert ok(root, "inspect", "ds_one_marked", "sample=0").endswith(SHOWN["gpt_oss"])


REASONING_REFUSED = {  # id: (tokenizer, record, fragment of the one line); never a dropped reasoning
    "template_never_reads_it": ("gemma3", {"messages": MULTI_TURN},
                                "an assistant turn has 'thinking' (reasoning), which the chat template of"),
    "byte_tokenizer": ("byte", {"messages": MULTI_TURN}, "which data.tokenizer=byte has no place for"),
    "on_a_user_turn": ("gpt_oss", {"messages": [{"role": "user", "content": "hi", "thinking": "no"}, MULTI_TURN[1]]},
                       "messages[0].thinking ('no') must be a string on an assistant turn"),
}


@pytest.mark.parametrize("tokenizer,record,fragment", REASONING_REFUSED.values(), ids=REASONING_REFUSED.keys())
def test_reasoning_that_would_be_lost_is_refused_in_one_line(work, tokenizer, record, fragment):
    root, _ = work
    write_jsonl(root / "thinking.jsonl", [record])
    text = refused(root, "prepare", f"data.tokenizer={tokenizer}", "data=files", "data.input=thinking.jsonl",
                   "data.dataset_dir=ds_thinking", "data.tokenize_workers=1")
    assert fragment in text, text


PACK_LINE = re.compile(r"^pack \d+: (\d+) samples, .* max \|logit diff\| (\S+)  max \|loss diff\| (\S+)  .*(PASS|FAIL)$")


@pytest.mark.parametrize("family", FAMILIES)
def test_verify_against_transformers_at_cp2_passes(work, family):
    _, outputs = work
    out = outputs[f"verify_{family}"]
    assert f"ours: {family} at PP=1 TP=1 CP=2 EP=1 DP=1 (torch attention, float32)" in out
    packs = [m for m in map(PACK_LINE.match, out.splitlines()) if m]
    assert len(packs) == 2 and max(int(m[1]) for m in packs) >= 3  # packs of several samples
    assert all(m[4] == "PASS" and float(m[2]) <= 1e-5 for m in packs), out[-3000:]
    assert "verify: 2/2 packs PASS (tolerance 0.0001, reference transformers): PASS" in out


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_two_steps_at_cp2_equal_cp1(work, family):
    """Losses of both steps and every updated weight (through the exports) agree to 1e-5; training moved them."""
    root, _ = work
    losses = {}
    for cp in (2, 1):
        records = [json.loads(line) for line in (root / f"runs/{family}_cp{cp}/metrics.jsonl").read_text().splitlines()]
        losses[cp] = [r["lm_loss"] for r in records if "lm_loss" in r]
    assert len(losses[2]) == 2 and losses[2][1] < losses[2][0]
    assert losses[2] == pytest.approx(losses[1], rel=1e-5)
    two, one, source = (_tensors(root / p) for p in (f"exports/{family}_cp2", f"exports/{family}_cp1", family))
    assert sorted(two) == sorted(one) and set(two) <= set(source)
    for name in two:
        torch.testing.assert_close(two[name], one[name], atol=1e-5, rtol=1e-5, msg=name)
    moved = [n for n in two if float((two[n] - source[n]).abs().max()) > 1e-4]
    assert len(moved) == len(two), sorted(set(two) - set(moved))


def _our_greedy(root: Path, family: str, prompt: list[int], num_tokens: int) -> list[int]:
    """Greedy decoding with our model from the CP=2 run's checkpoint (world 1, one sample a pack)."""
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
        cfg = single_process_config(load_config([f"model.pretrained={family}", "model.attention_backend=torch",
                                                 "train.device=cpu", "peft.method=none"]))
        state = initialize_parallel(cfg)
        try:
            model = build_model(cfg, state)
            load_model_weights(model, root / f"runs/{family}_cp2/checkpoints")
            model.eval()
            ids = list(prompt)
            for _ in range(num_tokens):
                batch = collate_thd([{"input_ids": ids + [0], "loss_mask": [1] * (len(ids) + 1)}], pack_size=len(ids))
                with torch.no_grad():
                    logits = model(batch["tokens"], batch["position_ids"], None,
                                   packed_seq_params=get_packed_seq_params(batch))
                ids.append(int(logits[0, len(ids) - 1, :301].argmax()))
        finally:
            destroy_parallel(destroy_process_group=True)
    finally:
        os.chdir(cwd)
    return ids[len(prompt):]


@pytest.mark.parametrize("family", FAMILIES)
def test_export_generates_what_our_trained_model_generates(work, family):
    """transformers' greedy ``generate`` on the export of the CP=2 run: the tokens our model picks from the same
    checkpoint, after the family's generation prompt."""
    import transformers as T

    root, _ = work
    folder = root / f"exports/{family}_cp2"
    tok = T.AutoTokenizer.from_pretrained(folder)
    prompt = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True,
                                     return_dict=True)["input_ids"]
    model = T.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False)
    theirs = out[0, len(prompt):].tolist()
    assert len(theirs) == 6
    assert theirs == _our_greedy(root, family, prompt, 6)
