"""Read a Hugging Face model directory: ``config.json`` + ``*.safetensors`` (llama, mistral, qwen2, qwen3,
smollm3, phi3, gemma2, gemma3_text)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from magicpig_jax.io.json_files import read_json_object
from magicpig_jax.models.config import LlamaConfig, UnsupportedConfigError

__all__ = ["read_hf_config", "read_hf_dir", "read_generation_eos_ids", "recommended_generation_settings", "hf_files",
           "hf_weight_files"]

# generation_config.json keys with which transformers' generate() changes the tokens it picks, and
# their values that change nothing (transformers' GenerationConfig defaults)
_GENERATION_NEUTRAL = {
    "do_sample": False, "temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None, "typical_p": 1.0,
    "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
    "bad_words_ids": None, "suppress_tokens": None, "begin_suppress_tokens": None, "forced_bos_token_id": None,
    "forced_eos_token_id": None, "min_length": 0, "min_new_tokens": None, "num_beams": 1, "sequence_bias": None,
    "exponential_decay_length_penalty": None, "renormalize_logits": False, "guidance_scale": None,
}
_SAMPLING_ONLY = ("temperature", "top_p", "top_k", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff")


def read_generation_eos_ids(folder: str | Path) -> tuple[int, ...]:
    """``eos_token_id`` of ``generation_config.json`` (an int or a list), or ``()`` if absent.

    Raises:
      ValueError: the file is not a JSON object, or ``eos_token_id`` is not a non-negative
        integer or a list of them (named with the file).
    """
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return ()
    eos = read_json_object(path).get("eos_token_id")
    if eos is None:
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    # an id written as a string of digits ("5") is read as that integer; anything else is refused
    if not all((isinstance(e, int) and not isinstance(e, bool) and e >= 0) or (isinstance(e, str) and e.isdigit())
               for e in ids):
        raise ValueError(f"{path} 'eos_token_id' must be a non-negative integer or a list of them, got {eos!r}")
    return tuple(int(e) for e in ids)


def recommended_generation_settings(folder: str | Path) -> dict:
    """The settings of ``generation_config.json`` with which transformers' ``generate()`` would pick
    other tokens than plain greedy decoding (sampling, repetition penalties, suppressed or forced
    tokens, beams; those at transformers' neutral defaults left out), or ``{}`` without the file.

    magicpig_jax does not apply them: ``generate()`` decodes as its own arguments say (greedy unless
    a temperature is given; no repetition penalty, suppression or beams). The command line names
    them in a note, so that a model's recommended sampling is not dropped without a word.

    Raises:
      ValueError: the file is not a JSON object (named).
    """
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return {}
    cfg = read_json_object(path)
    found = {k: cfg[k] for k, neutral in _GENERATION_NEUTRAL.items() if k in cfg and cfg[k] != neutral}
    if cfg.get("do_sample") is not True:  # transformers reads these only when sampling (it warns otherwise)
        found = {k: v for k, v in found.items() if k not in _SAMPLING_ONLY}
    return found


def read_hf_config(folder: str | Path) -> LlamaConfig:
    """The :class:`LlamaConfig` of a Hugging Face model directory, from its metadata only.

    ``config.json`` through :meth:`LlamaConfig.from_hf_config`; the stop ids are those of
    ``config.json`` and ``generation_config.json`` together (and the tokenizer adds its
    ``eos_token``): decoding stops at any id the model's files call an end of sequence, as
    llama.cpp stops at every end-of-generation token. transformers' ``generate()`` stops only at
    ``generation_config.json``'s (``config.json``'s without that file), so where the files
    disagree we may stop where it would go on.

    Raises:
      FileNotFoundError: ``config.json`` is missing.
      ValueError: a file is not JSON or not a JSON object (named); UnsupportedConfigError (a
        ValueError) for a model type or field that is not supported.
    """
    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        from magicpig_jax.io.checkpoint import MARKER

        if (folder / MARKER).exists():  # not a file (is_checkpoint said no): a damaged checkpoint, not an HF folder
            raise ValueError(f"{folder / MARKER} is not a file: {folder} is not a valid magicpig_jax checkpoint "
                             "(damaged?); convert the model again")
        raise FileNotFoundError(f"{cfg_path} not found: a Hugging Face model directory needs config.json")
    config = LlamaConfig.from_hf_config(read_json_object(cfg_path))
    eos = list(config.eos_token_ids)
    eos += [e for e in read_generation_eos_ids(folder) if e not in eos]
    return dataclasses.replace(config, eos_token_ids=tuple(eos))


# safetensors dtypes whose matrices are held as they are: their bytes are GGUF F16/BF16 rows
_PACKED_DTYPES = {"float16": "F16", "bfloat16": "BF16"}


def read_hf_dir(folder: str | Path) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    """Parse a Hugging Face model directory of a Llama-family model.

    Weights are read with ``safetensors`` in the Hugging Face naming and ``(out, in)`` layout.
    A float16 or bfloat16 matrix is kept in its own dtype, as the GGUF rows of that type
    (uint8 ``[Out, 2 In]`` under :func:`magicpig_jax.io.gguf_model.packed_key`: a row of
    2-byte values is the same bytes in both formats), so that a bfloat16 checkpoint is held
    in half the memory of a float32 copy and its products run on the host matvec kernels;
    vectors, and matrices of other float dtypes, are converted to float32. They come from ``model.safetensors``,
    else the files ``model.safetensors.index.json`` lists (transformers' order), else every
    ``*.safetensors`` of the folder: a repository's other files, such as Mistral's
    ``consolidated.safetensors``, are not read when the standard ones exist. The stop ids of the
    config are those of ``config.json`` and ``generation_config.json`` together.
    Rotary ``inv_freq`` buffers (recomputed) are skipped; with tied embeddings an
    ``lm_head.weight`` equal to the embedding is dropped, a different one refused. A phi3
    checkpoint's fused ``self_attn.qkv_proj`` and ``mlp.gate_up_proj`` are split into the
    Llama names by rows (q, k, v and gate, up, as transformers' ``Phi3Attention`` and
    ``Phi3MLP`` slice them). A gemma2 or gemma3_text checkpoint's norms are renamed and held as
    ``1 + w`` (:func:`_gemma3_weight`).

    Returns:
      ``(config, weights)``.

    Raises:
      FileNotFoundError: ``config.json`` or the ``*.safetensors`` files are missing, or a
        file that ``model.safetensors.index.json`` names.
      UnsupportedConfigError (a ValueError): the model type or a config field is not
        supported (see :meth:`LlamaConfig.from_hf_config`).
      ValueError: a fused phi3 matrix does not have the rows its parts need (named); an unfused
        q/k/v or gate/up matrix in a phi3 checkpoint (UnsupportedConfigError).
    """
    folder = Path(folder)
    config = read_hf_config(folder)
    model_type = read_json_object(folder / "config.json").get("model_type")
    files = _weight_files(folder)
    raw = {}
    for file in files:
        for name, value in _tensors(file):
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if model_type in ("gemma2", "gemma3_text"):
                name, value = _gemma3_weight(name, value)
            for key, part in (_split_fused(config, name, value) if model_type == "phi3" else [(name, value)]):
                if key in raw:
                    raise ValueError(f"weight {key!r} appears in more than one safetensors file of {folder}")
                raw[key] = part
    if config.tie_word_embeddings and "lm_head.weight" in raw:
        embed = raw.get("model.embed_tokens.weight")
        if embed is None or not _equal(embed, raw["lm_head.weight"]):
            raise UnsupportedConfigError(
                f"{folder}: tie_word_embeddings is true but lm_head.weight differs from model.embed_tokens.weight")
        del raw["lm_head.weight"]
    return config, {key: value for name in list(raw) for key, value in [_held(name, raw.pop(name))]}


# Gemma 3's norms -> the names the loader places them under (DecoderLayer's docstring): its
# post_attention_layernorm normalises the attention's output, its pre_feedforward_layernorm is the
# norm Llama calls post_attention_layernorm
_GEMMA3_NORMS = {"input_layernorm.weight": "input_layernorm.weight",
                 "post_attention_layernorm.weight": "attn_output_norm.weight",
                 "pre_feedforward_layernorm.weight": "post_attention_layernorm.weight",
                 "post_feedforward_layernorm.weight": "mlp_output_norm.weight",
                 "self_attn.q_norm.weight": "self_attn.q_norm.weight",
                 "self_attn.k_norm.weight": "self_attn.k_norm.weight"}


def _gemma3_weight(name: str, value: np.ndarray) -> tuple[str, np.ndarray]:
    """A Gemma 3 weight under the loader's names; a norm's weight ``w`` as the ``1 + w`` it scales by
    (float32, as transformers' ``Gemma3RMSNorm`` computes ``1.0 + weight.float()``)."""
    if name == "model.norm.weight":
        return name, 1.0 + np.asarray(value, np.float32)
    head, sep, tail = name.partition(".layers.")
    if sep:
        layer, _, part = tail.partition(".")
        if part in _GEMMA3_NORMS:
            return f"{head}.layers.{layer}.{_GEMMA3_NORMS[part]}", 1.0 + np.asarray(value, np.float32)
    return name, value


_UNFUSED = tuple(f"{part}.weight" for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                "mlp.gate_proj", "mlp.up_proj"))


def _split_fused(config: LlamaConfig, name: str, value: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """A phi3 weight under the Llama names: ``qkv_proj`` as q, k, v rows and ``gate_up_proj`` as
    gate, up rows (views, no copy); any other weight as it is."""
    D = config.head_dim
    if name.endswith("self_attn.qkv_proj.weight"):
        prefix, sizes = name[: -len("qkv_proj.weight")], {"q_proj": config.num_heads * D,
                                                           "k_proj": config.num_kv_heads * D,
                                                           "v_proj": config.num_kv_heads * D}
    elif name.endswith("mlp.gate_up_proj.weight"):
        prefix, sizes = name[: -len("gate_up_proj.weight")], {"gate_proj": config.intermediate_size,
                                                              "up_proj": config.intermediate_size}
    elif name.endswith(_UNFUSED):
        # transformers' Phi3 reads only the fused matrices: it would initialise them at random here
        raise UnsupportedConfigError(f"weight {name!r}: a phi3 checkpoint holds q/k/v as self_attn.qkv_proj and "
                                     "gate/up as mlp.gate_up_proj (transformers' Phi3 does not read unfused ones)")
    else:
        return [(name, value)]
    if value.ndim != 2 or value.shape[0] != sum(sizes.values()):
        raise ValueError(f"weight {name!r} has shape {value.shape}; {' + '.join(map(str, sizes.values()))} = "
                         f"{sum(sizes.values())} rows ({', '.join(sizes)}) expected")
    out, start = [], 0
    for part, rows in sizes.items():
        out.append((f"{prefix}{part}.weight", value[start:start + rows]))
        start += rows
    return out


# The pages of a mapped file that a read touches count in the resident memory until the mapping
# closes: reading a whole file through one mapping holds it twice at the end. A new mapping every
# so many bytes bounds that to this much, at the cost of parsing the header once per mapping.
_BYTES_PER_MAPPING = 64 * 2**20


def _tensors(file: Path):
    """``(name, array)`` of each tensor of a safetensors file, in its dtype (bfloat16 as ml_dtypes')."""
    from safetensors import SafetensorError, safe_open

    def unreadable(err: Exception) -> ValueError:  # a partial download, an empty or foreign file
        return ValueError(f"{file} is not a readable safetensors file ({type(err).__name__}: {err})")

    try:
        with safe_open(str(file), framework="flax") as f:
            names = list(f.keys())
    except (SafetensorError, OSError) as err:
        raise unreadable(err) from None
    i = 0
    while i < len(names):
        read = 0
        try:
            with safe_open(str(file), framework="flax") as f:
                while i < len(names) and read < _BYTES_PER_MAPPING:
                    value = np.asarray(f.get_tensor(names[i]))
                    read += value.nbytes
                    yield names[i], value
                    i += 1
        except (SafetensorError, OSError) as err:
            raise unreadable(err) from None


def _equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal values, compared a block of rows at a time (no float32 copy of a whole embedding)."""
    if a.shape != b.shape:
        return False
    if a.dtype == b.dtype:
        return bool(np.array_equal(a, b))
    step = max(1, 2**24 // max(1, a[0].size))
    return all(np.array_equal(a[i:i + step].astype(np.float32), b[i:i + step].astype(np.float32))
               for i in range(0, a.shape[0], step))


def _held(name: str, value: np.ndarray) -> tuple[str, np.ndarray]:
    """``(key, array)`` of one weight as :func:`read_hf_dir` holds it: F16/BF16 rows, or float32."""
    from magicpig_jax.io.gguf_model import packed_key

    if value.dtype.kind in "iub":  # an int8 / uint8 / bool weight is a quantized or foreign tensor
        raise ValueError(f"tensor {name!r} has dtype {value.dtype.name}: only floating-point weights are "
                         "read (quantized checkpoints are not supported)")
    qtype = _PACKED_DTYPES.get(value.dtype.name)
    if qtype is not None and value.ndim == 2:
        return packed_key(name, qtype), np.ascontiguousarray(value).view(np.uint8)
    return name, np.asarray(value, dtype=np.float32)


# The metadata files the loader and the tokenizer read, where present (tokenizer.Tokenizer.from_hf_dir).
HF_METADATA_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                     "special_tokens_map.json", "chat_template.jinja", "chat_template.json")


def hf_files(folder: str | Path) -> list[Path]:
    """Every file :func:`read_hf_dir` and the tokenizer read from the Hugging Face directory ``folder``:
    the metadata files present, the safetensors index if it is used, and the weight files it picks
    (which an index may place in a subfolder). What ``eval``'s model digest hashes.

    Raises:
      FileNotFoundError, ValueError: as :func:`read_hf_dir` for the weight files.
    """
    folder = Path(folder)
    files = [folder / name for name in HF_METADATA_FILES if (folder / name).is_file()]
    files += sorted((folder / "additional_chat_templates").glob("*.jinja"))  # the named chat templates
    weights = _weight_files(folder)
    index = folder / "model.safetensors.index.json"
    if weights != [folder / "model.safetensors"] and index.is_file():
        files.append(index)
    return files + weights


def hf_weight_files(folder: str | Path) -> list[Path]:
    """The safetensors files of the Hugging Face directory ``folder`` that hold the model (those
    :func:`read_hf_dir` reads; an index may place them in a subfolder).

    Raises:
      FileNotFoundError, ValueError: as :func:`read_hf_dir`.
    """
    return _weight_files(Path(folder))


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors files of ``folder`` that hold the model (see :func:`read_hf_dir`)."""
    if (folder / "model.safetensors").is_file():  # transformers' order: the single file, then the index
        return [folder / "model.safetensors"]
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no 'weight_map' object")
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names file(s) missing from {folder}: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    return files
