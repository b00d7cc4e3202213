"""The zoo: Collider on a tiny random model of every architecture in transformers' auto mappings.

For every model class of MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and MODEL_FOR_MASKED_LM_MAPPING_NAMES
(deduplicated by class), and of MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES run with one image of
4 x 4 patches per row, `run_architecture` builds a tiny random model from its config class (hidden
32, 2 layers, 4 heads, vocab 101, dropout 0, float64 where it runs, else float32; CPU, train
mode), traces a plan, and for attn_implementation eager and sdpa (where the model takes them),
three keep masks (per_sequence at filter_ratio 0.25 and 0.5, ragged batch_topk at 0.5) and both
semantics, compares the parameter gradients of filter_backward against mask_backward (the oracle:
the same gradients on full-size zero-masked tensors) on fresh forwards of the same batch.
Outcomes: exact; refused (a collider.Error, and a plain backward of that loss then gives the
loss_only gradient); wrong (accepted and the gradients differ, or refused with the graph changed);
crashed (another exception after Collider accepted, or an untyped error from Collider); not
buildable (the tiny model does not build or run here, or not within FORWARD_SECONDS).
Used by test_zoo.py (pytest -m zoo) and zoo_table.py (writes docs/ZOO.md).
Shapes: B batch, T sequence, V vocab, S image side in pixels.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import re
import signal
import time
import traceback
from typing import Callable, Optional

import torch
import torch.nn.functional as F

import collider
import collider.hf as chf

B, T = 2, 37  # T odd, and none of the model's sizes
VOCAB = 101
FIRST_TEXT_ID = 24  # the ids below are special (pad, bos, eos, image, ...): random text never draws them
IMAGE_PATCHES = 4  # image-text-to-text: images of 4 x 4 patches (fewer tokens where the model pools them)
ATTN_IMPLEMENTATIONS = ("eager", "sdpa")
ATTENTION = ("kept_only", "exact_query")
TOL = {torch.float64: 1e-4, torch.float32: 1e-3}
# The whole of one architecture (build, probe, traces, comparisons): a guard against a hang, not a
# speed test, so generous: Nemotron-H's reference scan at B = T = 32 took 100 s for one attention
# implementation (eager, refused) on a 2-core machine running CI's other pytest worker and its build.
ARCH_SECONDS = 400
FORWARD_SECONDS = 20  # one probe forward + backward; slower models are not buildable here
OUTCOMES = ("crashed", "wrong", "refused", "exact", "not buildable")  # worst first
SOURCE_TASKS = ("seq2seq", "speech")  # an encoder's source beside the tokens
SOURCES = ("same", "other")
SOURCE_OTHER = 23  # a source of another length than the target's (none of the model's sizes)

# ---- which architectures --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Architecture:
    name: str  # the mapping key naming this class (architectures() says which of several)
    model_class: str
    task: str  # "causal", "masked", "image" (image-text-to-text, run with images), "seq2seq" or "speech"
    aliases: tuple = ()  # other mapping keys naming the same class
    # seq2seq and speech: the encoder's source "same" (as many positions as the target: both padded to
    # one length, every size of the encoder then the token length) or "other" (SOURCE_OTHER positions)
    source: str = ""

    @property
    def id(self) -> str:
        """The name, with the task where it is not causal (bert is BertLMHeadModel, bert-masked
        BertForMaskedLM, gemma3-image Gemma3ForConditionalGeneration run with images, bart-seq2seq-same
        BartForConditionalGeneration with a source as long as its target)."""
        return self.name + ("" if self.task == "causal" else "-" + self.task) + (f"-{self.source}" if self.source else "")


def architectures() -> list:
    """Every model class of the causal-LM and masked-LM mappings, once. Its name: the mapping key
    whose config class is the model class's own, its model_type first (llama, not internlm3, for
    LlamaForCausalLM; gpt2, not gpt-sw3, for GPT2LMHeadModel)."""
    import transformers
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
                                                        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
                                                        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES)
    # (class, "text", "image" or "source") -> (task, [mapping keys]); a class in two mappings of one kind runs as
    # the first's task (BartForConditionalGeneration: masked, on its own input, and seq2seq, with a source)
    keys: dict = {}
    for task, mapping in (("causal", MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), ("masked", MODEL_FOR_MASKED_LM_MAPPING_NAMES),
                          ("image", MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES),
                          ("seq2seq", MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES),
                          ("speech", MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES)):
        for name in sorted(mapping):
            kind = "image" if task == "image" else "source" if task in SOURCE_TASKS else "text"
            keys.setdefault((mapping[name], kind), (task, []))[1].append(name)
    found = []
    for (cls, _), (task, names) in keys.items():
        config_class = getattr(getattr(transformers, cls, None), "config_class", None)
        own = [n for n in names if n in CONFIG_MAPPING and CONFIG_MAPPING[n] is config_class]
        own.sort(key=lambda n: getattr(config_class, "model_type", n) != n)  # gpt2 before gpt-sw3
        name = (own or names)[0]
        aliases = tuple(n for n in names if n != name)
        for source in SOURCES if task in SOURCE_TASKS else ("",):
            found.append(Architecture(name, cls, task, aliases, source))
    order = ("causal", "masked", "image", "seq2seq", "speech")
    return sorted(found, key=lambda a: (order.index(a.task), a.name, a.source))


# ---- tiny configs -----------------------------------------------------------------------------
# Every config key below that the default config has is set (also where its default is None, the
# model reading it unguarded); the config class is then built from those keyword arguments, so that
# the fields its __init__ derives (head_dim, layer_types) follow.
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN, POSITIONS = 32, 2, 4, 2, 8, 64, 128
SIZE_KEYS = (  # (size, the config keys that take it)
    (HIDDEN, ("hidden_size", "n_embd", "n_embed", "d_model", "emb_dim", "embed_dim", "embedding_size",
              "word_embed_proj_dim", "d_embed")),
    (LAYERS, ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers", "decoder_layers",
              "num_decoder_layers", "num_encoder_layers")),
    (HEADS, ("num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads",
             "decoder_attention_heads")),
    (KV_HEADS, ("num_key_value_heads", "num_kv_heads", "n_kv_heads")),
    (HEAD_DIM, ("head_dim", "kv_channels", "attention_head_size", "d_head", "v_head_dim")),
    (FFN, ("intermediate_size", "ffn_dim", "n_inner", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff", "d_inner",
           "ffn_hidden_size", "hidden_dim")),
    (VOCAB, ("vocab_size", "vocab_size_per_layer_input")),
    (POSITIONS, ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_sequence_length")),
    (4, ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts",  # experts
         "qk_rope_head_dim", "qk_nope_head_dim", "rotary_dim")),  # multi-head latent attention, partial rotary
    (2, ("num_experts_per_tok", "moe_topk", "moe_k")),  # top-k
    (32, ("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size")),
    (16, ("kv_lora_rank", "q_lora_rank", "mamba_d_state", "state_size", "chunk_size", "mamba_chunk_size")),
    (8, ("hidden_size_per_layer_input", "laurel_rank", "linear_key_head_dim", "linear_value_head_dim",
         "index_head_dim", "indexer_head_dim")),
    (2, ("linear_num_key_heads", "index_n_heads", "indexer_n_heads")),
    (4, ("linear_num_value_heads", "mamba_n_heads")),
)
SIZES = {key: size for size, keys in SIZE_KEYS for key in keys}
HIDDEN_KEYS = SIZE_KEYS[0][1]


@dataclasses.dataclass(frozen=True)
class Shape:
    """The sizes of one zoo run: the batch [batch, seq] of every comparison, and the model's hidden size."""
    batch: int
    seq: int
    hidden: int


STEP = Shape(B, T, HIDDEN)  # the zoo: sizes no model shares
# The coincidence run: batch, sequence and feature sizes made equal, and a second sequence (an encoder's
# source) of that same length too, so that nothing can be told apart by its size: a result that depended on
# two sizes differing shows here.
EQUAL = Shape(32, 32, 32)
LAYER_KEYS = SIZE_KEYS[1][1]
OPTIONAL = ("q_lora_rank", "chunk_size")  # None switches a feature off: left None
SLIDING_WINDOW = 16  # shorter than T, where the model has one
LAYER_KIND_KEYS = ("layer_types", "layers_block_type", "block_types")  # one entry per layer
ZERO_WORDS = ("dropout", "pdrop", "layerdrop", "drop_path", "jitter")  # float keys set to 0: a deterministic forward
# Special token ids at FIRST_TEXT_ID or above are moved below it: these keys to their index here,
# any other "*_token_id" / "*_token_index" to the last one.
TOKEN_ID_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id", "unk_token_id", "sep_token_id", "cls_token_id",
                 "mask_token_id", "decoder_start_token_id", "image_token_id", "image_token_index",
                 "video_token_id", "boi_token_id", "boi_token_index", "eoi_token_id", "eoi_token_index",
                 "vision_start_token_id", "vision_end_token_id", "audio_token_id")

# Per-model-class keyword arguments where the generic sizes do not build (a dict value for a
# sub-config is merged into that sub-config's).
OVERRIDES: dict = {
    "Dots1ForCausalLM": {"n_shared_experts": 1},
    "Dots3NoteForCausalLM": {"num_key_value_heads": HEADS, "head_dim": 8},  # qk_nope_head_dim + qk_rope_head_dim
    # a decoder that reads the encoder (the default config's is a second bidirectional encoder beside it)
    "EncoderDecoderModel": {"decoder": {"is_decoder": True, "add_cross_attention": True}},
    "EsmForMaskedLM": {"pad_token_id": 1, "mask_token_id": 2},
    "EsmcForMaskedLM": {"num_key_value_heads": HEADS},
    "Gemma3nForCausalLM": {"num_kv_shared_layers": 0},
    "Gemma4AssistantForCausalLM": {"text_config": {"hidden_size_per_layer_input": 0}},
    "Gemma4UnifiedAssistantForCausalLM": {"text_config": {"num_kv_shared_layers": 0}},
    "CohereCompassForCausalLM": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}},
    "GPTNeoForCausalLM": {"attention_types": [[["global", "local"], 1]]},
    "Lfm2ForCausalLM": {"layer_types": ["conv", "full_attention"], "full_attn_idxs": [1]},
    "Lfm2MoeForCausalLM": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "Mamba2ForCausalLM": {"num_heads": 8},  # expand (2) * hidden / head_dim
    "NeoMMEForMaskedLM": {"head_dim": 16},  # a quarter of it rotated, a multiple of 4
    "PerceiverForMaskedLM": {"num_latents": 16, "d_latents": 32, "num_self_attends_per_block": 2},
    "ReformerModelWithLMHead": {"is_decoder": True},
    "ZayaForCausalLM": {"num_experts_per_tok": 1},
    # its vision adapter: the pixel shuffle (ratio 0.5) makes 4 * hidden channels, read by a layer of
    # intermediate_size inputs, and the projector's widths follow one another
    "Llama4ForConditionalGeneration": {"vision_config": {"intermediate_size": 4 * HIDDEN, "projector_input_dim": HIDDEN,
                                                         "projector_output_dim": HIDDEN, "vision_output_dim": HIDDEN}},
}
# Per-model-class calls on the built model before its first forward.
PREPARE: dict = {
    "XmodForCausalLM": lambda model: model.set_default_language("en_XX"),
    "XmodForMaskedLM": lambda model: model.set_default_language("en_XX"),
}


def _small_kwargs(default, hidden: int = HIDDEN) -> dict:
    """The keyword arguments that make `default` (a config instance) tiny; sub-configs recursively."""
    values = default.to_dict()
    kwargs: dict = {}
    subs = getattr(default, "sub_configs", {}) or {}
    kinds = next((list(dict.fromkeys(values[k])) for k in LAYER_KIND_KEYS if isinstance(values.get(k), list)), [])
    layers = max(LAYERS, len(kinds))  # every kind of layer the model mixes, at least LAYERS of them
    num_layers = next((values[k] for k in LAYER_KEYS if type(values.get(k)) is int), None)
    for key, value in values.items():
        sub = getattr(default, key, None) if key in subs else None
        if hasattr(sub, "to_dict"):
            kwargs[key] = _small_kwargs(sub, hidden)
            continue
        if key == "per_layer_config" and value:
            kwargs[key] = {}  # one size for every layer (Gemma4's wider heads on its global layers dropped)
        size = layers if key in LAYER_KEYS else hidden if key in HIDDEN_KEYS else SIZES.get(key)
        if size is not None and (type(value) is int or (value is None and key not in OPTIONAL)):
            kwargs[key] = size
        elif size is not None and isinstance(value, list) and value and all(type(v) is int for v in value):
            kwargs[key] = [size] * layers  # one size per layer (Gemma3n's intermediate_size)
        elif isinstance(value, list) and len(value) == num_layers and key not in LAYER_KIND_KEYS:
            kwargs[key] = value[:layers]  # another per-layer list (Gemma3n's activation sparsity)
        if key == "sliding_window" and type(value) is int:
            kwargs[key] = SLIDING_WINDOW
        if key in LAYER_KIND_KEYS and isinstance(value, list) and value:
            kwargs[key] = [kinds[i % len(kinds)] for i in range(layers)]
        if isinstance(value, float) and any(w in key for w in ZERO_WORDS):
            kwargs[key] = 0.0
        if key.endswith(("_token_id", "_token_index")) and value is not None:
            ids = value if isinstance(value, list) else [value]
            if any(type(i) is int and i >= FIRST_TEXT_ID for i in ids):
                kwargs[key] = TOKEN_ID_KEYS.index(key) if key in TOKEN_ID_KEYS else FIRST_TEXT_ID - 1
    if "use_cache" in values:
        kwargs["use_cache"] = False
    if "kv_lora_rank" in values and "qk_rope_head_dim" in values:  # latent attention: head_dim is the rotary part
        kwargs.update(num_key_value_heads=HEADS, head_dim=SIZES["qk_rope_head_dim"])
        kwargs = {k: v for k, v in kwargs.items() if k in values}
    return kwargs


def _merge(kwargs: dict, overrides: dict) -> dict:
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(kwargs.get(key), dict):
            _merge(kwargs[key], value)
        else:
            kwargs[key] = value
    return kwargs


def tiny_config(arch: Architecture, shape: Shape = STEP):
    """The model class's own config class (Llama4ForCausalLM's is the text config), made tiny. An encoder
    whose source has one fixed length (Whisper's max_source_positions) gets the source length of the run."""
    import transformers
    config_class = getattr(transformers, arch.model_class).config_class
    default = config_class()
    kwargs = _small_kwargs(default, shape.hidden)
    if arch.source and type(getattr(default, "max_source_positions", None)) is int:
        kwargs["max_source_positions"] = shape.seq if arch.source == "same" else SOURCE_OTHER
    if arch.task == "image":
        _tiny_vision(default, kwargs, shape)
        source = inspect.getsource(inspect.getmodule(getattr(transformers, arch.model_class)))
        _tiny_mrope(default, kwargs, shape.hidden, "mrope_section" in source)
    kwargs = _merge(kwargs, OVERRIDES.get(arch.model_class, {}))
    return config_class(**kwargs)


# Vision sub-config keys sized beside the generic ones (image task only: elsewhere these words mean other
# things): its layer count.
VISION_LAYER_KEYS = ("depth",)
# Keys of an image model's config: the image tokens one image becomes (Gemma 3 pools its
# IMAGE_PATCHES x IMAGE_PATCHES patches to this many); the widths between the vision tower and the text model,
# in the config or its vision sub-config (PaliGemma's and Kimi-K2.5's projectors, Qwen2.5-VL's vision output),
# all the tiny hidden size as both sides are; the vision layers whose hidden states it reads (VipLLaVA's 5 of
# 24), each moved into the tiny tower's LAYERS + 1 hidden states (a positive index to a layer of it: Molmo2
# counts layers).
IMAGE_TOKEN_KEYS = ("mm_tokens_per_image", "resampler_n_latents", "num_image_tokens")  # also in a sub-config
IMAGE_WIDTH_KEYS = ("projection_dim", "projection_hidden_size", "projection_hidden_dim", "projector_hidden_size",
                    "out_hidden_size", "text_hidden_size")
FEATURE_LAYER_KEYS = ("vision_feature_layer", "vision_feature_layers")


def _tiny_mrope(default, kwargs: dict, hidden: int, named: bool) -> None:
    """Multimodal rotary (Qwen2-VL's kind) of an image model, in kwargs (in place): the (time, height, width)
    sections of the config or its text sub-config, whose default sits in the modeling code, made to add up to
    half the tiny rotary dimension, where the config class declares them (ignore_keys_at_rope_validation: GLM-4.6V,
    whose modeling module imports GLM-4V's) or the modeling module names them (named: PaddleOCR-VL). Only on a
    flat rope_parameters (one rotary for every layer)."""
    for config, sub in ((default, kwargs), (getattr(default, "text_config", None), kwargs.get("text_config"))):
        if config is None or not isinstance(sub, dict):
            continue
        if not (named or "mrope_section" in getattr(type(config), "ignore_keys_at_rope_validation", ())):
            continue
        values = config.to_dict()
        rope = values.get("rope_parameters")
        if not (isinstance(rope, dict) and "rope_type" in rope):
            continue
        head = HEAD_DIM if "head_dim" in values else hidden // HEADS
        half = int(head * (rope.get("partial_rotary_factor") or values.get("partial_rotary_factor") or 1)) // 2
        if "qk_rope_head_dim" in values:  # latent attention: the rotary part is its own
            half = SIZES["qk_rope_head_dim"] // 2
        sub["rope_parameters"] = {**rope, "mrope_section": [half - 2 * (half // 3), half // 3, half // 3]}


def _tiny_vision(default, kwargs: dict, shape: Shape) -> None:
    """An image model's vision sub-config made tiny in kwargs (in place): images of IMAGE_PATCHES x IMAGE_PATCHES
    patches of its own patch size, its layers and output width tiny; where the config cuts an image into tiles
    on a grid of resolutions (LLaVA-NeXT's anyres), one tile of that side."""
    vision = getattr(default, "vision_config", None)
    if not isinstance(kwargs.get("vision_config"), dict) or vision is None:
        return
    sub, values = kwargs["vision_config"], vision.to_dict()
    side = None
    if hasattr(vision, "patch_size"):
        patch, size = vision.patch_size, getattr(vision, "image_size", None)
        side = IMAGE_PATCHES * (patch[0] if isinstance(patch, (list, tuple)) else patch)
        sub["image_size"] = [side, side] if isinstance(size, (list, tuple)) else side
        # the patch size the side was measured in, kept where the sub-config's own default differs (LLaVA's
        # CLIP tower: 14 in LlavaConfig, 32 in CLIPVisionConfig)
        sub["patch_size"] = patch
    for key in VISION_LAYER_KEYS:
        if type(values.get(key)) is int:
            sub[key] = LAYERS
    for key in IMAGE_WIDTH_KEYS:
        if type(values.get(key)) is int:
            sub[key] = shape.hidden
    for name in [None] + list(getattr(default, "sub_configs", {}) or {}):
        config, into = (default, kwargs) if name is None else (getattr(default, name, None), kwargs.get(name))
        for key in IMAGE_TOKEN_KEYS:
            if type(getattr(config, key, None)) is int and isinstance(into, dict):
                into[key] = IMAGE_PATCHES * IMAGE_PATCHES
    for key in IMAGE_WIDTH_KEYS:
        if type(getattr(default, key, None)) is int:
            kwargs[key] = shape.hidden
    for name in [None] + list(getattr(default, "sub_configs", {}) or {}):  # also Molmo2's adapter_config
        config, into = (default, kwargs) if name is None else (getattr(default, name, None), kwargs.get(name))
        for key in FEATURE_LAYER_KEYS:
            layers = getattr(config, key, None)
            if not isinstance(into, dict) or not (type(layers) is int or (
                    isinstance(layers, (list, tuple)) and all(type(i) is int for i in layers))):
                continue
            moved = [max(i, -LAYERS - 1) if i < 0 else min(i, LAYERS - 1) for i in
                     ([layers] if type(layers) is int else layers)]
            into[key] = moved[0] if type(layers) is int else moved
    if getattr(default, "projector_patch_to_query_dict", None):  # Aria: patches per image -> query tokens
        kwargs["projector_patch_to_query_dict"] = {IMAGE_PATCHES * IMAGE_PATCHES: IMAGE_PATCHES}
    if side is not None and getattr(default, "image_grid_pinpoints", None):
        # anyres (LLaVA-NeXT): a base image and one tile of the same side, each IMAGE_PATCHES / 2 patches a side,
        # and a newline token per tile row: 2 * 4 + 2 = 10 tokens (4 x 4 patches would be 36, over T / 2)
        patch = vision.patch_size[0] if isinstance(vision.patch_size, (list, tuple)) else vision.patch_size
        side = IMAGE_PATCHES // 2 * patch
        sub["image_size"] = [side, side] if isinstance(sub["image_size"], list) else side
        kwargs["image_grid_pinpoints"] = [[side, side]]


# ---- the model and its loss ------------------------------------------------------------------


class ArchitectureTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float, what: str):
    """Raises ArchitectureTimeout inside the block after `seconds` (SIGALRM: main thread only).
    Nests: an enclosing limit that comes first stays in force, and gets its time back after."""
    outer_left = signal.getitimer(signal.ITIMER_REAL)[0]
    if outer_left and outer_left <= seconds:
        yield
        return

    def expire(signum, frame):
        raise ArchitectureTimeout(f"{what} took over {seconds:g} s")
    old = signal.signal(signal.SIGALRM, expire)
    start = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if outer_left:
            signal.setitimer(signal.ITIMER_REAL, max(outer_left - (time.monotonic() - start), 1e-3))


def build_model(arch: Architecture, attn: Optional[str], dtype: torch.dtype, shape: Shape = STEP):
    import transformers
    torch.manual_seed(0)
    config = tiny_config(arch, shape)
    cls = getattr(transformers, arch.model_class)
    kwargs = {} if attn is None else {"attn_implementation": attn}
    model = cls._from_config(config, **kwargs).to(dtype)
    model.train()
    if arch.model_class in PREPARE:
        PREPARE[arch.model_class](model)
    return model


def _accepts(fn: Callable, name: str) -> bool:
    params = inspect.signature(fn).parameters
    return name in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


@dataclasses.dataclass
class Batch:
    """One batch: the forward's keyword arguments and the labels on the token positions."""
    # input_ids [B, T]; with images also pixel_values [B, 3, S, S] (and image_sizes [B, 2]); for an
    # encoder-decoder the source (input_ids [B, Ts], or audio: input_features / input_values) and the
    # target decoder_input_ids [B, T]
    inputs: dict
    labels: torch.Tensor  # [B, T]: the token ids (an encoder-decoder's target), -100 on image tokens


# ---- images ------------------------------------------------------------------------------------
# One image per row of S x S pixels (S = IMAGE_PATCHES patches of the vision config's patch_size, set by
# tiny_config), in the layout the model's own get_image_features takes, read from its signature:
#   pixels: pixel_values [B, 3, S, S] (or [B, n, 3, S, S] where the model cuts an image into n tiles: the
#     smallest n that get_image_features takes), and where it requires them image_sizes [B, 2] = (S, S) and
#     pixel_attention_mask [B, n], every tile real;
#   patches (it takes image_grid_thw: Qwen2-VL and its kind): pixel_values [B * g * g, C * tp * P * P], the
#     flattened g x g patches of every image (or [B * g * g, C, P, P], the first that get_image_features takes:
#     Kimi-K2.5, PaddleOCR-VL), image_grid_thw [B, 3] = (1, g, g), and where it takes them image_merge_sizes [B].
# The image token count comes from what get_image_features gives for one image (image_spec); its tokens sit
# at positions 1 .. n of every row, after the vision-start token at 0 where the config names one.
IMAGE_TILES = (1, 2, 3, 4, 5)  # the tile counts n tried for a [B, n, 3, S, S] layout
PATCH_SHAPES = ("flat", "square")  # the patches layouts tried: [N, C * tp * P * P], [N, C, P, P]


def _takes(fn: Callable, name: str) -> Optional[inspect.Parameter]:
    return inspect.signature(fn).parameters.get(name)


def _image_features_fn(model) -> Optional[Callable]:
    inner = getattr(model, "model", None)
    return getattr(inner, "get_image_features", None) or getattr(model, "get_image_features", None)


def _patch_layout(model, layout: int = 0) -> tuple:
    """(g, the shape of one patch) of the patches layout: g patches a side (IMAGE_PATCHES rounded up to the
    spatial merge size), and one patch (C * tp * P * P,) or (C, P, P) (PATCH_SHAPES[layout])."""
    vision = model.config.vision_config
    patch = vision.patch_size[0] if isinstance(vision.patch_size, (list, tuple)) else vision.patch_size
    temporal = getattr(vision, "temporal_patch_size", None) or getattr(vision, "patch_temporal", None) or 1
    temporal = temporal[0] if isinstance(temporal, (list, tuple)) else temporal
    merge = getattr(vision, "spatial_merge_size", None) or 1
    channels = getattr(vision, "in_channels", None) or getattr(vision, "num_channels", None) or 3
    g = -(-IMAGE_PATCHES // merge) * merge
    one = (channels * temporal * patch * patch,) if PATCH_SHAPES[layout] == "flat" else (channels, patch, patch)
    return g, one


def _layouts(model) -> tuple:
    """The layouts image_spec tries, in order: indices of PATCH_SHAPES for the patches layout, else tile counts
    (0: [B, 3, S, S])."""
    get = _image_features_fn(model)
    if _takes(get, "image_grid_thw") is not None:
        return tuple(range(len(PATCH_SHAPES)))
    mask = _takes(get, "pixel_attention_mask")
    if mask is not None and mask.default is inspect.Parameter.empty:  # a mask of tiles: tiled images only
        return IMAGE_TILES
    return (0,) + IMAGE_TILES


def image_inputs(model, batch: int, side: int, gen: torch.Generator, layout: int = 0) -> dict:
    """The forward's image arguments for `batch` random images, one per row, in the model's layout (the
    section's comment): layout, of patches, the index of PATCH_SHAPES; else n of a [B, n, 3, S, S] layout, 0
    for [B, 3, S, S]."""
    dtype = next(model.parameters()).dtype
    get = _image_features_fn(model)

    def rand(*size):
        return torch.randn(*size, generator=gen).to(dtype)
    if _takes(get, "image_grid_thw") is not None:
        g, one = _patch_layout(model, layout)
        inputs = {"pixel_values": rand(batch * g * g, *one), "image_grid_thw": torch.tensor([[1, g, g]] * batch)}
        if _takes(get, "image_merge_sizes") is not None:  # VideoLLaMA3: each image's spatial merge
            merge = getattr(model.config.vision_config, "spatial_merge_size", None) or 1
            inputs["image_merge_sizes"] = torch.tensor([merge] * batch)
        return inputs
    inputs = {"pixel_values": rand(batch, layout, 3, side, side) if layout else rand(batch, 3, side, side)}
    sizes = _takes(get, "image_sizes")
    if sizes is not None and sizes.default is inspect.Parameter.empty:  # required: it splits features by them
        inputs["image_sizes"] = torch.tensor([[side, side]] * batch)
    mask = _takes(get, "pixel_attention_mask")
    if mask is not None and mask.default is inspect.Parameter.empty:  # required (Granite-Docling): real tiles
        inputs["pixel_attention_mask"] = torch.ones(inputs["pixel_values"].shape[:-3], dtype=torch.bool)
    return inputs


def image_spec(model, seq: int = T) -> tuple:
    """(image tokens per row, image side S in pixels, image token id, layout) of an image-text-to-text model:
    the tokens counted from what its get_image_features gives for one random image (not zeros: Idefics3
    drops all-zero images as padding), in the first layout of _layouts it takes (image_inputs). Raises
    NotBuildable, or the first layout's error where none is taken."""
    spec = getattr(model, "_zoo_image_spec", None)
    if spec is not None:
        return spec
    config = model.config
    vision = getattr(config, "vision_config", None)
    size = getattr(vision, "image_size", None)
    side = size[0] if isinstance(size, (list, tuple)) else size
    token = next((getattr(config, k) for k in ("image_token_id", "image_token_index")
                  if type(getattr(config, k, None)) is int), None)
    get = _image_features_fn(model)
    if type(side) is not int or token is None or get is None:
        raise NotBuildable("no vision_config.image_size, image token id or get_image_features to size an image by")
    first_error = None
    for layout in _layouts(model):
        try:
            with torch.no_grad():
                out = get(**image_inputs(model, 1, side, torch.Generator().manual_seed(0), layout))
            break
        except Exception as e:
            first_error = first_error or e
    else:
        raise first_error
    features = getattr(out, "pooler_output", None)
    if features is None:
        features = out[0] if isinstance(out, (tuple, list)) or hasattr(out, "last_hidden_state") else out
    parts = features if isinstance(features, (list, tuple)) else [features]
    count = sum(f.numel() // f.shape[-1] for f in parts)
    if not 0 < count <= seq // 2:
        raise NotBuildable(f"{count} image tokens for one {side} x {side} image (at most {seq // 2} fit)")
    model._zoo_image_spec = (count, side, token, layout)
    return model._zoo_image_spec


def make_batch(model, arch: Architecture, batch: int, seq_len: int, gen: torch.Generator,
               shape: Shape = STEP) -> Batch:
    """Random token ids [batch, seq_len] from FIRST_TEXT_ID up; for images, one random image per row
    (image_inputs) whose tokens sit at positions 1 .. n (labels -100 there), the config's vision-start token
    at 0 where it names one (Qwen2.5-Omni's rotary finds images by it), and the token types [batch, seq_len]
    where the forward reads them (mm_token_type_ids: 1 on image tokens; token_type_ids: TOKEN_TYPES); for an
    encoder-decoder, the ids are the decoder's and the source has source_positions."""
    ids = torch.randint(FIRST_TEXT_ID, VOCAB, (batch, seq_len), generator=gen)
    if arch.task in SOURCE_TASKS and getattr(model.config, "is_encoder_decoder", False):
        positions = source_positions(arch, seq_len, shape)
        return Batch({**source_inputs(model, batch, positions, gen), "decoder_input_ids": ids}, ids)
    if arch.task != "image":
        return Batch({"input_ids": ids}, ids)
    count, side, token, layout = image_spec(model, seq_len)
    start = getattr(model.config, "vision_start_token_id", None)
    if type(start) is int:
        ids[:, 0] = start
    ids[:, 1:1 + count] = token
    labels = ids.clone()
    labels[:, 1:1 + count] = chf.IGNORE_INDEX
    inputs = {"input_ids": ids, **image_inputs(model, batch, side, gen, layout)}
    if _takes(model.forward, "mm_token_type_ids") is not None:  # the multimodal rotary's: 1 on image tokens
        inputs["mm_token_type_ids"] = (ids == token).long()
    if type(model).__name__ in TOKEN_TYPES:
        inputs["token_type_ids"] = TOKEN_TYPES[type(model).__name__](ids == token)
    return Batch(inputs, labels)


# token_type_ids [B, T] from where the image tokens are (bool [B, T]), for the models whose attention
# reads them, each in its own convention (elsewhere left out: the model's default).
TOKEN_TYPES: dict = {
    # 1 on image tokens: those attend to one another both ways
    "Gemma3ForConditionalGeneration": lambda image: image.long(),
    # 0 on the prefix (position 0 and the image), attended both ways; 1 on the text after it
    "PaliGemmaForConditionalGeneration":
        lambda image: ((image.cumsum(1) >= image.sum(1, keepdim=True)) & ~image).long(),
}


def source_positions(arch: Architecture, seq_len: int, shape: Shape) -> int:
    """The encoder's source length for a target of seq_len: "other" SOURCE_OTHER; "same" seq_len for text
    (source and target padded to one length, in the traces too) and the run's sequence length for audio
    (whose length follows the recording, not the text: equal to the target's in the steps only)."""
    if arch.source == "other":
        return SOURCE_OTHER
    return seq_len if arch.task == "seq2seq" else shape.seq


def source_inputs(model, batch: int, positions: int, gen: torch.Generator) -> dict:
    """An encoder's source of `positions` positions: token ids [batch, positions], or random audio
    (input_features [batch, F, L] or [batch, L, F], input_values [batch, L]) whose length L the encoder
    turns into that many positions (audio_layout)."""
    name = getattr(model, "main_input_name", "input_ids")
    if name == "input_ids":
        return {"input_ids": torch.randint(FIRST_TEXT_ID, VOCAB, (batch, positions), generator=gen)}
    make, length = audio_layout(model, positions)
    return {name: make(batch, length, gen)}


def audio_layout(model, positions: int) -> tuple:
    """(make(batch, L, gen) -> the audio tensor, L) for an encoder-decoder whose main input is audio: the
    feature layout and length L found by running its encoder on a ladder of lengths until one gives
    `positions` encoder positions. Raises NotBuildable where none does."""
    cache = model.__dict__.setdefault("_zoo_audio", {})
    if positions in cache:
        return cache[positions]
    name, config = model.main_input_name, model.config
    dtype = next(model.parameters()).dtype
    features = next((v for v in (getattr(config, k, None) for k in ("num_mel_bins", "feature_size", "n_mels",
                                                                     "input_feat_per_channel"))
                     if type(v) is int), None)
    channels = getattr(config, "input_channels", 1) if hasattr(config, "input_feat_per_channel") else 1
    if name == "input_values":
        layouts = [lambda b, n, g: torch.randn(b, n, generator=g).to(dtype)]
    elif features is None:
        raise NotBuildable(f"its main input {name} has no feature size in the config to build audio by")
    else:
        f = features * channels
        layouts = [lambda b, n, g: torch.randn(b, f, n, generator=g).to(dtype),
                   lambda b, n, g: torch.randn(b, n, f, generator=g).to(dtype)]
    encoder = model.get_encoder()
    fixed = getattr(config, "max_source_positions", None)
    ladder = sorted({positions * k for k in (1, 2, 3, 4, 8, 16, 32, 160, 320, 640)} |
                    ({fixed * k for k in (1, 2)} if type(fixed) is int else set()))
    for make in layouts:
        for length in ladder:
            try:
                with torch.no_grad():
                    out = encoder(**{name: make(1, length, torch.Generator().manual_seed(0))})
            except Exception:
                continue
            hidden = out[0] if isinstance(out, (tuple, list)) else out.last_hidden_state
            if hidden.shape[1] == positions:
                cache[positions] = (make, length)
                return cache[positions]
    raise NotBuildable(f"no audio length in {ladder[0]}..{ladder[-1]} gives {positions} encoder positions")


def logits_of(model, inputs: dict) -> torch.Tensor:
    """The model's logits [B, T, V] (no cache)."""
    kwargs = {"use_cache": False} if _accepts(model.forward, "use_cache") else {}
    out = model(**inputs, **kwargs)
    return out.logits if hasattr(out, "logits") else out[0]


def step_loss(model, task: str, batch: Batch, keep_BT: torch.Tensor) -> torch.Tensor:
    """The masked loss of a filtered step, a scalar.
    causal, image: transformers' own loss on labels dropped with collider.hf.drop_labels (keep on
      the hidden-state positions: keep[b, t] counts labels[b, t + 1]); for a composite config (its
      vocab_size in text_config, which collider.hf does not read) the per-token form instead,
      collider.hf.masked_mean of token_losses;
    masked: the cross-entropy of every kept position against its own token, mean over the kept;
    seq2seq, speech: for an encoder-decoder the per-token form on the decoder's positions."""
    logits = logits_of(model, batch.inputs)
    if "decoder_input_ids" in batch.inputs:
        return chf.masked_mean(chf.token_losses(logits, batch.labels), keep_BT)
    if task == "masked":
        B_, T_, V = logits.shape
        target = batch.labels.masked_fill(~keep_BT, chf.IGNORE_INDEX)
        return F.cross_entropy(logits.reshape(B_ * T_, V), target.reshape(B_ * T_), ignore_index=chf.IGNORE_INDEX)
    if _has_vocab(model):
        return chf.causal_lm_loss(model, logits, chf.drop_labels(batch.labels, keep_BT))
    return chf.masked_mean(chf.token_losses(logits, batch.labels), keep_BT)


def _has_vocab(model) -> bool:
    """Whether collider.hf takes the model (its config has vocab_size; composite ones have it in text_config)."""
    return hasattr(model.config, "vocab_size")


def valid_positions(task: str, labels_BT: torch.Tensor) -> torch.Tensor:
    """bool [B, T]: the positions with a loss (causal: those whose next label exists)."""
    if task == "masked":
        return labels_BT != chf.IGNORE_INDEX
    return chf.keep_mask_from_labels(labels_BT)


def trace(model, arch: Architecture, shape: Shape = STEP) -> collider.Plan:
    """collider.hf.trace_plan for causal LMs it takes; collider.trace_plan on step_loss otherwise (an
    encoder-decoder's source as long as each trace's target, or SOURCE_OTHER, as in its steps)."""
    task = arch.task
    if task == "causal" and _accepts(model.forward, "use_cache") and _has_vocab(model):
        return chf.trace_plan(model)
    gen = torch.Generator().manual_seed(1)

    def loss_on_random_batch(batch: int, seq_len: int) -> torch.Tensor:
        b = make_batch(model, arch, batch, seq_len, gen, shape)
        keep = (torch.rand(batch, seq_len, generator=gen).argsort(dim=1) < seq_len // 2)
        return step_loss(model, task, b, keep & valid_positions(task, b.labels))

    return collider.trace_plan(loss_on_random_batch)


def batch_and_masks(model, arch: Architecture, shape: Shape = STEP) -> tuple:
    """The batch [B, T] every comparison runs on, and its keep masks: name -> bool [B, T] (the EQUAL run:
    batch_topk 0.5 alone, whose ragged layout adds one more size, the padded kept count)."""
    B, T = shape.batch, shape.seq
    gen = torch.Generator().manual_seed(7)
    batch = make_batch(model, arch, B, T, gen, shape)
    valid = valid_positions(arch.task, batch.labels)
    masks = {}
    for ratio in (0.25, 0.5):
        masks[f"per_sequence {ratio}"] = collider.select_tokens(torch.rand(B, T, generator=gen), ratio, valid=valid)
    if B == 1:  # one sequence: nothing ragged
        return batch, masks
    scores = torch.rand(B, T, generator=gen)
    for _ in range(4):  # row 1 keeps more: ragged rows (raised again where rows 0 and 1 still keep as many)
        scores[1] += 0.3
        masks["batch_topk 0.5"] = collider.select_tokens(scores, 0.5, policy="batch_topk", valid=valid)
        counts = masks["batch_topk 0.5"].sum(1).tolist()
        if counts[0] != counts[1]:
            break
    assert counts[0] != counts[1], counts
    if shape.batch == shape.seq == shape.hidden:  # a coincidence run (run_equal)
        masks = {"batch_topk 0.5": masks["batch_topk 0.5"]}
    return batch, masks


def grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def plain_grads(model, task: str, batch: Batch, keep) -> dict:
    model.zero_grad(set_to_none=True)
    step_loss(model, task, batch, keep).backward()
    return grads(model)


def max_rel_diff(got: dict, ref: dict) -> tuple:
    """(max over parameters of max|got - ref| / max(max|ref|, 1e-5 * the largest entry of all), the
    parameter where it is largest); infinite where either side is not finite or the two have different
    parameter sets. A parameter whose true gradient is zero (an attention's key bias: the softmax ignores
    a constant per row) holds rounding noise on both sides, which counts against the largest gradient (a
    vision tower's key bias in Cohere2-Vision: 9e-11 on both sides, 2e-11 apart, the largest entry 0.16)."""
    if got.keys() != ref.keys():
        return float("inf"), "gradient sets differ: " + ", ".join(sorted(set(got) ^ set(ref)))[:120]
    worst, where = 0.0, ""
    finite = all(bool(torch.isfinite(r).all()) for r in ref.values())
    largest = max((r.abs().max().item() for r in ref.values() if r.numel()), default=0.0) if finite else 0.0
    for k in ref:
        if not (bool(torch.isfinite(got[k]).all()) and bool(torch.isfinite(ref[k]).all())):
            return float("inf"), f"{k} not finite"
        denom = max(ref[k].abs().max().item() if ref[k].numel() else 0.0, 1e-5 * largest)
        diff = (got[k] - ref[k]).abs().max().item()
        rel = diff / denom if denom > 0 else diff
        if rel > worst:
            worst, where = rel, k
    return worst, where


# ---- one architecture -------------------------------------------------------------------------


class NotBuildable(Exception):
    pass


@dataclasses.dataclass
class ImplResult:
    """What one attention implementation of one architecture gave."""
    outcome: str  # one of OUTCOMES
    cause: str = ""  # the refusal, the symptom or why not buildable (one line)
    worst: float = 0.0  # the largest relative gradient difference seen (filter against mask)
    dtype: str = ""
    group: str = ""  # refused: the kind of refusal (cause_group of the whole message)
    # exact under eager attention in float64: against the independent attention oracle (oracle.py), "match",
    # or why it was not compared ("not dispatched": the model's attention does not go through
    # transformers' AttentionInterface)
    oracle: str = ""


@dataclasses.dataclass
class Result:
    arch: Architecture
    impls: dict  # attn_implementation -> ImplResult
    seconds: float

    @property
    def outcome(self) -> str:
        """The worst outcome over the implementations (not buildable only where none was built)."""
        seen = [r.outcome for r in self.impls.values()]
        return next(o for o in OUTCOMES if o in seen or o == "not buildable")

    @property
    def cause(self) -> str:
        return next((r.cause for r in self.impls.values() if r.outcome == self.outcome), "")

    @property
    def group(self) -> str:
        return next((r.group for r in self.impls.values() if r.outcome == self.outcome), "")

    @property
    def built(self) -> list:
        return [a for a, r in self.impls.items() if r.outcome != "not buildable"]


def one_line(e: BaseException, limit: int = 160) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}"[:limit]


# What every refusal of filter_backward / mask_backward / trace_plan says before its cause.
_PREAMBLE = re.compile(r"^((filter_backward|mask_backward): refused, the graph is unchanged \([^)]*\): |trace_plan: )")


def refusal_text(e: BaseException) -> str:
    """A collider.Error's message on one line, its cause first (the shared preamble cut)."""
    text = " ".join(str(e).split())
    while _PREAMBLE.match(text):
        text = _PREAMBLE.sub("", text, count=1)
    return text


def refused(stage: str, e: BaseException, **fields) -> ImplResult:
    """The ImplResult of a refusal at `stage`: its first 160 characters, and its kind."""
    text = refusal_text(e)
    return ImplResult("refused", f"{stage}: {text}"[:160], group=cause_group(text), **fields)


def cause_group(text: str) -> str:
    """What refusals of one kind share: the message up to its first ';' or ', which', without node
    numbers and sizes (collider cannot rewrite node SliceBackward0: scalar field end equals the
    sequence length)."""
    text = re.split(r";|, which", text)[0]
    text = re.sub(r" ?\(#\d+\)|#\d+ ", "", text)
    text = re.sub(r"(?<![A-Za-z_])\d+", "N", text)
    return text.strip()[:160]


def probe(arch: Architecture, attn: Optional[str], shape: Shape = STEP) -> tuple:
    """(model, dtype, batch, keep masks): the model in float64 if a forward + backward of the masked
    loss runs there, else float32. Raises NotBuildable (with why) if neither runs, is not finite or
    not deterministic."""
    first_error = None
    for dtype in (torch.float64, torch.float32):
        try:
            with time_limit(FORWARD_SECONDS, "building and one forward + backward"):
                model = build_model(arch, attn, dtype, shape)
                if attn is not None and getattr(model.config, "_attn_implementation", attn) != attn:
                    raise NotBuildable(f"asked for {attn}, got {model.config._attn_implementation}")
                batch, masks = batch_and_masks(model, arch, shape)
                keep = masks.get("per_sequence 0.5", next(iter(masks.values())))
                loss = step_loss(model, arch.task, batch, keep)
                loss.backward()
                if not bool(torch.isfinite(loss)) or not grads(model):
                    raise NotBuildable(f"loss {loss.item()} with {len(grads(model))} parameter gradients")
                bad = next((n for n, g in grads(model).items() if not bool(torch.isfinite(g).all())), None)
                if bad is not None:  # LED's source padded to its attention window: NaN in a plain backward
                    raise NotBuildable(f"a plain backward gives non-finite gradients ({bad})")
                with torch.no_grad():
                    again = step_loss(model, arch.task, batch, keep)
                if not torch.equal(loss.detach(), again):
                    raise NotBuildable("the forward is not deterministic in train mode")
                return model, dtype, batch, masks
        except NotBuildable:
            raise
        except ArchitectureTimeout as e:
            raise NotBuildable(f"too slow: {e}") from None
        except Exception as e:  # the model's own failure, any type
            text = str(e)
            if "does not support" in text and ("attention implementation" in text or "attn_implementation" in text):
                raise NotBuildable(f"does not take attn_implementation={attn}") from None
            first_error = first_error or e
    raise NotBuildable(one_line(first_error))


def _from_trace(e: BaseException) -> Optional[BaseException]:
    """The model's own exception behind a trace_plan refusal (the loss callable raised), if any."""
    cause = e.__cause__
    while cause is not None:
        if not isinstance(cause, collider.Error):
            return cause
        cause = cause.__cause__
    return None


def refusal(who: str, model, task: str, batch: Batch, keep, loss, e: BaseException, tol: float) -> ImplResult:
    """A collider.Error from filter_backward / mask_backward: the graph must be untouched, so a plain
    backward of that same loss gives the loss_only gradient (a fresh forward's plain backward)."""
    try:
        loss.backward()
    except Exception as err:
        return ImplResult("crashed", f"{who} refused, then plain backward raised {one_line(err, 100)}")
    got = grads(model)
    rel, where = max_rel_diff(got, plain_grads(model, task, batch, keep))
    if not rel <= tol:
        return ImplResult("wrong", f"{who} refused but left the graph changed: rel diff {rel:.1e} at {where}")
    return refused(who, e)


def run_impl(arch: Architecture, attn: Optional[str], shape: Shape = STEP) -> ImplResult:
    try:
        model, dtype, batch, masks = probe(arch, attn, shape)
    except NotBuildable as e:
        return ImplResult("not buildable", str(e))
    tol, task = TOL[dtype], arch.task
    dtype_name = str(dtype).replace("torch.", "")
    try:
        plan = trace(model, arch, shape)
    except ArchitectureTimeout:
        raise
    except collider.Error as e:
        inner = _from_trace(e)
        if isinstance(inner, ArchitectureTimeout):
            raise inner
        if inner is not None:
            return ImplResult("not buildable", f"forward at trace shapes: {one_line(inner)}", dtype=dtype_name)
        return refused("trace_plan", e, dtype=dtype_name)
    except Exception as e:
        return ImplResult("crashed", f"trace_plan raised untyped {one_line(e)}", dtype=dtype_name)
    found = []  # ImplResults other than exact
    worst = 0.0
    for mask_name, keep in masks.items():
        for attention in ATTENTION:
            point = f"{mask_name} {attention}"
            got = {}
            rewrites = (("filter_backward", collider.filter_backward), ("mask_backward", collider.mask_backward))
            for who, rewrite in rewrites:
                model.zero_grad(set_to_none=True)
                loss = step_loss(model, task, batch, keep)
                try:
                    rewrite(loss, keep, plan, attention=attention)
                except collider.Error as e:  # mask_backward still runs on its own: refused or exact
                    found.append(refusal(f"{who} ({point})", model, task, batch, keep, loss, e, tol))
                    continue
                except ArchitectureTimeout:
                    raise
                except Exception as e:
                    found.append(ImplResult("crashed", f"{who} ({point}) raised untyped {one_line(e, 100)}"))
                    continue
                try:
                    loss.backward()
                except ArchitectureTimeout:
                    raise
                except Exception as e:
                    found.append(ImplResult("crashed", f"backward after {who} ({point}): {one_line(e, 100)}"))
                    continue
                got[who] = grads(model)
            if len(got) == 2:
                rel, where = max_rel_diff(got["filter_backward"], got["mask_backward"])
                worst = max(worst, rel)
                if not rel <= tol:
                    found.append(ImplResult("wrong", f"{point}: rel diff {rel:.1e} at {where}"))
    said = ""
    if attn == "eager" and dtype == torch.float64 and not any(r.outcome == "crashed" for r in found):
        oracle_mask = "per_sequence 0.5" if "per_sequence 0.5" in masks else next(iter(masks))
        rel, said = against_oracle(model, task, plan, batch, masks[oracle_mask], tol)
        if rel is not None and not rel <= tol:
            found.insert(0, ImplResult("wrong", f"{oracle_mask}: against the independent attention oracle {said}"))
    for outcome in ("crashed", "wrong", "refused"):
        first = next((r for r in found if r.outcome == outcome), None)
        if first is not None:
            return ImplResult(outcome, first.cause, worst, dtype_name, first.group, oracle=said)
    return ImplResult("exact", "", worst, dtype_name, oracle=said)


def against_oracle(model, task: str, plan, batch: Batch, keep, tol: float) -> tuple:
    """(relative difference or None, what it says): the gradients of filter_backward (check on first use
    off) and of mask_backward, each called on its own, against plain autograd through the independent
    attention oracle (oracle.py: the dropped tokens' keys and values detached, and for kept_only their
    score columns; an encoder-decoder's encoder and cross-attention plain), both semantics; a rewrite that
    refuses is left out. None where the oracle was not compared: the model's attention does not dispatch
    through transformers' AttentionInterface, or it failed."""
    from oracle import oracle_keep  # registers the oracle attention with transformers
    if re.search(r"^node \d+ \S+ 4\b", plan.to_string(), flags=re.M):
        # The oracle detaches dropped rows in the attention only; the ops run whole (DESIGN.md section 3) are
        # checked against their own oracle in test_run_whole.py / test_unseen_ops.py.
        return None, "not compared: nodes run whole"
    worst = 0.0
    for attention in ATTENTION:
        got = {}
        for who, rewrite in (("filter_backward", functools.partial(collider.filter_backward, check_every=0)),
                             ("mask_backward", collider.mask_backward)):
            model.zero_grad(set_to_none=True)
            loss = step_loss(model, task, batch, keep)
            try:
                rewrite(loss, keep, plan, attention=attention)
            except collider.Error:
                continue
            loss.backward()
            got[who] = grads(model)
        model.zero_grad(set_to_none=True)
        try:
            with oracle_keep(model, keep, attention):
                step_loss(model, task, batch, keep).backward()
        except AssertionError:
            return None, "not dispatched"
        except Exception as e:  # the oracle's own limits (an attention form it does not know)
            return None, f"not compared: {one_line(e, 80)}"
        ref = grads(model)
        for who, g in got.items():
            rel = max_rel_diff(g, ref)[0]
            if rel > worst:
                worst, said = rel, f"{who} {attention} differs by {rel:.1e}"
    return worst, "match" if worst <= tol else said


def run_architecture(arch: Architecture, shape: Shape = STEP) -> Result:
    """Every attention implementation the model takes, within ARCH_SECONDS for the whole."""
    start = time.perf_counter()
    impls: dict = {}
    for attn in ATTN_IMPLEMENTATIONS:
        left = ARCH_SECONDS - (time.perf_counter() - start)
        if left <= 1:
            impls[attn] = ImplResult("not buildable", f"no time left of the architecture's {ARCH_SECONDS} s")
            continue
        try:
            with time_limit(left, f"{arch.name} (all implementations)"):
                impls[attn] = run_impl(arch, attn, shape)
        except ArchitectureTimeout as e:  # after the probe: Collider's steps were too slow
            impls[attn] = ImplResult("crashed", f"timed out after the probe: {e}")
        except Exception as e:  # a failure outside the guarded steps: the harness's own bug, shown as such
            where = traceback.extract_tb(e.__traceback__)[-1]
            impls[attn] = ImplResult("crashed", f"zoo harness: {one_line(e, 100)} at {where.name}:{where.lineno}")
    if all(r.cause.startswith("does not take attn_implementation") for r in impls.values()):
        with time_limit(max(ARCH_SECONDS - (time.perf_counter() - start), 1), f"{arch.name} (its own attention)"):
            try:
                impls["default"] = run_impl(arch, None, shape)  # the model's own attention, which it names otherwise
            except ArchitectureTimeout as e:
                impls["default"] = ImplResult("crashed", f"timed out after the probe: {e}")
    return Result(arch, impls, time.perf_counter() - start)


def run_equal(arch: Architecture) -> Result:
    """The coincidence run (test_equal_sizes): batch, sequence and hidden sizes equal (EQUAL)."""
    return run_architecture(arch, EQUAL)
