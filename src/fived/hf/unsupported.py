"""The one-line refusal of a Hugging Face model fived cannot reproduce exactly (config_map and each
architecture's own mapping raise it)."""

from __future__ import annotations

from fived.config import ConfigError


class Unsupported(ConfigError):
    """A model fived cannot reproduce exactly: one line naming the config.json key that differs."""

    def __init__(self, source: str, key: str, value, rule: str):
        super().__init__(
            "--init-from",
            source,
            f"config.json {key}={value!r}: {rule}",
            "fived imports Llama 2/3/3.1, Qwen3, Mixtral, Qwen3-MoE, DeepSeek-V3, GPT-OSS and Gemma 3 (text) models",
        )
