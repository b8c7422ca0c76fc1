"""Mistral's own formats for tests: a tiny ``tekken.json`` trained on the fly, a checkpoint that ships only it, and a
Hugging Face checkpoint written back as Mistral's ``params.json`` + ``consolidated.safetensors``."""

from __future__ import annotations

import base64
import json
import os
import shutil
import sysconfig

NUM_SPECIAL = 100
"""Control tokens at the front of the vocabulary (real files reserve 1000)."""

PATTERN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
           r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|"
           r"\s+(?!\S)|\s+")
"""Tekken's pre-tokenizer regex (the one Mistral's files carry)."""

SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]", "[PREFIX]", "[MIDDLE]",
            "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]", "[ARGS]", "[CALL_ID]", "[THINK]",
            "[/THINK]", "[AUDIO]", "[BEGIN_AUDIO]", "[TRANSCRIBE]"]
"""v13's control tokens in their ranks (v7 and v11 have a prefix of them), then Voxtral's audio markers."""
AUDIO_ID, BEGIN_AUDIO_ID = SPECIALS.index("[AUDIO]"), SPECIALS.index("[BEGIN_AUDIO]")


def write_tekken(folder: str, version: str = "v13", num_merges: int = 156, mel_bins: int | None = None,
                 image: dict | None = None) -> str:
    """``folder``/tekken.json: a byte-level BPE of 256 + `num_merges` tokens trained on Python's own ``this.py``
    (with `NUM_SPECIAL` control tokens: 512 ids, the tiny checkpoints' vocabulary, by default); `mel_bins`: with
    an audio section, as Voxtral's; `image`: an image section (``image_patch_size``, ``max_image_size``,
    ``spatial_merge_size``), as Pixtral's and Mistral Small 3.1's."""
    from tiktoken._educational import bpe_train

    with open(os.path.join(sysconfig.get_paths()["stdlib"], "this.py"), encoding="utf-8") as f:
        text = f.read() * 2
    ranks = bpe_train(text, 256 + num_merges, PATTERN, visualise=None)
    vocab = [{"rank": rank, "token_bytes": base64.b64encode(piece).decode(), "token_str": None}
             for piece, rank in sorted(ranks.items(), key=lambda item: item[1])]
    specials = [{"rank": i, "token_str": name, "is_control": True} for i, name in enumerate(SPECIALS)]
    config = {"pattern": PATTERN, "num_vocab_tokens": len(vocab), "default_vocab_size": NUM_SPECIAL + len(vocab),
              "default_num_special_tokens": NUM_SPECIAL, "version": version}
    data = {"config": config,
            "vocab": vocab, "special_tokens": specials}
    if mel_bins is not None:  # Voxtral's: 16 kHz audio, 12.5 tokens a second, padded to 30 s windows
        data["audio"] = {"sampling_rate": 16_000, "frame_rate": 12.5, "chunk_length_s": 30.0, "audio_encoding_config": {
            "num_mel_bins": mel_bins, "hop_length": 160, "window_size": 400}}
    if image is not None:
        data["image"] = image
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "tekken.json"), "w", encoding="utf-8") as f:
        json.dump(data, f)
    return folder


def write_mistral_sentencepiece(folder: str, vocab_size: int = 512) -> str:
    """``folder``/tokenizer.model.v3: a byte-fallback sentencepiece BPE with Mistral v3's control tokens (as
    Mistral 7B v0.3's file), trained on Python's ``this.py``."""
    import io

    import sentencepiece

    with open(os.path.join(sysconfig.get_paths()["stdlib"], "this.py"), encoding="utf-8") as f:
        lines = [line for line in f.read().splitlines() if line.strip()] * 3
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, control_symbols=SPECIALS[3:10], unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        normalization_rule_name="identity", remove_extra_whitespaces=False, character_coverage=1.0, minloglevel=2)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "tokenizer.model.v3"), "wb") as f:
        f.write(model.getvalue())
    return folder


def tekken_checkpoint(tiny_llama: str, folder: str, version: str = "v13", sentencepiece: bool = False) -> str:
    """``tiny_llama``'s config and weights with only a tekken.json beside them (BOS 1, EOS 2, as Mistral's);
    `sentencepiece`: a tokenizer.model.v3 instead (`write_mistral_sentencepiece`)."""
    os.makedirs(folder, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(tiny_llama, name), folder)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**config, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None}, f)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2}, f)
    return write_mistral_sentencepiece(folder) if sentencepiece else write_tekken(folder, version)


_HF_TO_MISTRAL = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
                  "lm_head.weight": "output.weight", "input_layernorm": "attention_norm",
                  "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attention.wq",
                  "self_attn.k_proj": "attention.wk", "self_attn.v_proj": "attention.wv",
                  "self_attn.o_proj": "attention.wo", "mlp.gate_proj": "feed_forward.w1",
                  "mlp.down_proj": "feed_forward.w2", "mlp.up_proj": "feed_forward.w3"}


def _mistral_name(name: str) -> str:
    if name in _HF_TO_MISTRAL:
        return _HF_TO_MISTRAL[name]
    name = name.removeprefix("model.")
    for hf, mistral in _HF_TO_MISTRAL.items():
        name = name.replace(hf, mistral)
    return name


def _interleaved(weight, heads: int):
    """transformers' rotary halves per head back to Mistral's interleaved pairs (the inverse of its conversion)."""
    rows, cols = weight.shape
    return weight.reshape(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols).contiguous()


def mistral_format_checkpoint(hf_folder: str, folder: str, keep_hf: bool = False) -> str:
    """``hf_folder``'s MistralForCausalLM as Mistral ships it: params.json, consolidated.safetensors (Mistral's names,
    interleaved rotary rows) and a tekken.json; ``keep_hf``: its config.json and model.safetensors beside them."""
    from safetensors.torch import load_file, save_file

    with open(os.path.join(hf_folder, "config.json")) as f:
        config = json.load(f)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    params = {"dim": config["hidden_size"], "n_layers": config["num_hidden_layers"], "head_dim": config["head_dim"],
              "hidden_dim": config["intermediate_size"], "n_heads": heads, "n_kv_heads": kv_heads,
              "norm_eps": config["rms_norm_eps"], "vocab_size": config["vocab_size"],
              "rope_theta": config["rope_parameters"]["rope_theta"], "max_seq_len": config["max_position_embeddings"],
              "sliding_window": config.get("sliding_window"), "tied_embeddings": False}
    tensors = {}
    for name, weight in load_file(os.path.join(hf_folder, "model.safetensors")).items():
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            weight = _interleaved(weight, heads if "q_proj" in name else kv_heads)
        tensors[_mistral_name(name)] = weight
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "consolidated.safetensors"))
    with open(os.path.join(folder, "params.json"), "w") as f:
        json.dump(params, f)
    if keep_hf:
        shutil.copy(os.path.join(hf_folder, "model.safetensors"), folder)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump({**config, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None}, f)
    return write_tekken(folder)


_TOWER_TO_MISTRAL = {"vision_tower.": "vision_encoder.", "attention.q_proj": "attention.wq",
                     "attention.k_proj": "attention.wk", "attention.v_proj": "attention.wv",
                     "attention.o_proj": "attention.wo", "feed_forward.gate_proj": "feed_forward.w1",
                     "feed_forward.down_proj": "feed_forward.w2", "feed_forward.up_proj": "feed_forward.w3",
                     "multi_modal_projector.linear_1": "vision_language_adapter.w_in",
                     "multi_modal_projector.linear_2": "vision_language_adapter.w_out",
                     "multi_modal_projector.patch_merger.": "patch_merger.",
                     "multi_modal_projector.norm.": "pre_mm_projector_norm."}
"""transformers' names of the Pixtral tower and the adapters -> Mistral's (the inverse of transformers' scripts)."""


def mistral_vision_checkpoint(hf_folder: str, folder: str) -> str:
    """``hf_folder``'s Mistral 3 or Pixtral-LLaVA (with a tekken.json) as Mistral ships Mistral Small 3.1 and
    Pixtral-12B-2409: params.json with a ``vision_encoder`` section, consolidated.safetensors under Mistral's names
    (the tower's query and key rows interleaved too), the tekken.json, and no config.json or image processor."""
    from safetensors.torch import load_file, save_file

    with open(os.path.join(hf_folder, "config.json")) as f:
        config = json.load(f)
    text, vision = config["text_config"], config["vision_config"]
    merge = config.get("spatial_merge_size", 1)
    params = {"dim": text["hidden_size"], "n_layers": text["num_hidden_layers"], "head_dim": text["head_dim"],
              "hidden_dim": text["intermediate_size"], "n_heads": text["num_attention_heads"],
              "n_kv_heads": text["num_key_value_heads"], "norm_eps": text["rms_norm_eps"],
              "vocab_size": text["vocab_size"], "rope_theta": text["rope_parameters"]["rope_theta"],
              "max_seq_len": text["max_position_embeddings"], "vision_encoder": {
                  "hidden_size": vision["hidden_size"], "num_channels": 3, "image_size": vision["image_size"],
                  "max_image_size": vision["image_size"], "patch_size": vision["patch_size"],
                  "rope_theta": vision["rope_parameters"]["rope_theta"],
                  "intermediate_size": vision["intermediate_size"], "num_hidden_layers": vision["num_hidden_layers"],
                  "num_attention_heads": vision["num_attention_heads"],
                  "adapter_bias": config["multimodal_projector_bias"], "image_token_id": 10,
                  "image_break_token_id": 12, "image_end_token_id": 13,
                  **({"mm_projector_id": "patch_merge", "spatial_merge_size": merge,
                      "add_pre_mm_projector_layer_norm": True} if merge > 1 else {})}}
    tensors = {}
    for name, weight in load_file(os.path.join(hf_folder, "model.safetensors")).items():
        if name.startswith("language_model."):
            name = name.removeprefix("language_model.")
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                weight = _interleaved(weight, text["num_attention_heads"] if "q_proj" in name
                                      else text["num_key_value_heads"])
            tensors[_mistral_name(name)] = weight
            continue
        if name.endswith(("attention.q_proj.weight", "attention.k_proj.weight")):
            weight = _interleaved(weight, vision["num_attention_heads"])
        for hf, mistral in _TOWER_TO_MISTRAL.items():
            name = name.replace(hf, mistral)
        tensors[name] = weight
    tensors.setdefault("output.weight", tensors["tok_embeddings.weight"].clone())  # a tied checkpoint's head
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "consolidated.safetensors"))
    with open(os.path.join(folder, "params.json"), "w") as f:
        json.dump(params, f)
    shutil.copy(os.path.join(hf_folder, "tekken.json"), folder)
    return folder
