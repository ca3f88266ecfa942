"""Tiny gpt-oss and Gemma 3 folders with their families' chat templates, for issue 45's command-line tests.

``family_folder(root, family)`` is the unit tests' tiny random model (tests/unit/test_gpt_oss.py,
tests/unit/test_gemma3.py: window 8, four layers) with a tiny byte-level BPE tokenizer of the family's own special
tokens and chat template instead of the generic one: gpt-oss's harmony template (``HARMONY``), Gemma 3's
``<start_of_turn>`` template (``GEMMA3``). Both templates are written here after the structure of the ones the Hub
folders ship (openai/gpt-oss-20b's ``chat_template.jinja``; google/gemma-3-1b-it's ``tokenizer_config.json``), with
what these tests do not use left out (named at each).
"""

from __future__ import annotations

import sys
from pathlib import Path

_UNIT = str(Path(__file__).resolve().parents[1] / "unit")
if _UNIT not in sys.path:
    sys.path.insert(0, _UNIT)

HARMONY = """\
{#- gpt-oss's harmony template (openai/gpt-oss-20b chat_template.jinja) less its tools, tool calls and
    strftime_now: the date is fixed so the rendering is the same every day -#}
{%- macro build_system_message() -%}
    {%- if model_identity is not defined %}
        {%- set model_identity = "You are ChatGPT, a large language model trained by OpenAI." %}
    {%- endif %}
    {{- model_identity + "\\n" }}
    {{- "Knowledge cutoff: 2024-06\\n" }}
    {{- "Current date: 2025-08-05\\n\\n" }}
    {%- if reasoning_effort is not defined %}
        {%- set reasoning_effort = "medium" %}
    {%- endif %}
    {{- "Reasoning: " + reasoning_effort + "\\n\\n" }}
    {{- "# Valid channels: analysis, commentary, final. Channel must be included for every message." }}
{%- endmacro -%}
{{- "<|start|>system<|message|>" }}
{{- build_system_message() }}
{{- "<|end|>" }}
{%- if messages[0].role == "developer" or messages[0].role == "system" %}
    {%- set developer_message = messages[0].content %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set developer_message = "" %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if developer_message %}
    {{- "<|start|>developer<|message|>" }}
    {{- "# Instructions\\n\\n" }}
    {{- developer_message }}
    {{- "\\n\\n" }}
    {{- "<|end|>" }}
{%- endif %}
{%- for message in loop_messages -%}
    {%- if message.role == 'assistant' -%}
        {%- if loop.last and not add_generation_prompt -%}
            {#- the CoT is rendered only in the last turn, in training; <|return|> ends the last turn #}
            {{- "<|start|>assistant" }}{% generation %}
            {%- if "thinking" in message %}
                {{- "<|channel|>analysis<|message|>" + message.thinking + "<|end|><|start|>assistant" }}
            {%- endif %}
            {{- "<|channel|>final<|message|>" + message.content + "<|return|>" }}{% endgeneration %}
        {%- else -%}
            {#- CoT is dropped during all previous turns #}
            {{- "<|start|>assistant" }}{% generation %}
            {{- "<|channel|>final<|message|>" + message.content + "<|end|>" }}{% endgeneration %}
        {%- endif -%}
    {%- elif message.role == 'user' -%}
        {{- "<|start|>user<|message|>" + message.content + "<|end|>" }}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|start|>assistant
{%- endif -%}
"""
"""The harmony template with ``{% generation %}`` markers around what the assistant writes after the generation
prompt ``<|start|>assistant``: in every turn its final channel and end token, and in the last turn (the only one
that keeps its reasoning) the analysis channel too. ``harmony(marked=False)`` is the template as shipped."""


def harmony(marked: bool = True) -> str:
    if marked:
        return HARMONY
    return HARMONY.replace("{% generation %}", "").replace("{% endgeneration %}", "")


GEMMA3 = """\
{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""
"""Gemma 3's template (google/gemma-3-1b-it) less its image parts."""

WORDS = ("what is two plus two", "the answer is four", "let me add two and two", "hello world", "be brief",
         "count the apples", "three apples and one more")

SPECIALS = {  # family: (special tokens first: ids 0, 1, 2 are pad, bos and eos as in the model's config), eos
    "gpt_oss": (["<|endoftext|>", "<|startoftext|>", "<|return|>", "<|start|>", "<|message|>", "<|end|>",
                 "<|channel|>", "<|call|>", "<|constrain|>"], "<|return|>"),
    "gemma3": (["<pad>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], "<eos>"),
}


def family_tokenizer(path: Path, family: str, template: str):
    from _hf import bpe_tokenizer

    corpus = list(WORDS) + ["system user assistant model developer analysis final Instructions Reasoning medium",
                            "You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06\n"
                            "Current date: 2025-08-05\n\nReasoning: medium\n\n# Valid channels: analysis, "
                            "commentary, final. Channel must be included for every message."]
    specials, eos = SPECIALS[family]
    return bpe_tokenizer(path, corpus, specials, 290, template, eos=eos, pad=specials[0], bos=specials[1])


def family_folder(root: Path, family: str, template: str | None = None) -> Path:
    """The unit tests' tiny ``family`` folder in ``root/family``, with the family's tokenizer and template."""
    if family == "gpt_oss":
        from test_gpt_oss import _folder
    else:
        from test_gemma3 import _folder
    path = Path(_folder(Path(root)))
    family_tokenizer(path, family, template or (harmony(marked=False) if family == "gpt_oss" else GEMMA3))
    return path
