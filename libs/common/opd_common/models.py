"""Model and tokenizer loading, and chat rendering: the one place prompts become token ids."""

from __future__ import annotations

from pathlib import Path

from .errors import ConfigError, require


def check_model_ref(model: str, flag: str = "--model") -> None:
    """Fail early and clearly for a local model path that does not exist or is not a model."""
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise ConfigError(f"{flag} {model}: the directory has no config.json (is it a transformers model folder?)")
    elif model.startswith(("/", ".", "~")):
        raise ConfigError(f"{flag} {model}: no such model directory")


def load_tokenizer(model: str, revision: str | None = None):
    require("transformers", "hf")
    from transformers import AutoTokenizer

    check_model_ref(model)
    try:
        return AutoTokenizer.from_pretrained(model, revision=revision)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--model {model}: cannot load its tokenizer ({str(exc).splitlines()[0]})") from None


def pick_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def pick_dtype(dtype: str, device: str, model: str | None = None):
    """'auto' = bfloat16 on GPU, the checkpoint's own dtype (float32 for tiny models) on CPU."""
    import torch

    if dtype != "auto":
        return getattr(torch, dtype)
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def load_causal_lm(model: str, revision: str | None, dtype, device: str, adapter: str | None = None):
    """AutoModelForCausalLM in eval mode on `device`, with a peft LoRA adapter applied if given."""
    require("transformers", "hf")
    from transformers import AutoModelForCausalLM

    check_model_ref(model)
    try:
        lm = AutoModelForCausalLM.from_pretrained(model, revision=revision, dtype=dtype)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--model {model}: cannot load it ({str(exc).splitlines()[0]})") from None
    if adapter:
        if not (Path(adapter) / "adapter_config.json").exists():
            raise ConfigError(f"--adapter {adapter}: no adapter_config.json there (expected a peft LoRA folder)")
        require("peft", "hf")
        from peft import PeftModel

        lm = PeftModel.from_pretrained(lm, adapter)
    return lm.to(device).eval()


def render_chat(tokenizer, user_message: str, thinking: bool) -> list[int]:
    """Apply the chat template once (one user turn + generation prompt) and tokenize.

    ``thinking`` is passed as ``enable_thinking`` (Qwen3 templates honour it; others ignore it).
    The text is tokenized without adding special tokens again: the template already has them.
    """
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": user_message}], tokenize=False, add_generation_prompt=True,
        enable_thinking=thinking,
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
