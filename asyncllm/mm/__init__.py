"""Multimodal plumbing shared by every vision-language family (docs/multimodal.md).

Host side (the processor thread): `images` decodes and bounds image inputs,
`processor` runs the checkpoint's HF image processor and expands each image's
placeholder token into one token per feature row, `cache` is the processor
cache (keys on the host, data in the core). Worker side: `embeddings` runs the
model's encoder for the placeholder ranges a step reaches and scatters the
features into the input embeddings. A model family adds only its model file
(``embed_multimodal`` and ``mm_placeholder_length``).
"""
