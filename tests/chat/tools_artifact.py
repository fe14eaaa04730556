"""A tiny random-init model whose chat template is Hermes/Qwen-style (ChatML with a tools
section, ``<tool_call>`` blocks and ``tool`` results), its tokenizer with ``<tool_call>`` and
``</tool_call>`` as added tokens (as Qwen's are): the served model of the structured-output,
tool-call and echo tests."""
from __future__ import annotations

import json
from pathlib import Path

from kvserve_testing import CHATML_TOKENS, SEED, Artifact, chat_tokenizer

HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call functions.\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n"
    "For each call write <tool_call>\n{\"name\": <name>, \"arguments\": <object>}\n"
    "</tool_call><|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant"
    "{%- for tc in message.tool_calls %}\n<tool_call>\n{\"name\": \"{{ tc.function.name }}\", "
    "\"arguments\": {{ tc.function.arguments | tojson }}}\n</tool_call>{%- endfor %}"
    "<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{%- endif %}{% endif %}")
TOOL_TOKENS = ("<tool_call>", "</tool_call>")


def build_tools_artifact(root: Path, extra_tokens: tuple[str, ...] = ()) -> Artifact:
    """``extra_tokens``: more added tokens (a thinking model's ``<think>`` / ``</think>``)."""
    import torch

    from kvserve.export.pipeline import export_artifacts
    from kvserve.model.checkpoint import TOKENIZER_CONFIG, save_checkpoint
    from kvserve.model.config import preset
    from kvserve.model.transformer import Transformer

    tok = chat_tokenizer(CHATML_TOKENS + TOOL_TOKENS + tuple(extra_tokens))
    cfg = preset("tiny", vocab_size=tok.vocab_size, eos_token_id=tok.eos_id,
                 pad_token_id=tok.pad_id, init_std=0.1, max_seq_len=1024)
    torch.manual_seed(SEED)
    model = Transformer(cfg).eval()
    tc = {"chat_template": HERMES_TEMPLATE, "eos_token": "<|im_end|>"}
    ckpt = save_checkpoint(root / "ckpt", model, tokenizer_json=tok.to_str(),
                           extra_files={TOKENIZER_CONFIG: json.dumps(tc).encode()})
    out = export_artifacts(ckpt, root / "artifact", attention=False, precision="fp32",
                           progress=False, threads=2)
    return Artifact(Path(out), model, tok, cfg)
