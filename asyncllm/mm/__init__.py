"""Multimodal plumbing shared by every vision-language family (docs/multimodal.md).

Host side (the processor thread): `images` decodes and bounds image inputs,
`videos` (and `video_files`, with PyAV) video inputs, `qwen_video` processes a
Qwen-VL video's frames, `image_bounds` bounds what the image processor makes of an image, `processor` runs the
checkpoint's HF image processor and
expands each image's and video's placeholder token into one token per feature row; the processor cache has
its host half in `host_cache` (lru mirror or the writer of the `shm_ring`) and
its core half in `core_cache` (the lru store of `cache`, each host's ring
reader). Worker side: `embeddings` runs the
model's encoder for the placeholder ranges a step reaches and scatters the
features into the input embeddings; `encoder_cache` keeps encoder outputs
across requests by item hash. A model family adds only its model file
(``embed_multimodal`` and ``mm_placeholder_length``, or ``mm_placeholder_length_of`` where the length needs the
processed values, as LLaVA-NeXT's original image size; optionally ``mm_placeholder_ids``
and ``mm_text_rows`` for placeholder runs with text tokens inside them, as Mistral 3's
row breaks and InternVL's wrappers, ``mm_image_pieces`` for an image made of several items with text between
them (Idefics3's tiles; Gemma 3's pan-and-scan crops, when ``mm_image_tiled`` says its image processor makes
them), ``mm_processor_defaults`` for image processor settings a checkpoint leaves None, ``mm_processor_call_kwargs``,
``mm_placeholder_token_of`` where the image marker is the tokenizer's, not the config's (Aya Vision's ``<image>``),
``mm_image_placeholder_id`` where an image's placeholders are another token than its marker (Gemma 3, Aya Vision,
Llama 4),
``mm_image_processor_class`` in place of ``AutoImageProcessor`` (LFM2-VL's, whose HF one needs torchvision),
``mm_check_image_processor`` for image processor settings the config must agree with (Command A Vision's
``patch_size``),
``mm_feature_extractor_class`` in place of ``AutoFeatureExtractor`` (Granite Speech's, whose HF one needs torchaudio), and
``mm_video_token_id`` / ``mm_video_pieces`` / ``video_settings`` for videos, ``mm_video_placeholder_id`` where
the placeholders are another token, ``mm_video_processing`` where the frames are not processed as Qwen-VL's
(LLaVA-NeXT-Video: asyncllm/mm/llava_video.py; ERNIE 4.5 VL: asyncllm/mm/ernie_video.py)).
"""
