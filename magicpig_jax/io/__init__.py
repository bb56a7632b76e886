"""Model and tokenizer loading: GGUF (via ``gguf``), Hugging Face directories, the embedded model."""

from magicpig_jax.io.embedded import embedded_model_path
from magicpig_jax.io.tokenizer import ChatTemplateError, Tokenizer, TokenizerMetadataError

__all__ = ["embedded_model_path", "Tokenizer", "ChatTemplateError", "TokenizerMetadataError"]
