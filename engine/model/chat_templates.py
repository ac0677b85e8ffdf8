"""Chat templates for families whose files may ship without one.

A model folder's tokenizer files and a GGUF file's ``tokenizer.chat_template`` normally carry the
model's own template, and that one is always used. Some files have none (the Gemma-3-270M GGUF
has none); for those, the family's turn format is written here, from the family's documented
format, with the token that ends a turn (added to the stop tokens).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ChatFormat:
    """A family's chat template (Jinja, as ``tokenizer.apply_chat_template`` takes it) and the
    token that ends each turn (the model emits it when its reply is done)."""

    template: str
    end_of_turn: str


# Gemma: turns are "<start_of_turn>{user|model}\n...<end_of_turn>\n"; there is no system role,
# so system text is put at the head of the next user turn.
GEMMA_CHAT = ChatFormat(
    template=(
        "{{ bos_token }}"
        "{%- set ns = namespace(system='') -%}"
        "{%- for message in messages -%}"
        "{%- if message['role'] == 'system' -%}"
        "{%- set ns.system = ns.system + message['content'] | trim + '\\n\\n' -%}"
        "{%- else -%}"
        "{%- set role = 'model' if message['role'] == 'assistant' else 'user' -%}"
        "{{- '<start_of_turn>' + role + '\\n' -}}"
        "{%- if role == 'user' -%}{{- ns.system -}}{%- set ns.system = '' -%}{%- endif -%}"
        "{{- message['content'] | trim + '<end_of_turn>\\n' -}}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
    ),
    end_of_turn="<end_of_turn>",
)

# family (engine.model.registry) -> its format, where a file may lack a template.
FAMILY_CHAT_FORMATS: dict[str, ChatFormat] = {"gemma3": GEMMA_CHAT}
