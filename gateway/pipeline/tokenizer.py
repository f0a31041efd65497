"""The gateway's tokenizer: Hugging Face ``tokenizers`` plus the model's Jinja chat template, without torch.

The model directory comes from ``common.model_files`` (torch-free). A GGUF that is not converted yet is
converted by ``python -m workers.model_files NAME`` in a subprocess, so torch is loaded there and never here.
The chat template is rendered the way transformers does it (sandboxed Jinja, trim_blocks/lstrip_blocks,
``raise_exception``, ``tojson``) so prompts are token-for-token what the offline engine builds.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer

from common import model_files
from common.startup import StartupProgress
from gateway.pipeline.tools import CALL_START, Format


class ChatTemplateError(ValueError):
    """The template refused the conversation (e.g. a role order it does not support): a 400."""


class InvalidText(ValueError):
    """Text that cannot be tokenized (JSON allows lone surrogates, UTF-8 does not): a 400."""


def resolve_model_dir(name: str) -> Path:
    """The model's directory; converts a GGUF first, in a subprocess, if that was never done."""
    gguf = model_files.gguf_source(name)
    if gguf is not None and not model_files.is_model_dir(model_files.converted_dir(gguf)):
        # Converting imports torch: do it in a child so the gateway process stays torch-free.
        with StartupProgress("gateway").step(f"converting {gguf.name} to safetensors (once; cached after)"):
            subprocess.run([sys.executable, "-m", "workers.model_files", name], check=True,
                           stdout=subprocess.DEVNULL)
    return model_files.resolve(name).directory


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template error: {message}")


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def tool_format_of(template: str) -> Format:
    """How a chat template writes tool calls (gateway.pipeline.tools): Hermes ``<tool_call>`` blocks; Llama 3.x's
    JSON tool calling (its templates render results as ``ipython`` turns and calls as ``{"name", "parameters"}``);
    or no tool syntax at all (the generic format)."""
    if CALL_START in template:
        return "native"
    if "ipython" in template and "tools" in template and '"parameters"' in template:
        return "llama_json"
    return "generic"


class GatewayTokenizer:
    """Encode, decode and chat-render for one model. Thread-safe for concurrent encode/decode calls."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
        config: dict[str, Any] = {}
        cfg_path = directory / "tokenizer_config.json"
        if cfg_path.is_file():
            config = json.loads(cfg_path.read_text())
        template_path = directory / "chat_template.jinja"
        source = template_path.read_text() if template_path.is_file() else config.get("chat_template")
        if isinstance(source, list):  # the named-templates form: take the default one
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        self._special = {k: t for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                         if (t := model_files.token_text(config.get(k))) is not None}
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                           extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self._template = env.from_string(source) if isinstance(source, str) else None
        self.tool_format = tool_format_of(source if isinstance(source, str) else "")
        self.tool_role = self._tool_role()

    def _tool_role(self) -> str:
        """The role the generic tool format gives results: ``tool`` where the template renders that role (a
        ChatML template writes any role; smollm2 then answers from the result instead of calling again, where as
        a user turn it repeats the call), else ``user`` (templates that raise on roles they do not know)."""
        probe = [{"role": "user", "content": "u"}, {"role": "tool", "content": "kvgate-probe"}]
        try:
            return "tool" if "kvgate-probe" in self.render_chat(probe) else "user"
        except ChatTemplateError:
            return "user"

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str) -> list[int]:
        try:
            text.encode("utf-8")  # checked here: the Rust tokenizer panics (a BaseException) on surrogates
        except UnicodeEncodeError as e:
            raise InvalidText("text contains invalid Unicode (a lone surrogate)") from e
        # add_special_tokens=False: exactly what the offline engine (workers.llm) does for text prompts
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_text(self, token_id: int) -> str:
        """What one token reads as on its own (for logprobs); special tokens keep their spelling."""
        return self.decode([token_id], skip_special_tokens=False)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> str:
        if self._template is None:
            raise ChatTemplateError("this model has no chat template: use /v1/completions")
        extra = {} if tools is None else {"tools": tools}  # templates test `tools is defined`: absent, not None
        try:
            return str(self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                             **extra, **self._special))
        except jinja2.TemplateError as e:  # includes sandbox violations: the conversation is at fault
            raise ChatTemplateError(f"chat template error: {type(e).__name__}") from e

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        return self.encode(self.render_chat(messages, tools=tools))
