"""Built-in chat templates for models that ship none (`--chat-template NAME|FILE`).

Each template is written here from the model family's published prompt format
(the model cards); the rendered text is what the family's own template
produces for system/user/assistant turns. ``end`` is the text that closes a
turn: when the model's vocabulary lacks it as an end-of-sequence token, the
CLI adds it as a stop string so the answer ends with the turn.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .errors import InvalidArgumentError

MAX_TEMPLATE_BYTES = 1 << 20        # a real template is a few KB; refuse /dev/zero and friends


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    source: str            # jinja text, rendered with the tokenizer's settings
    end: str | None        # text that ends a turn (a stop string), None when unknown


# ChatML (Qwen, SmolLM, many fine-tunes): <|im_start|>role\ncontent<|im_end|>\n
_CHATML = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Llama 3: a header per turn, content trimmed, <|eot_id|> after it; BOS first
_LLAMA3 = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + (m['content'] | trim) + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

# Gemma: roles user and model only; a system prompt goes before the first user text
_GEMMA = (
    "{{ bos_token }}"
    "{% set ns = namespace(system='') %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set ns.system = (m['content'] | trim) + '\\n\\n' %}"
    "{% else %}"
    "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{% set prefix = ns.system if m['role'] == 'user' else '' %}"
    "{{ '<start_of_turn>' + role + '\\n' + prefix + (m['content'] | trim) + '<end_of_turn>\\n' }}"
    "{% if m['role'] == 'user' %}{% set ns.system = '' %}{% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)

# Phi-3: <|role|>\ncontent<|end|>\n, BOS first
_PHI3 = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

BUILTIN: dict[str, ChatTemplate] = {
    "chatml": ChatTemplate("chatml", _CHATML, "<|im_end|>"),
    "llama3": ChatTemplate("llama3", _LLAMA3, "<|eot_id|>"),
    "gemma": ChatTemplate("gemma", _GEMMA, "<end_of_turn>"),
    "phi3": ChatTemplate("phi3", _PHI3, "<|end|>"),
}


def resolve_chat_template(spec: str) -> ChatTemplate:
    """A built-in template by name, or a jinja file's text."""
    key = spec.strip().lower()
    if key in BUILTIN:
        return BUILTIN[key]
    p = Path(spec).expanduser()
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_TEMPLATE_BYTES + 1)
    except FileNotFoundError:
        raise InvalidArgumentError(
            f"--chat-template: {spec!r} is neither a built-in template ({', '.join(BUILTIN)}) "
            "nor an existing file") from None
    except OSError as e:
        raise InvalidArgumentError(f"--chat-template: cannot read {spec}: {e.strerror or e}") from None
    if len(raw) > MAX_TEMPLATE_BYTES:
        raise InvalidArgumentError(f"--chat-template: {spec} is larger than {MAX_TEMPLATE_BYTES >> 20} MiB; "
                                   "a chat template is a small jinja file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidArgumentError(f"--chat-template: {spec} is not UTF-8 text (byte {e.start})") from None
    if not text.strip():
        raise InvalidArgumentError(f"--chat-template: {spec} is empty")
    return ChatTemplate(p.name, text, None)
