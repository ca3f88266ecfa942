"""`megatron-pack inspect DIR sample=I`: one sample decoded, its loss-carrying ids marked, its pack named
(issue 43, item 7).

Each case prepares a two-record chat file with one tokenizer (a ChatML template without generation markers, the
same with ``{% generation %}`` markers, a vision-language folder with an image part, the byte tokenizer) and runs
the console script's ``main``; the decoded text must equal the hand-written one, the answers (and their
``<|im_end|>``) inside ``[[ ]]``, the prompts outside, the image as its placeholder.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHATML_MARKED = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}"
                 "{{ m['content'] }}<|im_end|>{% endgeneration %}{{ '\\n' }}{% else %}<|im_start|>{{ m['role'] }}\n"
                 "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TWO_TURNS = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hello world"},
                          {"role": "user", "content": "what is two plus two"},
                          {"role": "assistant", "content": "four"}]}
FIRST = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "the answer is"}]}
# without markers the answer is what the template adds after the prompt, so the newline after <|im_end|> of a
# middle turn carries loss; the marked template leaves it outside {% generation %}: one command shows the difference
PLAIN_TEXT = ("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n[[hello world<|im_end|>\n]]<|im_start|>user\n"
              "what is two plus two<|im_end|>\n<|im_start|>assistant\n[[four<|im_end|>]]")
MARKED_TEXT = PLAIN_TEXT.replace("<|im_end|>\n]]", "<|im_end|>]]\n")


def _text_tokenizer(path: Path, template: str) -> Path:
    from _hf import bpe_tokenizer

    bpe_tokenizer(path, ["hello world", "what is two plus two", "four", "the answer is", "system user assistant"],
                  ["<pad>", "<s>", "<|im_start|>", "<|im_end|>"], 300, template, eos="<|im_end|>", pad="<pad>")
    return path


def _vlm(root: Path) -> tuple[Path, list[dict]]:
    from _vlm_data import make_image, make_vlm_data_folder

    folder = make_vlm_data_folder(root)
    make_image(root / "red.png", 56, 28)
    record = {"messages": [{"role": "user", "content": [{"type": "image", "image": "red.png"},
                                                        {"type": "text", "text": "what color is it"}]},
                           {"role": "assistant", "content": "a red square"}]}
    return folder, [FIRST, record]


# id, tokenizer (root -> (folder or "byte", records)), the decoded sample 1 (prompt outside, answers inside [[ ]])
CASES = [
    ("chatml-without-generation-markers", lambda root: (_text_tokenizer(root / "plain", CHATML), [FIRST, TWO_TURNS]),
     PLAIN_TEXT),
    ("chatml-with-generation-markers",
     lambda root: (_text_tokenizer(root / "marked", CHATML_MARKED), [FIRST, TWO_TURNS]), MARKED_TEXT),
    ("image-placeholder", _vlm,
     "<|im_start|>user\n<|vision_start|><image 0: 2 tokens><|vision_end|>what color is it<|im_end|>\n"
     "<|im_start|>assistant\n[[a red square<|im_end|>]]"),
    ("byte-tokenizer", lambda root: ("byte", [FIRST, TWO_TURNS]),
     "<bos><|user|>hello<eos><|assistant|>[[hello world<eos>]]<|user|>what is two plus two<eos><|assistant|>"
     "[[four<eos>]]"),
]


@pytest.mark.parametrize("make,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_sample_is_decoded_with_its_loss_marked(tmp_path, capsys, make, expected):
    from megatron_pack.cli.main import main
    from megatron_pack.data.batches.dataset import PackedSFTDataset
    from megatron_pack.data.store.metadata import list_plans

    tokenizer, records = make(tmp_path)
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    ds = tmp_path / "ds"
    assert main(["prepare", "data=files", f"data.input={tmp_path / 'chat.jsonl'}", f"data.tokenizer={tokenizer}",
                 f"data.dataset_dir={ds}", "packing.packed_sequence_size=256", "data.tokenize_workers=1"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(ds), "sample=1"]) == 0
    out = capsys.readouterr().out.splitlines()
    head, where, text = out[0], out[1], "\n".join(out[2:])
    assert text == expected, text
    plan = list_plans(ds)[0]
    dataset = PackedSFTDataset(ds, plan)
    pack = int(where.split("pack ")[1].split(",")[0])
    k = int(where.split("sample ")[1].split(" of")[0]) - 1
    sample = dataset[pack][k]  # guard: the pack named holds sample 1, and the marks are its loss mask
    assert sample["sample_id"] == 1 and where.startswith(f"  plan {plan.name}: pack {pack}, ")
    assert f"{int(np.asarray(sample['loss_mask'])[1:].sum())} carry loss" in head
    assert head.startswith(f"sample 1 of {ds} ({tmp_path / 'chat.jsonl'}: line 2): {len(sample['input_ids'])} ids")
    assert ("1 image" in head) == ("image" in expected)


@pytest.mark.parametrize("arg,fragment", [("sample=2", "sample (2) is not in"), ("sample=-1", "must be a sample index"),
                                          ("sample=one", "must be a sample index")],
                         ids=["past-the-end", "negative", "not-a-number"])
def test_a_sample_not_in_the_store_is_one_line(tmp_path, capsys, arg, fragment):
    from megatron_pack.cli.main import main

    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [FIRST, TWO_TURNS]))
    assert main(["prepare", "data=files", f"data.input={tmp_path / 'chat.jsonl'}", f"data.dataset_dir={tmp_path / 'ds'}",
                 "packing.packed_sequence_size=256", "data.tokenize_workers=1"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "ds"), arg]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("megatron-pack inspect: ") and fragment in err and len(err.splitlines()) == 1, err
