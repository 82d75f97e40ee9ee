"""Tokenizers: the tiny byte-level one built in code, or the one of a local HF model directory."""

from __future__ import annotations

from pathlib import Path

import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from glm45v_fsdp import vocab
from glm45v_fsdp.errors import UserError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters: the alphabet of the ByteLevel pre-tokenizer."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    mapping = {b: chr(b) for b in printable}
    mapping.update({b: chr(256 + n) for n, b in enumerate(others)})
    return mapping


def build_tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Byte-level tokenizer: vocab.SPECIAL_TOKENS at ids 0..17, then byte b at id BYTE_TOKEN_OFFSET + b.

    No merges, so every UTF-8 byte is one token and decode(encode(text)) == text. Pad and eos are <|endoftext|>.
    """
    byte_chars = _byte_to_unicode()
    token_to_id = dict(vocab.SPECIAL_TOKEN_IDS)
    token_to_id.update({byte_chars[b]: vocab.BYTE_TOKEN_OFFSET + b for b in range(256)})
    assert len(token_to_id) <= vocab.TINY_VOCAB_SIZE
    backend = Tokenizer(models.BPE(vocab=token_to_id, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in vocab.SPECIAL_TOKENS])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=list(vocab.SPECIAL_TOKENS[1:]),
        clean_up_tokenization_spaces=False,
    )


def load_tokenizer(model_path: str | None) -> transformers.PreTrainedTokenizerBase:
    """The tiny tokenizer when `model_path` is None, else the tokenizer files of that local model directory."""
    if model_path is None:
        return build_tiny_tokenizer()
    path = Path(model_path)
    if not path.is_dir():
        raise UserError(
            f"Config key 'model.name_or_path' = '{model_path}' is not a directory. Point it at a local HF model "
            f"directory (nothing is downloaded), or set it to null to use the built-in tiny model and tokenizer."
        )
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise UserError(
            f"Model directory '{model_path}' (model.name_or_path) holds no tokenizer: none of "
            f"{', '.join(TOKENIZER_FILES)} is there. Copy the tokenizer files of the model into that directory."
        )
    try:
        return transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as error:
        raise UserError(
            f"The tokenizer in '{model_path}' (model.name_or_path) cannot be loaded: {error}. Check that the "
            f"tokenizer files there are complete and match the installed transformers version."
        ) from None
