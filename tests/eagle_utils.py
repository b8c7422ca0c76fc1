"""Tiny EAGLE heads for a tiny Llama target (EAGLE-3's for a tiny Qwen3-MoE or gpt-oss one too), and their drafts
computed in plain torch (the reference).

The heads are written as EAGLE publishes them: EAGLE-1's ``fc`` and ``layers.0.`` (no first input norm, the
target's embeddings copied in), EAGLE-3's ``midlayer.`` over ``2 x hidden``, ``fc`` over three target layers,
``norm``, a ``lm_head`` over a smaller vocabulary and its ``d2t`` / ``t2d`` maps. The reference recomputes the head
over the whole sequence for every draft (dense causal attention, no cache), from transformers' target states.
"""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F

DRAFT_VOCAB = 128
AUX_LAYERS = [0, 1, 1]


def make_eagle_head(dst: str, target: str, method: str, seed: int = 0, embeddings: bool = False,
                    para_norm: bool = False, speculators: bool = False) -> str:
    """An EAGLE (``eagle``; HASS's with ``para_norm``) or EAGLE-3 (``eagle3``) head for the target checkpoint, random
    weights; ``speculators``: an EAGLE-3 head in RedHat's speculators format (its config nested, ``layers.0.``
    names, ``norm_before_residual`` on)."""
    from safetensors.torch import load_file, save_file

    with open(os.path.join(target, "config.json")) as f:
        tcfg = json.load(f)
    h, heads, kv, hd, inter = (tcfg["hidden_size"], tcfg["num_attention_heads"], tcfg["num_key_value_heads"],
                               tcfg["head_dim"], tcfg["intermediate_size"])
    eagle3 = method == "eagle3"
    cfg = {k: tcfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                "intermediate_size", "vocab_size", "rms_norm_eps", "max_position_embeddings",
                                "hidden_act", "rope_parameters", "bos_token_id", "eos_token_id")}
    cfg.update(model_type="llama", num_hidden_layers=1,
               architectures=["LlamaForCausalLMEagle3" if eagle3 else "LlamaForCausalLM"])
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, std: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    layer = "midlayer." if eagle3 and not speculators else "layers.0."
    qkv_in = 2 * h if eagle3 else h
    attn, mlp = f"{layer}self_attn.", f"{layer}mlp."
    w = {attn + "q_proj.weight": rand(heads * hd, qkv_in), attn + "k_proj.weight": rand(kv * hd, qkv_in),
         attn + "v_proj.weight": rand(kv * hd, qkv_in), attn + "o_proj.weight": rand(h, heads * hd),
         mlp + "gate_proj.weight": rand(inter, h), mlp + "up_proj.weight": rand(inter, h),
         mlp + "down_proj.weight": rand(h, inter), f"{layer}post_attention_layernorm.weight": 1 + rand(h, std=0.1)}
    target_weights = load_file(os.path.join(target, "model.safetensors"))
    if eagle3:
        cfg.update(draft_vocab_size=DRAFT_VOCAB, eagle_aux_hidden_state_layer_ids=AUX_LAYERS)
        kept = torch.sort(torch.randperm(cfg["vocab_size"], generator=g)[:DRAFT_VOCAB]).values
        t2d = torch.zeros(cfg["vocab_size"], dtype=torch.bool)
        t2d[kept] = True
        w.update({"fc.weight": rand(h, 3 * h), f"{layer}input_layernorm.weight": 1 + rand(h, std=0.1),
                  f"{layer}hidden_norm.weight": 1 + rand(h, std=0.1), "norm.weight": 1 + rand(h, std=0.1),
                  "lm_head.weight": rand(DRAFT_VOCAB, h), "d2t": kept - torch.arange(DRAFT_VOCAB), "t2d": t2d})
        if embeddings:
            w["embed_tokens.weight"] = rand(cfg["vocab_size"], h)
    else:
        w.update({"fc.weight": rand(h, 2 * h), "embed_tokens.weight": target_weights["model.embed_tokens.weight"]})
        if para_norm:
            cfg["add_para_norm"] = True
            w.update({"embedding_layernorm.weight": 1 + rand(h, std=0.1),
                      "hidden_states_layernorm.weight": 1 + rand(h, std=0.1)})
    os.makedirs(dst, exist_ok=True)
    if speculators:
        extra = {key: cfg.pop(key) for key in ("draft_vocab_size", "eagle_aux_hidden_state_layer_ids")}
        cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "norm_before_residual": True,
               "transformer_layer_config": {**cfg, "architectures": ["LlamaForCausalLM"]}, **extra,
               "speculators_config": {"proposal_methods": [{"speculative_tokens": 3}],
                                      "verifier": {"name_or_path": target}}}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file({k: v.contiguous() for k, v in w.items()}, os.path.join(dst, "model.safetensors"))
    return dst


# ------------------------------------------------------------------ the reference
def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotary(cfg: dict, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's cos and sin ``[T, 1, head_dim]`` at positions 0..T-1: transformers' Llama rotary embedding of its
    config (its rope type: default, or YaRN as gpt-oss's heads copy from their target)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cos, sin = LlamaRotaryEmbedding(LlamaConfig(**cfg))(torch.zeros(1), torch.arange(t)[None])
    return cos[0, :, None], sin[0, :, None]


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + half * sin


def _layer(x_in: torch.Tensor, residual: torch.Tensor, w: dict, p: str, cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over ``x_in`` (causal, positions 0..T-1) added to ``residual``, then the MLP: (mlp out, residual)."""
    t, heads, kv, hd = x_in.shape[0], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    cos, sin = _rotary(cfg, t)
    q = _rope((x_in @ w[p + "self_attn.q_proj.weight"].T).view(t, heads, hd), cos, sin)
    k = _rope((x_in @ w[p + "self_attn.k_proj.weight"].T).view(t, kv, hd), cos, sin)
    v = (x_in @ w[p + "self_attn.v_proj.weight"].T).view(t, kv, hd)
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    attn = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    residual = attn.transpose(0, 1).reshape(t, heads * hd) @ w[p + "self_attn.o_proj.weight"].T + residual
    x = _rms(residual, w[p + "post_attention_layernorm.weight"], cfg["rms_norm_eps"])
    gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
    return (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T, residual


def _head(ids: torch.Tensor, hidden: torch.Tensor, w: dict, cfg: dict, embed: torch.Tensor,
          eagle3: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(output rows for the logits, rows the next draft carries) over the whole sequence."""
    eps, e = cfg["rms_norm_eps"], embed[ids]
    if eagle3:
        normed = _rms(hidden, w["midlayer.hidden_norm.weight"], eps)
        x = torch.cat([_rms(e, w["midlayer.input_layernorm.weight"], eps), normed], -1)
        out, residual = _layer(x, normed if cfg.get("norm_before_residual") else hidden, w, "midlayer.", cfg)
        carried = out + residual
        return _rms(carried, w["norm.weight"], eps), carried
    if cfg.get("add_para_norm"):
        e, hidden = _rms(e, w["embedding_layernorm.weight"], eps), _rms(hidden, w["hidden_states_layernorm.weight"], eps)
    x = torch.cat([e, hidden], -1) @ w["fc.weight"].T
    out, residual = _layer(x, x, w, "layers.0.", cfg)
    return out + residual, out + residual


def _tensor(out: object) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out  # type: ignore[return-value]


@torch.no_grad()
def reference_drafts(head: str, target: str, tokens: list[int], k: int,
                     layers: list[int] | None = None) -> list[int]:
    """The head's k greedy drafts after ``tokens`` (the target has computed all but the last), EAGLE-3's reading the
    inputs of the target's ``layers`` (default `AUX_LAYERS`, what `make_eagle_head` names)."""
    from safetensors.torch import load_file

    from hf_reference import _hf_model

    with open(os.path.join(head, "config.json")) as f:
        cfg = json.load(f)
    if "transformer_layer_config" in cfg:  # the speculators format: its names as EAGLE's
        cfg = {**cfg["transformer_layer_config"], "draft_vocab_size": cfg["draft_vocab_size"],
               "norm_before_residual": cfg["norm_before_residual"]}
    eagle3 = "draft_vocab_size" in cfg
    w = {name.replace("layers.0.", "midlayer.") if eagle3 else name: t
         for name, t in load_file(os.path.join(head, "model.safetensors")).items()}
    hf = _hf_model(target)
    ids = torch.tensor(tokens)
    seen: dict[int, torch.Tensor] = {}
    hooks = [hf.model.embed_tokens.register_forward_hook(lambda m, i, o: seen.__setitem__(0, o[0]))]
    hooks += [layer.register_forward_hook(lambda m, i, o, n=n: seen.__setitem__(n + 1, _tensor(o)[0]))
              for n, layer in enumerate(hf.model.layers)]
    final = hf.model(ids[None, :-1]).last_hidden_state[0]
    for hook in hooks:
        hook.remove()
    hidden = torch.cat([seen[i] for i in layers or AUX_LAYERS], -1) @ w["fc.weight"].T if eagle3 else final
    embed = w.get("embed_tokens.weight", hf.model.embed_tokens.weight) if eagle3 else hf.model.embed_tokens.weight
    inputs, drafts = list(tokens[1:]), []
    for _ in range(k):
        out, carried = _head(torch.tensor(inputs), hidden, w, cfg, embed, eagle3)
        if eagle3:
            draft = int((out[-1] @ w["lm_head.weight"].T).argmax())
            draft += int(w["d2t"][draft])
        else:
            draft = int(hf.lm_head(out[-1]).argmax())
        drafts.append(draft)
        inputs.append(draft)
        hidden = torch.cat([hidden, carried[-1:]])
    return drafts


def make_exact_pair(src: str, root: str) -> tuple[str, str]:
    """A target whose next token depends on its last token only (every attention output projection zero, the
    final norm's weight ones), and an EAGLE-1 head that computes exactly that (``fc = [I, 0]``, the target's
    layers): every greedy draft is the target's own next token."""
    import shutil

    from safetensors.torch import load_file, save_file

    target, head = os.path.join(root, "target"), os.path.join(root, "head")
    shutil.copytree(src, target)
    weights = load_file(os.path.join(target, "model.safetensors"))
    for name in weights:
        if name.endswith("o_proj.weight"):
            weights[name] = torch.zeros_like(weights[name])
    weights["model.norm.weight"] = torch.ones_like(weights["model.norm.weight"])
    save_file(weights, os.path.join(target, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(target, "config.json")) as f:
        cfg = json.load(f)
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    head_weights = {name.removeprefix("model."): w for name, w in weights.items()
                    if name.startswith("model.layers.") and not name.startswith("model.layers.0.input_layernorm")}
    head_weights["fc.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    os.makedirs(head)
    with open(os.path.join(head, "config.json"), "w") as f:
        json.dump({**cfg, "num_hidden_layers": layers}, f)
    save_file({k: v.contiguous() for k, v in head_weights.items()}, os.path.join(head, "model.safetensors"))
    return target, head


# ------------------------------------------------------------------ MTP layers
def add_mtp_layer(src: str, dst: str, seed: int = 0) -> str:
    """A copy of a tiny DeepSeek-style checkpoint with a multi-token-prediction layer ``model.layers.{L}``: its last
    layer's weights plus noise (its kind of attention and experts), ``enorm``, ``hnorm``, ``eh_proj``,
    ``shared_head``, and an ``embed_tokens`` copy, in a second safetensors file, as DeepSeek-V3 ships it."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    num, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    g = torch.Generator().manual_seed(seed)
    weights = load_file(os.path.join(dst, "model.safetensors"))
    last, mtp = f"model.layers.{num - 1}.", f"model.layers.{num}."
    layer = {mtp + name.removeprefix(last): w + 0.05 * w.std() * torch.randn(w.shape, generator=g)
             for name, w in weights.items() if name.startswith(last)}
    layer.update({mtp + "enorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
                  mtp + "hnorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
                  mtp + "eh_proj.weight": 0.2 * torch.randn(h, 2 * h, generator=g),
                  mtp + "shared_head.norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
                  mtp + "shared_head.head.weight": 0.2 * torch.randn(cfg["vocab_size"], h, generator=g),
                  mtp + "embed_tokens.weight": weights["model.embed_tokens.weight"]})
    save_file({k: v.contiguous() for k, v in layer.items()}, os.path.join(dst, "mtp.safetensors"))
    return dst


_MTP_EXTRAS = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")


def _hf_with_mtp_layer(target: str, tmp: str):
    """transformers' model of the target with its MTP layer's decoder block as one more layer (its loading converts
    the per-expert names as it does for every layer)."""
    from safetensors.torch import load_file

    with open(os.path.join(target, "config.json")) as f:
        cfg = json.load(f)
    num = cfg["num_hidden_layers"]
    cfg["num_hidden_layers"] = num + 1
    if "mlp_layer_types" in cfg:
        cfg["mlp_layer_types"] = cfg["mlp_layer_types"] + cfg["mlp_layer_types"][-1:]
    prefix = f"model.layers.{num}."
    return _hf_with_layer(target, tmp, cfg, {n: t for n, t in load_file(os.path.join(target, "mtp.safetensors")).items()
                                             if not n.removeprefix(prefix).startswith(_MTP_EXTRAS)})


def _hf_with_layer(target: str, tmp: str, cfg: dict, layer: dict[str, torch.Tensor]):
    """transformers' model of ``cfg`` (in ``tmp``) from the target's weights and ``layer``'s."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    os.makedirs(tmp, exist_ok=True)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f)
    weights = load_file(os.path.join(target, "model.safetensors"))
    save_file({**weights, **layer}, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(os.path.join(target, "generation_config.json"), tmp)
    return AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()


@torch.no_grad()
def reference_mtp_drafts(target: str, tokens: list[int], k: int, tmp: str) -> list[int]:
    """The MTP layer's k greedy drafts after ``tokens``, its decoder block transformers' (``tmp``: a scratch
    folder)."""
    from safetensors.torch import load_file

    big = _hf_with_mtp_layer(target, tmp)
    num, eps = big.config.num_hidden_layers - 1, big.config.rms_norm_eps
    w = {n.removeprefix(f"model.layers.{num}."): t for n, t in load_file(os.path.join(target, "mtp.safetensors")).items()}

    def inputs_of(e: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        e[0] = 0  # position 0's embedding is masked
        return torch.cat([_rms(e, w["enorm.weight"], eps), _rms(hidden, w["hnorm.weight"], eps)], -1) @ w["eh_proj.weight"].T

    def output_of(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _rms(out[-1], w["shared_head.norm.weight"], eps) @ w["shared_head.head.weight"].T, out

    return _layer_drafts(big, target, tokens, k, inputs_of, output_of)


def _layer_drafts(big, target: str, tokens: list[int], k: int, inputs_of, output_of) -> list[int]:
    """k greedy drafts of an MTP layer whose decoder block is ``big``'s last layer (transformers'), reading the
    target's final hidden states: ``inputs_of(embeddings, hidden)`` is the block's input, ``output_of(out)`` the
    last row's logits and what the next draft reads."""
    from hf_reference import _hf_model

    layer = big.model.layers[big.config.num_hidden_layers - 1]
    hidden = _hf_model(target).model(torch.tensor([tokens[:-1]])).last_hidden_state[0]
    inputs, drafts = list(tokens[1:]), []
    for _ in range(k):
        t = len(inputs)
        positions = torch.arange(t)[None]
        x = inputs_of(big.model.embed_tokens(torch.tensor(inputs)), hidden)
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        out = _tensor(layer(x[None], attention_mask=mask, position_ids=positions,
                            position_embeddings=big.model.rotary_emb(x[None], positions)))[0]
        logits, carried = output_of(out)
        drafts.append(int(logits.argmax()))
        inputs.append(drafts[-1])
        hidden = torch.cat([hidden, carried[-1:]])
    return drafts


# ------------------------------------------------------------------ Qwen3-Next / Qwen3.5 MTP layers
_QWEN_MTP_PARTS = ("fc.", "pre_fc_norm_embedding.", "pre_fc_norm_hidden.", "norm.")


def add_qwen_mtp_layer(src: str, dst: str, seed: int = 0) -> str:
    """A copy of a tiny Qwen3.5 / Qwen3-Next checkpoint (or an image-text Qwen3.5's) with its ``mtp.`` layer, as Qwen
    ships it: a full-attention layer (the target's full-attention layer's weights plus noise), ``fc``, the
    zero-centred ``pre_fc_norm_*`` and ``norm``; ``mtp_num_hidden_layers: 1`` in its (text) config."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    text = cfg.get("text_config", cfg)
    text["mtp_num_hidden_layers"] = 1
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    full, h = text["layer_types"].index("full_attention"), text["hidden_size"]
    g = torch.Generator().manual_seed(seed)
    source = f"model.{'language_model.' if text is not cfg else ''}layers.{full}."
    layer = {"mtp.layers.0." + name.removeprefix(source): w + 0.05 * w.std() * torch.randn(w.shape, generator=g)
             for name, w in load_file(os.path.join(dst, "model.safetensors")).items() if name.startswith(source)}
    layer["mtp.fc.weight"] = 0.2 * torch.randn(h, 2 * h, generator=g)
    layer.update({f"mtp.{part}weight": 0.1 * torch.randn(h, generator=g) for part in _QWEN_MTP_PARTS[1:]})
    save_file({k: v.contiguous() for k, v in layer.items()}, os.path.join(dst, "mtp.safetensors"))
    return dst


def _hf_qwen_mtp_layer(target: str, tmp: str):
    """transformers' model of the target with the MTP layer's decoder block as one more (full-attention) layer."""
    from safetensors.torch import load_file

    with open(os.path.join(target, "config.json")) as f:
        cfg = json.load(f)
    num = cfg["num_hidden_layers"]
    cfg.update(num_hidden_layers=num + 1, layer_types=cfg["layer_types"] + ["full_attention"])
    return _hf_with_layer(target, tmp, cfg, {f"model.layers.{num}." + n.removeprefix("mtp.layers.0."): t
                                             for n, t in load_file(os.path.join(target, "mtp.safetensors")).items()
                                             if n.startswith("mtp.layers.0.")})


def _zero_centred_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms(x, 1 + w, eps)


@torch.no_grad()
def reference_qwen_mtp_drafts(target: str, tokens: list[int], k: int, tmp: str) -> list[int]:
    """The Qwen MTP layer's k greedy drafts after ``tokens``: ``fc`` over the normed embedding and hidden state,
    transformers' decoder block, the final norm, the target's LM head; the next draft reads the normed output."""
    from safetensors.torch import load_file

    big = _hf_qwen_mtp_layer(target, tmp)
    eps = big.config.rms_norm_eps
    w = {n.removeprefix("mtp."): t for n, t in load_file(os.path.join(target, "mtp.safetensors")).items()}

    def inputs_of(e: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([_zero_centred_rms(e, w["pre_fc_norm_embedding.weight"], eps),
                          _zero_centred_rms(hidden, w["pre_fc_norm_hidden.weight"], eps)], -1) @ w["fc.weight"].T

    def output_of(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        normed = _zero_centred_rms(out, w["norm.weight"], eps)
        return big.lm_head(normed[-1]), normed

    return _layer_drafts(big, target, tokens, k, inputs_of, output_of)
