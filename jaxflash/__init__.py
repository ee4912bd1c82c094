"""jaxflash: FlashAttention for JAX as Pallas GPU kernels, with a blockwise pure-JAX fallback."""

from jaxflash.attention import (decode_attention, dot_product_attention, flash_attention,
                                fp8_attention, implementation_for, ring_attention)
from jaxflash.block_mask import BlockMask, and_masks, create_block_mask, or_masks
from jaxflash.fp8 import quantize_fp8, random_rotation
from jaxflash.reference import reference_attention

__all__ = ["flash_attention", "dot_product_attention", "decode_attention", "ring_attention",
           "fp8_attention", "quantize_fp8", "random_rotation", "implementation_for",
           "reference_attention", "create_block_mask", "BlockMask", "and_masks", "or_masks"]
__version__ = "0.1.0"
